"""Reprs for the records, drawn by the display layer.

The records (memory/, oom/, recover/, fakerun/) know nothing of how they are drawn, and this module
imports nothing above it: the display layer hands its drawing in when it is loaded (`display/render.py`
calls `register_drawer`), and the package loads the display with itself (`cuda_magic/__init__.py`), so
every record that can exist finds its forms here.
"""
from __future__ import annotations

_drawers: list = []      # the display's drawing, once it is loaded: draw(obj, form) -> str | None


def register_drawer(draw) -> None:
    """Where records are drawn from now on: `draw(obj, form)` with form 'text', 'html', 'line' or 'full'."""
    _drawers[:] = [draw]


def render(obj, form: str) -> str | None:
    """`obj` drawn as 'text' or 'html' (None where it has no such form)."""
    if not _drawers:      # the package loads the display with itself: only a broken install gets here
        raise RuntimeError("cuda_magic.display is not loaded: `import cuda_magic` loads it")
    return _drawers[0](obj, form)


class Rendered:
    """Mixin for records drawn by the display layer; use with `@dataclass(repr=False)`."""

    __slots__ = ()
    _html_repr = True     # False: text only (a record returned by `-o` shows as its text)

    def __repr__(self) -> str:
        return render(self, "text")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def _repr_html_(self) -> str | None:
        return render(self, "html") if self._html_repr else None
