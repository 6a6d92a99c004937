"""Validation of what users type into the magics: each problem becomes one-line UsageError."""
from __future__ import annotations

from IPython.core.error import UsageError

from cuda_magic.recover.options import AskedOptions, OptionError, whole_number
from cuda_magic.units import SizeError, parse_size


def parse_count(text, flag: str = "-n") -> int:
    try:
        return whole_number(text, flag)
    except OptionError as exc:
        raise UsageError(str(exc)) from None


def parse_size_arg(text, flag: str, capacity: int | None = None, *, allow_fraction: bool = True) -> int:
    try:
        return parse_size(text, capacity, allow_fraction=allow_fraction)
    except SizeError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_device(text: str, available: list[str] | None = None) -> str:
    """The device key among `available` ('cuda:1', 'sim:0', 'cpu'; the devices here when not given) that
    `-d text` names."""
    from cuda_magic.devices.names import present_devices, resolve_device

    try:
        return resolve_device(text, present_devices() if available is None else available)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_PARSED: dict = {}      # (magic function, line) -> its options: a line typed again is not parsed again
_PARSED_MAX = 256


def parse_args(magic_func, line: str):
    """magic_arguments parsing, with every argparse complaint as the one-line UsageError. The same line
    gives the same options (argparse's parse is a function of the line): parsed once, a fresh copy each
    time, since a caller may change what it gets."""
    import argparse

    key = (getattr(magic_func, "__func__", magic_func), line)
    parsed = _PARSED.get(key)
    if parsed is None:
        parsed = _parse_line(magic_func, line)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[key] = parsed
    return argparse.Namespace(**{k: list(v) if isinstance(v, list) else v for k, v in parsed.items()})


def _parse_line(magic_func, line: str) -> dict:
    from IPython.core.magic_arguments import parse_argstring

    try:
        args = parse_argstring(magic_func, line)
    except UsageError:
        raise
    except SystemExit:
        raise UsageError(f"could not read the options {line!r}; see {magic_func.__name__}?") from None
    except ValueError as exc:   # unbalanced quotes in shlex
        raise UsageError(f"could not read the options {line!r}: {exc}") from None
    # IPython splits magic lines without removing quotes: -l '5 GiB' arrives as "'5 GiB'".
    return {key: _unquote(value) if isinstance(value, str)
            else [_unquote(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value
            for key, value in vars(args).items()}


def expanded(shell, line: str) -> str:
    """The magic's line with IPython's `$name` and `{expr}` expansion, for a magic that opts out of
    IPython's own (`@no_var_expand`): that copies the whole namespace for every line, a cost that grows
    with the notebook; here only a line with `$` or `{` is expanded, by IPython's `var_expand`, from the
    frame IPython would use (found above its run_cell_magic / run_line_magic). A magic called directly,
    not through those, is not expanded, as in IPython."""
    if "$" not in line and "{" not in line:
        return line
    import sys

    frame, depth = sys._getframe(1), 1
    while frame is not None and not (frame.f_code.co_name in ("run_cell_magic", "run_line_magic")
                                     and frame.f_locals.get("self") is shell):
        frame, depth = frame.f_back, depth + 1
    if frame is None:
        return line
    return shell.var_expand(line, depth + frame.f_locals.get("stack_depth", 1))


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def asked_options(args):
    """`%%oomguard`'s parsed flags as `recover/options.AskedOptions`: checked there, in one place."""
    return AskedOptions(retry=args.retry, accumulate=args.accumulate, floor=args.floor, search=args.search,
                        exact=args.exact, limit=args.limit, device=args.device, amp=args.amp,
                        timeline=args.timeline, no_timeline=args.no_timeline, expandable=args.expandable,
                        predict=args.predict, no_raise=args.no_raise)


def checked(asked, values):
    """(meter, GuardOptions) from `asked`'s checks (recover/options.py), each problem the one-line UsageError;
    nothing has acted yet."""
    try:
        return asked.check(values)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
