"""The census names long containers in bulk (memory/census.py: `_Namer._named_in_bulk`, `_add_all`,
`_holds_only_data` taken part by part): every name must be the one the plain walk, item by item, gives.

Each case builds a namespace, takes the census with the bulk paths on, and again with them off
(`_LARGE` above every length, so that the walk visits each item itself), and compares every storage's
names and kind. The cases are longer than a part (`_PART`), so the later parts are followed too.
"""
from __future__ import annotations

import gc

import pytest
import torch

from cuda_magic.memory import census

pytestmark = pytest.mark.usefixtures("no_gpu")

N = census._PART + 700          # more than one part


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
            m.setattr(census, "_LARGE", 10**12)
        records, _, notes = census.take_census(ns)
    return {r.storage_id: (sorted(r.names), r.kind) for r in records}, notes


def _cases():
    t = torch.ones(3)
    leaf = torch.ones(2, requires_grad=True)
    leaf.grad = torch.full((2,), 5.0)
    loss = (leaf * 3).sum()
    late = [torch.zeros(2) for _ in range(N)]
    late[N - 3] = late[N - 3].requires_grad_()
    late[N - 3].grad = torch.ones(2)
    yield "a tensor deep in the last part of rows", {"rows": _rows(N - 5, t), "t": t}
    yield "a tensor in the first row", {"rows": _rows(0, t)}
    yield "rows without tensors beside a named tensor", {"rows": _rows(), "t": t}
    yield "an object holding a tensor in a row", {"rows": _rows(N - 1, _Holder(t))}
    yield "tensors with grads and graphs", {"ts": late, "leaves": [leaf] * N, "losses": [loss] * N}
    yield "a tuple of tensors", {"tup": tuple(late)}
    yield "strings then a tensor", {"mixed": [f"w{i}" for i in range(N)] + [t]}
    yield "numbers first, then rows with a tensor", {"mixed": list(range(100)) + _rows(N - 2, t)}
    yield "untracked tuples and one holding a tensor", {"pairs": [(f"k{i}", i) for i in range(N)] + [(t, 1)]}
    yield "lists of lists, a tensor five levels down", {"deep": [[[[[i]]]] for i in range(N)] + [[[[[t]]]]]}
    yield "a tensor below the walk's depth", {"deep": [[[[[[[[[[t]]]]]]]]]] * N}
    yield "a tensor as a dict key is not named", {"keyed": [{(t, 1): i} for i in range(N)]}
    yield "a dict of rows with a tensor", {"by_id": {i: r for i, r in enumerate(_rows(N - 4, t))}}
    yield "sets and frozensets", {"sets": [frozenset({i, -i}) for i in range(N)] + [{t}]}
    yield "a module and an optimizer inside rows", {"rows": _rows(N - 6, torch.nn.Linear(2, 2))}


@pytest.mark.parametrize("what,ns", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_bulk_naming_gives_the_names_of_the_item_by_item_walk(what, ns, monkeypatch):
    gc.collect()      # the untracked tuples and dicts as a notebook's heap holds them after a collection
    bulk, bulk_notes = _census(ns, monkeypatch, bulk=True)
    walked, walked_notes = _census(ns, monkeypatch, bulk=False)
    assert bulk == walked, what
    assert bulk_notes == walked_notes


def test_the_cases_name_what_they_hold(monkeypatch):
    """The comparison above is not vacuous: the bulk paths find the tensor in the last part of rows,
    the grads of a list of tensors and the graph of a logged loss."""
    cases = dict(_cases())
    names = [n for names, _ in _census(cases["a tensor deep in the last part of rows"], monkeypatch, True)[0]
             .values() for n in names]
    assert f"rows[{N - 5}]['tags'][1]" in names
    found = _census(cases["tensors with grads and graphs"], monkeypatch, True)[0]
    all_names = {n for names, _ in found.values() for n in names}
    assert f"ts[{N - 3}].grad" in all_names and "leaves[0].grad" in all_names
    assert "losses[0] (its graph)" in all_names
    below = _census(cases["a tensor below the walk's depth"], monkeypatch, True)[0]
    assert all(not names for names, _ in below.values())
