"""Running a cell body the way IPython does: input transforms (magics inside work), the compiler's cache
(tracebacks show the cell's lines), AST transformers, and the last expression in "single" mode so that
its value is displayed and lands in Out[N]. A body with top-level `await` is compiled as IPython compiles
it (PyCF_ALLOW_TOP_LEVEL_AWAIT): calling it then returns a coroutine, which IPython's own async
execution awaits (see magics/awaiting.py)."""
from __future__ import annotations

import ast
import inspect

_TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


class CompiledCell:
    """`transform(tree)`: a further AST transform (the prediction's loop counters); `display_last=False`:
    the last expression is run but not displayed (nothing of a fake run lands in Out[N])."""

    def __init__(self, shell, cell: str, *, transform=None, display_last: bool = True):
        self.shell = shell
        self.source = transformed(shell, cell)
        self.filename = shell.compile.cache(self.source, _cell_number(shell), raw_code=cell)
        tree = shell.compile.ast_parse(self.source, filename=self.filename)
        tree = shell.transform_ast(tree)
        if transform is not None:
            tree = transform(tree)
        body = list(tree.body)
        flags = shell.compile.flags | _TOP_LEVEL_AWAIT
        self.last = None
        if display_last and body and isinstance(body[-1], ast.Expr):
            self.last = compile(ast.Interactive([body.pop()]), self.filename, "single", flags=flags,
                                dont_inherit=True)
        module = ast.Module(body, type_ignores=[])
        self.code = compile(module, self.filename, "exec", flags=flags, dont_inherit=True)
        self.lines = self.source.splitlines()
        self.codes = (self.code,) if self.last is None else (self.code, self.last)   # what the body runs
        self.is_async = any(_awaits(c) for c in (self.code, self.last) if c is not None)
        # `%%time` first: IPython runs the rest compiled as "<timed exec>" (no source kept); its lines
        # are the cell's from the second on
        first, _, body = cell.partition("\n")
        self.timed_lines = tuple(body.splitlines()) if first.strip() == "%%time" else None

    def __call__(self):
        """Run the body; for a body with top-level `await`, return the coroutine that runs it."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in tracebacks
        if self.is_async:
            return self._run_async()
        shell = self.shell
        with _errors_through_time(shell, self.timed_lines is not None):
            exec(self.code, shell.user_global_ns, shell.user_ns)
            if self.last is not None:
                exec(self.last, shell.user_global_ns, shell.user_ns)
        return None

    async def _run_async(self) -> None:
        __tracebackhide__ = True  # noqa: F841
        shell = self.shell
        for code in (self.code, self.last):
            if code is None:
                continue
            if _awaits(code):
                await eval(code, shell.user_global_ns, shell.user_ns)
            else:
                exec(code, shell.user_global_ns, shell.user_ns)


def transformed(shell, cell: str) -> str:
    """`shell.transform_cell(cell)`: IPython's input transforms (magics, `!cmd`, `x?`, prompts, a leading
    indent), then its dynamic ones on a one-line cell and the user's post transforms. IPython's token
    transforms tokenize the whole cell (its slowest step for a guarded cell) and each needs a `%`, `!` or
    `?`, or a line led by `,`, `;` or `/`: for a cell with none of these, with IPython's own shell and
    transformers, that step is left out and the rest are IPython's, in IPython's order. Anything else
    goes through IPython's `transform_cell` whole."""
    from IPython.core import inputtransformer2 as it2
    from IPython.core.interactiveshell import InteractiveShell

    manager = shell.input_transformer_manager
    if (type(shell).transform_cell is not InteractiveShell.transform_cell
            or type(manager) is not it2.TransformerManager
            or manager.token_transformers != _DEFAULT_TOKEN_TRANSFORMERS(it2)):
        return shell.transform_cell(cell)
    lines = (cell if cell.endswith("\n") else cell + "\n").splitlines(keepends=True)
    for transform in manager.cleanup_transforms + manager.line_transforms:
        lines = transform(lines)
    if not _token_free(lines):
        return shell.transform_cell(cell)
    source = "".join(lines)
    if len(source.splitlines()) == 1:
        with shell.builtin_trap:
            source = shell.prefilter_manager.prefilter_lines(source) + "\n"
    lines = source.splitlines(keepends=True)
    for transform in shell.input_transformers_post:
        lines = transform(lines)
    return "".join(lines)


def _DEFAULT_TOKEN_TRANSFORMERS(it2) -> list:
    return [it2.MagicAssign, it2.SystemAssign, it2.EscapedCommand, it2.HelpEnd]


def _token_free(lines: list[str]) -> bool:
    """No IPython token transform can apply: no `%`, `!` or `?` anywhere, no line led by `,`, `;`, `/`."""
    for line in lines:
        if "%" in line or "!" in line or "?" in line or line.lstrip()[:1] in (",", ";", "/"):
            return False
    return True


class _errors_through_time:
    """Around a `%%time` body: IPython before 8 has `%%time` catch the body's error and show it
    (`self.shell.showtraceback()` in its except block, IPython/core/magics/execution.py, 7.34), which
    would hide an out-of-memory error from the guard and keep its frames in sys.last_traceback. Here
    showtraceback raises such an error on instead; every other error is shown as IPython shows it.
    (IPython 8+ raises the body's error on itself; then this changes nothing.)"""

    def __init__(self, shell, timed: bool):
        self.shell, self.timed = shell, timed

    def __enter__(self):
        if not self.timed:
            return self
        from cuda_magic.devices.errors import is_oom

        shell = self.shell
        self.had = "showtraceback" in vars(shell)
        original = shell.showtraceback

        def showtraceback(*args, **kwargs):
            import sys

            exc = sys.exc_info()[1]
            if exc is not None and is_oom(exc):
                raise exc
            return original(*args, **kwargs)

        self.original = original
        shell.showtraceback = showtraceback
        return self

    def __exit__(self, *exc):
        if self.timed:
            if self.had:
                self.shell.showtraceback = self.original
            else:
                del self.shell.showtraceback
        return False


def _awaits(code) -> bool:
    return bool(code.co_flags & inspect.CO_COROUTINE)


def has_top_level_await(shell, cell: str) -> bool:
    """Whether a cell body uses `await` (or `async for` / `async with`) outside a function."""
    if "await" not in cell and "async" not in cell:
        return False
    try:
        source = shell.transform_cell(cell)
        code = compile(source, "<cell>", "exec", flags=shell.compile.flags | _TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return _awaits(code)


def _cell_number(shell) -> int:
    """The running cell's number: IPython may already have advanced shell.execution_count."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count
