"""Reprs for the records, drawn by the display layer.

The records (memory/, oom/, recover/) know nothing of how they are drawn; `display/` knows them. A
record's `repr()` and `_repr_html_` still have to reach the display, so they go through `render` below,
the one place that imports `display/` from beneath it, inside the function, when a repr is asked for.
"""
from __future__ import annotations


def render(obj, form: str) -> str | None:
    """`obj` drawn as 'text' or 'html' (None where it has no such form)."""
    from cuda_magic.display.render import render as draw   # the one deferred upward import

    return draw(obj, form)


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
