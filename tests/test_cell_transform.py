"""A guarded cell's body is transformed as IPython transforms any cell (`shell.transform_cell`); for a body
where none of IPython's token transforms can apply, its tokenizing step is left out
(magics/cell.py: transformed). The result must be IPython's own, for every kind of input."""
from __future__ import annotations

import pytest

from cuda_magic.magics.cell import transformed

CELLS = [
    "x = 1",
    "x = 1\n",
    "\n\n  y = 2\n  z = y * 3\n",                  # leading empty lines and a common indent
    ">>> a = 1\n... b = 2\n",                       # a pasted classic prompt
    "In [3]: a = 1\n   ...: b = 2\n",                # a pasted IPython prompt
    "def f(a,\n      b):\n    return a / b\n",       # a line led by spaces then a name; / inside
    "f(1\n  , 2)\n",                                 # a continuation line led by a comma: the whole path
    "/print 1",                                      # IPython's autocall escapes
    ",print a b",
    ";print a b",
    "x = !ls",
    "x = %pwd",
    "%time y = 1",
    "print?",
    "s = 'why?'\n",
    "a != b\n",
    "'%d' % 3\n",
    "for i in range(3):\n    total = i\nelse:\n    pass\n",
    "lambda: (yield)\n",
    "x = 1\n\n\n",
    "",
    "pwd",                                           # one line: the automagic prefilter
    "x = [1,\n     2]\ny = {'a': (3,\n  4)}\n",
]


@pytest.mark.parametrize("cell", CELLS)
def test_the_body_is_transformed_as_ipython_does(ip, cell):
    assert transformed(ip, cell) == ip.transform_cell(cell)


def test_a_users_own_transformers_are_applied(ip):
    def shout(lines):
        return [line.replace("quiet", "loud") for line in lines]

    ip.input_transformers_cleanup.append(shout)
    ip.input_transformers_post.append(shout)
    try:
        assert transformed(ip, "word = 'quiet'\nx = 1\n") == ip.transform_cell("word = 'quiet'\nx = 1\n")
        assert "loud" in transformed(ip, "word = 'quiet'\nx = 1\n")
    finally:
        ip.input_transformers_cleanup.remove(shout)
        ip.input_transformers_post.remove(shout)


def test_a_cell_with_a_magic_inside_runs_it(ip, capsys):
    """`%` in a body: IPython's whole transform, so the magic inside is run."""
    ip.run_cell("%%oomguard -q\nvalue = 41\n%time value = value + 1\n")
    assert ip.user_ns["value"] == 42
