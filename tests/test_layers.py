"""The package's architecture, kept true: each layer imports only the layers below it (or itself), no
module imports a `_private` name of another, and there is no import circle."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cuda_magic"

# Layer of each top-level name in the package, lowest first. A module may import its own layer and below.
LAYERS = {
    "units": 0, "paths": 0, "ipython": 0, "reprs": 0,   # small shared helpers
    "devices": 1,     # reading devices, which errors are OOMs, the simulated device, meters, allocator settings
    "memory": 2,      # records of tensors and snapshots, the census, reachability, the per-cell watch
    "oom": 3,         # parsing OOM messages, the diagnosis and its advice
    "recover": 4,     # running a guarded call, retry policy, release, notebook references, offload, reports
    "fakerun": 5,     # predicting a cell's memory from fake runs, before running it
    "display": 6,     # text, HTML, widget
    "magics": 7,      # what users type
    "api": 7,         # the Python API
    "__init__": 8,
}
# No import goes up, at module level or inside a function: the records reach their forms through a
# registry the display fills when it is loaded (cuda_magic/reprs.py).


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: Path = PACKAGE):
    """(imported module, names, at module level?) for every import of the package in a file."""
    tree = ast.parse(path.read_text())
    me = module_name(path, package)
    parent = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cuda_magic":
                continue
            names = [a.name for a in node.names]
            # `from cuda_magic.devices import nvml` imports a module
            for n in list(names):
                if (package.parent / target.replace(".", "/") / f"{n}.py").exists():
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


def all_modules(package: Path = PACKAGE):
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def test_each_module_imports_only_its_layer_and_below(package: Path = PACKAGE):
    wrong = []
    for me, path in all_modules(package).items():
        for target, _, _ in imports_of(path, package):
            if target == "cuda_magic" and me != "cuda_magic":
                wrong.append(f"{me} imports the package itself: import the module that defines the name")
            elif layer_of(target) > layer_of(me):
                wrong.append(f"{me} (layer {layer_of(me)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_module(package: Path = PACKAGE):
    wrong = [f"{me} imports {n} from {target}"
             for me, path in all_modules(package).items()
             for target, names, _ in imports_of(path, package) if target != me
             for n in names if n.startswith("_") and not n.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle(package: Path = PACKAGE):
    modules = all_modules(package)
    # every import counts, at module level or inside a function: a deferred import closes a circle too
    graph = {me: sorted({t for t, _, _ in imports_of(p, package) if t in modules and t != me})
             for me, p in modules.items()}
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


# -- the core and its adapters ------------------------------------------------------------------------
# The one path after an out-of-memory error is the core's (recover/guarded.py, with its retry loop): its
# steps are called there and nowhere else, and the guard report is written there alone (the release
# report by the clean-up that makes it); every other module (the magics, the API, the display) reads.
CORE = {"cuda_magic.recover.guarded", "cuda_magic.recover.retry_loop", "cuda_magic.recover.ranked_retry",
        "cuda_magic.recover.ranked_block"}
FAILURE_STEPS = {
    "cuda_magic.recover.failure": {"read_failure", "release_failure", "kinds_at_failure"},
    "cuda_magic.memory.blackbox": {"blackbox_from"},
    "cuda_magic.devices.recording": {"Recording"},
    "cuda_magic.recover.notebook_refs": {"drop_exception"},
}
# the modules that define the steps, and the clean-up of %freecuda, which drops the notebook's references
DEFINERS = {"cuda_magic.recover.failure", "cuda_magic.recover.release", "cuda_magic.devices.recording",
            "cuda_magic.memory.blackbox", "cuda_magic.recover.notebook_refs"}
REPORT_WRITERS = CORE | {"cuda_magic.recover.report", "cuda_magic.recover.release"}
# the prediction (fakerun/) runs nothing that can fail for real: it turns its fake run's recording into a
# black box (its chart and its lines at the peak), and takes no other step of the path
PREDICTION = {"cuda_magic.fakerun.planner": {"blackbox_from"}}


def test_the_failure_path_is_taken_by_the_core_alone(package: Path = PACKAGE):
    wrong = []
    for me, path in all_modules(package).items():
        if me in CORE or me in DEFINERS:
            continue
        for target, names, _ in imports_of(path, package):
            steps = FAILURE_STEPS.get(target, set()) & set(names) - PREDICTION.get(me, set())
            if steps:
                wrong.append(f"{me} takes the core's steps {sorted(steps)} from {target}: ask a GuardedRun")
    assert not wrong, "\n".join(wrong)


def _report_writes(path: Path) -> list[str]:
    """`report.x = ...`, `report.x += ...`, `report.x[k] = ...`, `report.x.append(...)` and the like."""
    def on_report(node) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
            if isinstance(node, ast.Name) and node.id == "report":
                return True
            if isinstance(node, ast.Attribute) and node.attr == "report":
                return True
        return False

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "insert", "update", "pop", "remove", "clear", "setdefault"):
            targets = [node.func.value]
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and (on_report(t) or (
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "report")):
                found.add(node.lineno)
    return [f"{path.name}:{n}" for n in sorted(found)]


def test_the_report_is_written_by_the_core_alone(package: Path = PACKAGE):
    wrong = [f"{me} writes the report ({', '.join(lines)})"
             for me, path in all_modules(package).items() if me not in REPORT_WRITERS
             for lines in [_report_writes(path)] if lines]
    assert not wrong, "\n".join(wrong)


def _copy_of_the_package(tmp_path) -> Path:
    import shutil

    copy = tmp_path / "cuda_magic"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_checks_catch_an_upward_import_and_a_private_name(tmp_path):
    """The checks above can fail: on a copy of the package, a devices module that imports the display and
    a private name is reported (the source tree is not touched)."""
    import pytest

    copy = _copy_of_the_package(tmp_path)
    (copy / "devices" / "zz_layer_probe.py").write_text(
        "from cuda_magic.display.show import show\nfrom cuda_magic.units import _private\n")
    with pytest.raises(AssertionError, match="zz_layer_probe .layer 1. imports cuda_magic.display.show"):
        test_each_module_imports_only_its_layer_and_below(copy)
    with pytest.raises(AssertionError, match="imports _private from cuda_magic.units"):
        test_no_private_name_crosses_a_module(copy)
    assert not (PACKAGE / "devices" / "zz_layer_probe.py").exists()


def test_the_checks_catch_a_circle_through_a_function_level_import(tmp_path):
    """A circle closed by an import inside a function (and a relative one) is reported, as is a deferred
    import that goes up: a tiny package of four modules, two layers."""
    import pytest

    tiny = tmp_path / "cuda_magic"
    (tiny / "devices").mkdir(parents=True)
    (tiny / "display").mkdir()
    for init in (tiny / "__init__.py", tiny / "devices" / "__init__.py", tiny / "display" / "__init__.py"):
        init.write_text("")
    (tiny / "devices" / "first.py").write_text("from cuda_magic.devices.second import two\n\n\ndef one():\n"
                                                "    return two()\n")
    (tiny / "devices" / "second.py").write_text("def two():\n    from . import first\n\n    return first\n")
    (tiny / "reprs.py").write_text("def render(obj):\n    from cuda_magic.display.draw import draw\n\n"
                                   "    return draw(obj)\n")
    (tiny / "display" / "draw.py").write_text("from cuda_magic.reprs import render\n\n\ndef draw(obj):\n"
                                              "    return str(obj)\n")
    with pytest.raises(AssertionError) as circles:
        test_no_import_circle(tiny)
    found = str(circles.value)
    assert "cuda_magic.devices.first -> cuda_magic.devices.second -> cuda_magic.devices.first" in found
    assert "cuda_magic.display.draw -> cuda_magic.reprs -> cuda_magic.display.draw" in found
    with pytest.raises(AssertionError, match="cuda_magic.reprs .layer 0. imports cuda_magic.display.draw .layer 6."):
        test_each_module_imports_only_its_layer_and_below(tiny)


def test_the_checks_catch_a_second_copy_of_the_failure_path(tmp_path):
    """An adapter that releases the failure and finishes the black box itself, and writes the report, is
    reported: a second copy of the sequence after a failure cannot come back unseen."""
    import pytest

    copy = _copy_of_the_package(tmp_path)
    (copy / "magics" / "zz_second_path.py").write_text(
        "from cuda_magic.recover.failure import read_failure, release_failure\n"
        "from cuda_magic.memory.blackbox import blackbox_from\n\n\n"
        "def handler(exc, meter, recorder, report):\n"
        "    failure = read_failure(exc, meter)\n"
        "    report.oom = failure.oom\n"
        "    report.warnings.append('copied')\n"
        "    release_failure(exc, failure, meter)\n"
        "    report.blackbox = blackbox_from(recorder)\n")
    with pytest.raises(AssertionError, match=r"zz_second_path takes the core's steps \['read_failure', "
                                             r"'release_failure'\]"):
        test_the_failure_path_is_taken_by_the_core_alone(copy)
    with pytest.raises(AssertionError, match=r"zz_second_path writes the report \(zz_second_path.py:7, "
                                             r"zz_second_path.py:8, zz_second_path.py:10\)\n"):
        test_the_report_is_written_by_the_core_alone(copy)


def test_no_module_at_the_top_but_the_api_and_shared_helpers():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "api", "ipython", "paths", "reprs", "units"]


def test_the_text_and_html_forms_draw_from_layout_only():
    """What the forms share (bar parts, titles, attempt rows) is decided once, in display/layout.py, and what
    a guard report leads with in display/answer.py; they draw with display/elements.py and include the
    black box's view (display/blackbox_view.py) directly."""
    for form in ("text", "html"):
        drawn_from = {t for t, _, _ in imports_of(PACKAGE / "display" / f"{form}.py") if t.startswith("cuda_magic.display")}
        assert drawn_from == {"cuda_magic.display.layout", "cuda_magic.display.elements",
                              "cuda_magic.display.blackbox_view", "cuda_magic.display.answer"}, (form, drawn_from)
    assert not [t for t, _, _ in imports_of(PACKAGE / "display" / "layout.py") if t.startswith("cuda_magic.display")]
    answer = {t for t, _, _ in imports_of(PACKAGE / "display" / "answer.py") if t.startswith("cuda_magic.display")}
    assert answer <= {"cuda_magic.display.layout", "cuda_magic.display.elements", "cuda_magic.display.blackbox_view"}


def test_the_architecture_doc_names_real_modules_and_every_layer():
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    assert "docs/architecture.md" in readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    for section in (readme.split("## Architecture", 1)[1].split("\n## ", 1)[0],
                    (PACKAGE.parent / "docs" / "architecture.md").read_text()):
        named = set(re.findall(r"`((?:[a-z_]+/)?[a-z_]+\.py)`", section))
        missing = sorted(p for p in named if not (PACKAGE / p).exists() and not (PACKAGE.parent / p).exists())
        assert not missing, f"the Architecture names modules that do not exist: {missing}"
    for layer in LAYERS:
        if layer != "__init__":
            assert f"`{layer}/`" in section or f"`{layer}.py`" in section, f"docs/architecture.md lacks {layer}"


def test_the_readme_is_one_a_user_reads_to_the_end():
    """The README is for the user (at most 350 lines); the detail lives in docs/, and every docs/ page the
    README links exists."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    assert len(readme.splitlines()) <= 350, len(readme.splitlines())
    for target in set(re.findall(r"\]\((docs/[^)#]+)", readme)):
        assert (PACKAGE.parent / target).exists(), target


# -- adapters reach other objects through what they publish -------------------------------------------
ADAPTERS = ("magics/", "api.py")


def _private_reaches(path: Path) -> list[str]:
    """`obj._name` in a module, where `obj` is neither `self` nor `cls` (an object's own privates) nor a
    module from outside the package (`sys._getframe`, torch's); IPython's `_repr_*_` protocol names aside."""
    tree = ast.parse(path.read_text())
    outside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            outside |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("cuda_magic")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("cuda_magic"):
            outside |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name.endswith("_"):
            continue
        base = node.value
        while isinstance(base, ast.Attribute) and not base.attr.startswith("_"):
            base = base.value           # torch.cuda.memory._snapshot: through the outside module's names
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") and base is node.value or base.id in outside):
            continue
        found.append(f"{path.name}:{node.lineno} .{name}")
    return found


def test_no_adapter_reaches_another_objects_private(package: Path = PACKAGE):
    """The magics and the API call what the core (and each other) publish: `magics._meter(...)` on another
    adapter's instance, or `module._helper(...)`, is a private reached from outside (the prediction's adapter
    once called GuardMagics' `_retry_options`, `_meter` and `_expandable_segments`)."""
    wrong = [f"{me} reaches a private: {', '.join(hits)}"
             for me, path in all_modules(package).items()
             if str(path.relative_to(package)).startswith(ADAPTERS)
             for hits in [_private_reaches(path)] if hits]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_an_adapter_calling_another_adapters_private(tmp_path):
    import pytest

    copy = _copy_of_the_package(tmp_path)
    (copy / "magics" / "zz_reach.py").write_text(
        "import sys\n\n\n"
        "def predict(magics, args):\n"
        "    frame = sys._getframe(1)\n"
        "    return magics._meter(args), frame\n")
    with pytest.raises(AssertionError, match=r"zz_reach reaches a private: zz_reach.py:6 \._meter\n"):
        test_no_adapter_reaches_another_objects_private(copy)


# two classes of one name are two things a reader must tell apart by their module: none is left (the
# snapshot file's own records are DeviceSnapshot and ReplayFailure since issue 40)
SHARED_CLASS_NAMES: set[str] = set()


def test_no_two_classes_share_a_name():
    """The prediction a user gets is `Prediction` (fakerun/prediction.py); the retry's next value to try is
    `NextValue` (recover/retry.py), no longer a second `Prediction`."""
    import collections

    where = collections.defaultdict(list)
    for me, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(me)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert set(shared) <= SHARED_CLASS_NAMES, {n: m for n, m in shared.items() if n not in SHARED_CLASS_NAMES}
    assert set(shared) == SHARED_CLASS_NAMES, f"{SHARED_CLASS_NAMES - set(shared)} now unique: take it off the list"
