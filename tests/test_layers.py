"""The package's architecture, kept true: each layer imports only the layers below it (or itself), no
module imports a `_private` name of another, and there is no import circle."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cuda_magic"

# Layer of each top-level name in the package, lowest first. A module may import its own layer and below.
LAYERS = {
    "units": 0, "paths": 0, "ipython": 0, "reprs": 0,   # small shared helpers
    "devices": 1,     # reading devices: backends, NVML, the simulated device, meters, allocator settings
    "memory": 2,      # records of tensors and snapshots, the census, reachability, the per-cell watch
    "oom": 3,         # classifying and parsing OOM errors, the diagnosis and its advice
    "recover": 4,     # running a guarded call, retry policy, release, notebook references, offload, reports
    "display": 5,     # text, HTML, widget
    "magics": 6,      # what users type
    "api": 6,         # the Python API
    "__init__": 7,
}
# The one import that goes up: the records' reprs reach the display inside a function (cuda_magic/reprs.py).
DEFERRED_UP = {("cuda_magic.reprs", "cuda_magic.display.render")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path):
    """(imported module, names, at module level?) for every import of the package in a file."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cuda_magic":
                continue
            names = [a.name for a in node.names]
            # `from cuda_magic.devices import nvml` imports a module
            for n in list(names):
                if (PACKAGE.parent / target.replace(".", "/") / f"{n}.py").exists():
                    found.append((f"{target}.{n}", [], id(node) in top_level))
                    names.remove(n)
            if names:
                found.append((target, names, id(node) in top_level))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "cuda_magic":
                    found.append((a.name, [], id(node) in top_level))
    return found


def layer_of(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    assert key in LAYERS, f"{module}: no layer for {key!r}; add it to LAYERS in {__file__}"
    return LAYERS[key]


def all_modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_each_module_imports_only_its_layer_and_below():
    wrong = []
    for me, path in all_modules().items():
        for target, _, _ in imports_of(path):
            if target == "cuda_magic" and me != "cuda_magic":
                wrong.append(f"{me} imports the package itself: import the module that defines the name")
            elif layer_of(target) > layer_of(me) and (me, target) not in DEFERRED_UP:
                wrong.append(f"{me} (layer {layer_of(me)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_the_one_upward_import_is_deferred():
    for me, target in DEFERRED_UP:
        path = all_modules()[me]
        kinds = [top for t, _, top in imports_of(path) if t == target]
        assert kinds == [False], f"{me} must import {target} inside a function only"


def test_no_private_name_crosses_a_module():
    wrong = [f"{me} imports {n} from {target}"
             for me, path in all_modules().items()
             for target, names, _ in imports_of(path) if target != me
             for n in names if n.startswith("_") and not n.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    modules = all_modules()
    graph = {me: sorted({t for t, _, _ in imports_of(p) if t in modules and t != me}) for me, p in modules.items()}
    # the records reach the display only through reprs' deferred import: not a circle of module loading
    for me, target in DEFERRED_UP:
        graph[me] = [t for t in graph[me] if t != target]
    # packages' __init__ are imported before any of their modules: an edge from a child to its parent is
    # the import system's own, not the code's; only edges written in the code count (these are).
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_layer_table_catches_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a devices module that imports the display is reported."""
    bad = PACKAGE / "devices" / "zz_layer_probe.py"
    bad.write_text("from cuda_magic.display.show import show\nfrom cuda_magic.units import _private\n")
    try:
        import pytest

        with pytest.raises(AssertionError, match="zz_layer_probe .layer 1. imports cuda_magic.display.show"):
            test_each_module_imports_only_its_layer_and_below()
        with pytest.raises(AssertionError, match="imports _private from cuda_magic.units"):
            test_no_private_name_crosses_a_module()
    finally:
        bad.unlink()


def test_no_module_at_the_top_but_the_api_and_shared_helpers():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "api", "ipython", "paths", "reprs", "units"]


def test_the_text_and_html_forms_draw_from_layout_only():
    """What the forms share (bar parts, titles, attempt rows) is decided once, in display/layout.py."""
    for form in ("text", "html"):
        drawn_from = {t for t, _, _ in imports_of(PACKAGE / "display" / f"{form}.py") if t.startswith("cuda_magic.display")}
        assert drawn_from == {"cuda_magic.display.layout"}, (form, drawn_from)
    assert not [t for t, _, _ in imports_of(PACKAGE / "display" / "layout.py") if t.startswith("cuda_magic.display")]


def test_the_readme_architecture_names_real_modules_and_every_layer():
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`((?:[a-z_]+/)?[a-z_]+\.py)`", section))
    missing = sorted(p for p in named if not (PACKAGE / p).exists() and not (PACKAGE.parent / p).exists())
    assert not missing, f"README's Architecture names modules that do not exist: {missing}"
    for layer in LAYERS:
        if layer != "__init__":
            assert f"`{layer}/`" in section or f"`{layer}.py`" in section, f"README's Architecture lacks {layer}"
