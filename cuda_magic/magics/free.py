"""`%freecuda`: give device memory back without a restart. A thin layer over recover/release.py."""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from cuda_magic.magics.args import parse_args


@magics_class
class FreeMagics(Magics):
    @magic_arguments()
    @argument("names", nargs="*", metavar="NAME", help="also delete these variables (or move them, with --offload)")
    @argument("--offload", action="store_true", help="move the named variables to the CPU instead of deleting them")
    @argument("--all", dest="all_vars", action="store_true", help="delete every user variable that holds device tensors")
    @argument("-n", "--dry-run", dest="dry_run", action="store_true", help="say what would be done; change nothing")
    @argument("-q", dest="quiet", action="store_true", help="display nothing")
    @argument("-o", dest="output", action="store_true", help="return the report object")
    @line_magic
    def freecuda(self, line=""):
        """Drop what only the notebook machinery holds (last error, output cache), collect garbage, empty
        the allocator cache, and report the bytes freed and the variables that still hold device memory."""
        from cuda_magic.recover.release import MissingNames, free_all_variables, free_variables, release

        args = parse_args(self.freecuda, line)
        for name in args.names:
            if not name.isidentifier():
                raise UsageError(f"%freecuda takes variable names, not {name!r}")
        if args.offload and not (args.names or args.all_vars):
            raise UsageError("--offload needs the variables to move: %freecuda --offload NAME ...")
        if args.all_vars and args.names:
            raise UsageError("give NAME ... or --all, not both")
        if args.all_vars:
            report = free_all_variables(self.shell, offload=args.offload, dry_run=args.dry_run)
        elif args.names:
            try:
                report = free_variables(self.shell, args.names, offload=args.offload, dry_run=args.dry_run)
            except MissingNames as exc:
                raise UsageError(f"%freecuda: {exc}") from None
        else:
            report = release(self.shell, dry_run=args.dry_run)
        if not args.quiet:
            from cuda_magic.display.show import show

            show(report)
        return report if args.output else None
