"""How cuda_magic shows its records: plain text (text.py), HTML (html.py), ipywidgets (widget.py),
and show.py, which picks the form the frontend can render (CUDA_MAGIC_DISPLAY=text|html|widget forces one).

Importing this package imports neither IPython nor ipywidgets.
"""
from cuda_magic.display.show import display_form, show, show_guard, show_watch

__all__ = ["display_form", "show", "show_guard", "show_watch"]
