"""Running a cell body the way IPython does: input transforms (magics inside work), the compiler's cache
(tracebacks show the cell's lines), AST transformers, and the last expression in "single" mode so that
its value is displayed and lands in Out[N]."""
from __future__ import annotations

import ast


class CompiledCell:
    def __init__(self, shell, cell: str):
        self.shell = shell
        self.source = shell.transform_cell(cell)
        self.filename = shell.compile.cache(self.source, _cell_number(shell), raw_code=cell)
        tree = shell.compile.ast_parse(self.source, filename=self.filename)
        tree = shell.transform_ast(tree)
        body = list(tree.body)
        self.last = None
        if body and isinstance(body[-1], ast.Expr):
            self.last = compile(ast.Interactive([body.pop()]), self.filename, "single",
                                flags=shell.compile.flags, dont_inherit=True)
        module = ast.Module(body, type_ignores=[])
        self.code = compile(module, self.filename, "exec", flags=shell.compile.flags, dont_inherit=True)
        self.lines = self.source.splitlines()

    def __call__(self) -> None:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in tracebacks
        shell = self.shell
        exec(self.code, shell.user_global_ns, shell.user_ns)
        if self.last is not None:
            exec(self.last, shell.user_global_ns, shell.user_ns)


def _cell_number(shell) -> int:
    """The running cell's number: IPython may already have advanced shell.execution_count."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count
