"""The census names long containers in bulk (memory/naming.py: `Namer._named_in_bulk`, `_add_all`;
memory/data_only.py: `holds_only_data` taken part by part): every name must be the one the plain walk,
item by item, gives.

Each case builds a namespace, takes the census with the bulk paths on, and again with them off
(`naming.LARGE` above every length, so that the walk visits each item itself), and compares every storage's
names and kind. The cases are longer than a part (`data_only.PART`), so the later parts are followed too.
"""
from __future__ import annotations

import gc

import pytest
import torch

from cuda_magic.memory import census, data_only, naming

pytestmark = pytest.mark.usefixtures("no_gpu")

N = data_only.PART + 700          # more than one part


class _Holder:
    def __init__(self, value):
        self.value = value


def _rows(tensor_at=None, value=None):
    rows = [{"id": i, "label": f"row{i}", "tags": [i % 7]} for i in range(N)]
    if tensor_at is not None:
        rows[tensor_at]["tags"].append(value)
    return rows


def _census(ns: dict, monkeypatch, bulk: bool) -> dict:
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(naming, "LARGE", 10**12)
        records, _, notes = census.take_census(ns)
    return {r.storage_id: (sorted(r.names), r.kind) for r in records}, notes


def _cases() -> dict:
    """{what: the namespace}. Built inside each test, so that no tensor outlives it (a later test's census
    would count it)."""
    t = torch.ones(3)
    leaf = torch.ones(2, requires_grad=True)
    leaf.grad = torch.full((2,), 5.0)
    loss = (leaf * 3).sum()
    late = [torch.zeros(2) for _ in range(N)]
    late[N - 3] = late[N - 3].requires_grad_()
    late[N - 3].grad = torch.ones(2)
    return {
        "a tensor deep in the last part of rows": {"rows": _rows(N - 5, t), "t": t},
        "a tensor in the first row": {"rows": _rows(0, t)},
        "rows without tensors beside a named tensor": {"rows": _rows(), "t": t},
        "an object holding a tensor in a row": {"rows": _rows(N - 1, _Holder(t))},
        "tensors with grads and graphs": {"ts": late, "leaves": [leaf] * N, "losses": [loss] * N},
        "a tuple of tensors": {"tup": tuple(late)},
        "strings then a tensor": {"mixed": [f"w{i}" for i in range(N)] + [t]},
        "numbers first, then rows with a tensor": {"mixed": list(range(100)) + _rows(N - 2, t)},
        "untracked tuples and one holding a tensor": {"pairs": [(f"k{i}", i) for i in range(N)] + [(t, 1)]},
        "lists of lists, a tensor five levels down": {"deep": [[[[[i]]]] for i in range(N)] + [[[[[t]]]]]},
        "a tensor below the walk's depth": {"deep": [[[[[[[[[[t]]]]]]]]]] * N},
        "a tensor as a dict key is not named": {"keyed": [{(t, 1): i} for i in range(N)]},
        "a dict of rows with a tensor": {"by_id": {i: r for i, r in enumerate(_rows(N - 4, t))}},
        "sets and frozensets": {"sets": [frozenset({i, -i}) for i in range(N)] + [{t}]},
        "a module and an optimizer inside rows": {"rows": _rows(N - 6, torch.nn.Linear(2, 2))},
    }


CASES = ("a tensor deep in the last part of rows", "a tensor in the first row",
         "rows without tensors beside a named tensor", "an object holding a tensor in a row",
         "tensors with grads and graphs", "a tuple of tensors", "strings then a tensor",
         "numbers first, then rows with a tensor", "untracked tuples and one holding a tensor",
         "lists of lists, a tensor five levels down", "a tensor below the walk's depth",
         "a tensor as a dict key is not named", "a dict of rows with a tensor", "sets and frozensets",
         "a module and an optimizer inside rows")


@pytest.mark.parametrize("what", CASES)
def test_bulk_naming_gives_the_names_of_the_item_by_item_walk(what, monkeypatch):
    ns = _cases()[what]
    gc.collect()      # the untracked tuples and dicts as a notebook's heap holds them after a collection
    bulk, bulk_notes = _census(ns, monkeypatch, bulk=True)
    walked, walked_notes = _census(ns, monkeypatch, bulk=False)
    assert bulk == walked, what
    assert bulk_notes == walked_notes
    del ns, bulk, walked


def test_the_cases_name_what_they_hold(monkeypatch):
    """The comparison above is not vacuous: the bulk paths find the tensor in the last part of rows,
    the grads of a list of tensors and the graph of a logged loss."""
    cases = _cases()
    assert set(cases) == set(CASES)
    names = [n for names, _ in _census(cases["a tensor deep in the last part of rows"], monkeypatch, True)[0]
             .values() for n in names]
    assert f"rows[{N - 5}]['tags'][1]" in names
    found = _census(cases["tensors with grads and graphs"], monkeypatch, True)[0]
    all_names = {n for names, _ in found.values() for n in names}
    assert f"ts[{N - 3}].grad" in all_names and "leaves[0].grad" in all_names
    assert "losses[0] (its graph)" in all_names
    below = _census(cases["a tensor below the walk's depth"], monkeypatch, True)[0]
    assert all(not names for names, _ in below.values())


def test_rows_keyed_by_what_holds_a_tensor_hold_only_data():
    """The probe reads a level of dicts with gc.get_referents, which gives the keys of a dict not keyed
    by strings too; the walk names values only, so where a key holds a tensor the values alone decide."""
    t = torch.ones(1)
    rows = [{(t, i): [i]} for i in range(N)]
    assert data_only.holds_only_data(rows, {dict}, naming.MAX_DEPTH + 1)
    rows.append({"x": [t]})
    assert not data_only.holds_only_data(rows, {dict}, naming.MAX_DEPTH + 1)
