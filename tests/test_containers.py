"""Which of the user's containers a guarded run watches for growth: the names its code reaches (the cell,
and the globals of the functions it calls, followed through their code), read without walking the whole
namespace, so the guard's fixed cost does not grow with the notebook."""
from __future__ import annotations

from cuda_magic.recover.containers import container_lengths, reached_names


def test_names_are_followed_through_the_functions_a_cell_calls():
    ns: dict = {}
    exec("history = []\nseen = {}\nunrelated = [1]\n"
         "def log(x):\n    history.append(x)\n"
         "def step(x):\n    helper = lambda y: seen.setdefault(y, y)\n    helper(x)\n    log(x)\n", ns)
    names = reached_names(ns, "for i in range(3):\n    step(i)\n")
    assert {"step", "log", "history", "seen"} <= names       # two calls deep, and through a lambda
    assert "unrelated" not in names


def test_a_code_object_is_followed_like_a_cell(bare_ip):
    ns = bare_ip.user_ns
    exec("collected = []\ndef keep(x):\n    collected.append(x)\n", ns)

    def block():
        keep(1)  # noqa: F821 - resolved in the notebook's namespace

    assert "collected" in reached_names(ns, "", (block.__code__,))


def test_only_the_reached_names_are_read_among_ten_thousand(bare_ip):
    ns = bare_ip.user_ns
    for i in range(10_000):
        ns[f"many_{i}"] = [i]
    ns["losses"] = [1, 2]
    lengths = container_lengths(bare_ip, reached_names(ns, "losses.append(3)"))
    assert lengths == {"losses": (id(ns["losses"]), 2)}
    everything = container_lengths(bare_ip)                  # no code known: every user name
    assert len(everything) >= 10_001


def test_output_cache_and_ipython_names_are_not_the_users(bare_ip):
    ns = bare_ip.user_ns
    bare_ip.user_ns_hidden["_ih_copy"] = ns["_ih_copy"] = ["x"]     # IPython's own, still its value
    assert container_lengths(bare_ip, {"_ih_copy", "missing"}) == {}


def test_a_list_grown_by_a_function_the_cell_calls_gets_its_advice(tip):
    """`preds` is appended to inside `collect()`, defined in an earlier cell: the cell's source never
    names it, and the advice to move collected outputs to the CPU still names it."""
    tip.run_cell("%gpumem --simulate 64MiB -q")
    tip.run_cell("preds = []\n"
                 "def collect(n):\n"
                 "    with torch.no_grad():\n"
                 "        for _ in range(n):\n"
                 "            preds.append(torch.ones(1024, 1024))\n")
    report = tip.run_cell("%%oomguard --no-raise -q -o\ncollect(100)\n").result
    assert report.outcome == "oom"
    codes = [a.code for a in report.diagnosis.advice]
    assert any(c.startswith("preds.append(") and ".cpu()" in c for c in codes), codes
    tip.run_cell("%gpumem --simulate off -q")


def test_a_compiled_cells_code_reaches_what_its_source_names(bare_ip):
    """`%%oomguard` reads the names from the cell's compiled code (no second parse of its source): the
    body and its last expression, compiled apart for display, both count."""
    from cuda_magic.magics.cell import CompiledCell
    from cuda_magic.oom.cell_reading import names_in

    ns = bare_ip.user_ns
    exec("history = []\nseen = {}\nunrelated = [1]\ndef log(x):\n    history.append(x)\n", ns)
    source = "y = [seen.get(k) for k in range(2)]\nlog(y)\n"        # the last line is an expression
    compiled = CompiledCell(bare_ip, source)
    names = reached_names(ns, "", compiled.codes)
    assert names_in(source) - {"k"} <= names       # all but the comprehension's own variable
    assert {"history", "seen", "log", "y"} <= names and "unrelated" not in names
