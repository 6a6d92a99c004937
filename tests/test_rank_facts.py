"""What a guard report says of the ranks of a process group is a declared, frozen record (recover/report.py
`RankFacts`, `GuardReport.ranks`), written by the core and read as such: no attribute is set on a report
that its class does not declare, none is read back with getattr."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cuda_magic.recover.report import GuardReport, RankFacts, ReleaseReport

PACKAGE = Path(__file__).resolve().parent.parent / "cuda_magic"
# a `report` in the package is a guard report or a release report (recover/release.py)
DECLARED = {n for cls in (GuardReport, ReleaseReport)
            for n in [f.name for f in dataclasses.fields(cls)] + dir(cls) if not n.startswith("__")}


def _is_report(node) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "report")
            or (isinstance(node, ast.Attribute) and node.attr == "report"))


def test_every_attribute_set_on_a_report_is_declared():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for one in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if (isinstance(one, ast.Attribute) and _is_report(one.value)
                            and one.attr not in DECLARED):
                        wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} sets report.{one.attr}")
    assert not wrong, "\n".join(wrong)


def test_no_report_field_is_read_with_getattr():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and _is_report(node.args[0])):
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


ENTRIES = ({"rank": 0, "state": "stopped", "value": None}, {"rank": 1, "state": "oom", "value": None})


def test_rank_facts_are_a_frozen_record_read_as_the_attempts():
    facts = RankFacts(1, 2, what="block")
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.rank = 0
    more = facts.added(list(ENTRIES))
    assert len(facts) == 0 and facts.failed() == []          # the record it came from is unchanged
    assert len(more) == 1 and more[-1] == ENTRIES and list(more) == [ENTRIES]
    assert more.failed() == [1] and (more.rank, more.world, more.what) == (1, 2, "block")
    assert GuardReport(device="sim").ranks is None          # outside a process group


@pytest.mark.parametrize("what, api, where", [("block", True, "block"), (None, True, "call"), (None, False, "cell")])
def test_the_short_error_names_the_ranks_from_the_record(what, api, where):
    from cuda_magic.recover.failure import short_oom_error

    report = GuardReport(device="sim", api=api, ranks=RankFacts(0, 2, what=what).added(ENTRIES))
    assert str(short_oom_error(report)) == (f"out of memory in this {where} on rank 1 of 2: every rank stopped it "
                                            "(explained in rank 0's report)")
