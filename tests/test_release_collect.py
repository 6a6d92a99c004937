"""The release after a guarded OOM collects the whole heap only where a reference cycle can still hold what
the failed run made (recover/failure.py, release_failure): a cell whose failed frames held plain tensors
gets them back by reference counting and a collection of the young generations; a tensor that sits in a
cycle in the oldest generation is freed too, by the full collection the device's figure calls for."""
from __future__ import annotations

import gc

import pytest

from conftest import run_ok


@pytest.fixture
def collections(monkeypatch):
    """The generations each `gc.collect` call asked for (None: the whole heap), in order."""
    asked = []
    collect = gc.collect

    def spy(generation=2):
        asked.append(generation)
        return collect(generation)

    monkeypatch.setattr(gc, "collect", spy)
    return asked


def test_an_oom_whose_frames_held_plain_tensors_needs_no_full_collection(tip, collections):
    run_ok(tip, "refs = []\n"
                "def step(n):\n"
                "    act = torch.ones(n, 1024)\n"
                "    refs.append(weakref.ref(act))\n"
                "    return torch.empty(n * 64, 1024)\n")
    report = tip.run_cell("%%oomguard -l 16MiB --no-raise -q -o\nstep(256)").result
    assert report.outcome == "oom"
    assert tip.user_ns["refs"][0]() is None            # the failed frame's tensor is gone
    assert collections == [1]                          # the young generations only
    attempt, = report.attempts
    assert report.after[0].torch_allocated <= attempt.start_allocated


def test_a_tensor_in_an_old_reference_cycle_is_freed_by_the_full_collection(tip, collections):
    run_ok(tip, "refs = []\n"
                "class Node:\n"
                "    pass\n"
                "def step(n):\n"
                "    node = Node()\n"
                "    node.me = node                    # a cycle: reference counting alone never frees it\n"
                "    node.act = torch.ones(n, 1024)\n"
                "    refs.append(weakref.ref(node.act))\n"
                "    gc.collect()                      # survivors move to the oldest generation\n"
                "    gc.collect()\n"
                "    return torch.empty(n * 64, 1024)\n")
    collections.clear()
    report = tip.run_cell("%%oomguard -l 16MiB --no-raise -q -o\nstep(256)").result
    assert report.outcome == "oom"
    assert tip.user_ns["refs"][0]() is None
    # the cell's own two collections, the young generations, then the whole heap (the device still held
    # the cycle's 1 MiB after the young ones)
    assert collections[:2] == [2, 2] and collections[2:] == [1, 2]
    attempt, = report.attempts
    assert report.after[0].torch_allocated <= attempt.start_allocated
