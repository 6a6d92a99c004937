"""A record drawn as text or HTML: what the records' reprs (cuda_magic.reprs) call. Loading this module
registers it there (the display package loads it, and the package loads the display)."""
from __future__ import annotations

from cuda_magic.reprs import register_drawer


def render(obj, form: str) -> str | None:
    from cuda_magic.display.show import forms_of

    if form == "line":
        from cuda_magic.display.text import guard_line

        return guard_line(obj)
    if form == "full":                  # a guard report with its folded part (print(report))
        from cuda_magic.display.text import guard_text

        return guard_text(obj, full=True)
    text, html, _ = forms_of(obj)
    return text() if form == "text" else html()


register_drawer(render)
