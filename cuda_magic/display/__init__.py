"""How cuda_magic shows its records: plain text (text.py), HTML (html.py), ipywidgets (widget.py),
and show.py, which picks the form the frontend can render (CUDA_MAGIC_DISPLAY=text|html|widget forces one).

Importing this package imports nothing but render.py, which registers the records' forms
(cuda_magic/reprs.py); the forms are loaded when a record is first drawn.
"""
from cuda_magic.display import render  # noqa: F401 - registers the records' forms
