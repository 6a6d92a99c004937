"""The process's resident peak, read per guarded or watched cell: after a reset, from getrusage (a few
microseconds) where that is the peak since the reset, else from /proc/self/status (VmHWM). Both ways give
the peak since the last reset by any reader. Linux only (/proc/self/clear_refs)."""
from __future__ import annotations

import mmap
import os

import pytest

from cuda_magic.devices.meter import CpuMeter
from cuda_magic.devices.proc import ProcReader

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="needs Linux's /proc/self/clear_refs to reset the resident peak")

MiB = 1 << 20


def _touch(nbytes: int) -> None:
    """Make `nbytes` resident for a moment, then give them back: an anonymous mapping of its own, so that
    the pages are new whatever malloc keeps (a bytearray can be served from pages an earlier test left
    resident in malloc's heap, and then the resident size does not grow)."""
    block = mmap.mmap(-1, nbytes)
    for i in range(0, nbytes, 4096):
        block[i] = 1
    block.close()


def _status_peak() -> int:
    with open("/proc/self/status") as fh:
        line = next(x for x in fh if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_the_peak_after_a_reset_is_the_peak_since_it():
    reader = ProcReader()
    try:
        start = reader.start_cell()
        _touch(96 * MiB)
        rss, peak = reader.end_cell()
        assert peak >= start + 90 * MiB                 # the block was resident inside the cell
        assert rss < start + 48 * MiB                   # and is gone now
        assert abs(peak - _status_peak()) <= 1 * MiB    # the kernel's own figure
    finally:
        reader.close()


def test_after_another_readers_reset_the_peak_is_since_that_reset():
    first, second = ProcReader(), ProcReader()
    try:
        first.start_cell()
        _touch(96 * MiB)
        high = first.rss_and_peak()[1]
        second.start_cell()                             # e.g. --watch's reader, then the guard's
        rss, peak = first.rss_and_peak()
        assert peak < high - 48 * MiB                   # not the peak from before the second reset
        assert abs(peak - _status_peak()) <= 1 * MiB
        assert peak >= rss
    finally:
        first.close()
        second.close()


def test_the_cpu_meter_reads_the_runs_peak():
    meter = CpuMeter()
    before = meter.allocated()
    meter.reset_peak()
    _touch(64 * MiB)
    assert meter.peak() >= before + 60 * MiB
    assert meter.peak() >= meter.allocated()



class _Counted:
    """The reader's system calls, counted (each still made)."""

    def __init__(self, monkeypatch, reader):
        from cuda_magic.devices import proc

        self.calls = []
        for name, real in (("_pread", os.pread), ("_write", os.write), ("_getrusage", proc.resource.getrusage)):
            monkeypatch.setattr(proc, name, self._counting(name.strip("_"), real))
        status = reader._status
        monkeypatch.setattr(reader, "_status", lambda: self.calls.append("status") or status())

    def _counting(self, name, real):
        def call(*args):
            self.calls.append(name)
            return real(*args)
        return call


def test_a_watched_cell_costs_four_system_calls_its_peak_high_or_not(monkeypatch):
    """start_cell: the reset and statm; the peak: statm and getrusage, whose mark is VmHWM once it is
    above the lowest mark read (the process's own record is at most that). No /proc/self/status."""
    from cuda_magic.devices import proc

    reader = ProcReader()
    try:
        reader.start_cell()
        reader.end_cell()                               # a first reading: the lowest mark so far
        record = proc.resource.getrusage(proc.resource.RUSAGE_SELF).ru_maxrss * 1024
        if record > reader.rss() + 64 * MiB:
            pytest.skip("this process's record from before its exec is above its RSS: the peak of a "
                        "cell below it comes from /proc/self/status")
        counted = _Counted(monkeypatch, reader)
        start = reader.start_cell()
        rss, peak = reader.end_cell()                   # a trivial cell
        assert counted.calls == ["write", "pread", "pread", "getrusage"]
        assert start > 0 and peak >= rss > 0
        assert abs(peak - _status_peak()) <= 1 * MiB    # the kernel's own figure
        counted.calls.clear()
        start = reader.start_cell()
        _touch(96 * MiB)                                # a peak far above RSS
        rss, peak = reader.end_cell()
        assert counted.calls == ["write", "pread", "pread", "getrusage"]
        assert peak >= start + 90 * MiB and rss < start + 48 * MiB
        assert abs(peak - _status_peak()) <= 1 * MiB
    finally:
        reader.close()


_AFTER_EXEC = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from cuda_magic.devices.proc import ProcReader
reader = ProcReader()
start = reader.start_cell()
rss, peak = reader.end_cell()
with open("/proc/self/status") as fh:
    hwm = int(next(x for x in fh if x.startswith("VmHWM:")).split()[1]) * 1024
print(json.dumps({"start": start, "rss": rss, "peak": peak, "hwm": hwm,
                  "record": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_the_record_of_the_image_replaced_at_exec_is_not_taken_for_a_peak(tmp_path):
    """A process that held 200 MiB execs Python (as a large Jupyter server starts a kernel): getrusage
    reports those 200 MiB for the whole life of the new image (fs/exec.c, exec_mmap). The peak of a
    cell there is VmHWM, not that record."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    parent = ("import os, sys\nb = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
              f"os.execv(sys.executable, [sys.executable, '-c', {_AFTER_EXEC!r}, {root!r}])\n")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["record"] >= got["start"] + 150 * MiB    # the old image's mark, above this one's RSS
    assert got["peak"] < got["start"] + 48 * MiB        # the cell's peak is not that mark
    assert abs(got["peak"] - got["hwm"]) <= 1 * MiB
    assert got["peak"] >= got["rss"]


def test_a_peak_reached_in_another_thread_is_the_cells_peak():
    """The peak is read with getrusage(RUSAGE_THREAD), whose ru_maxrss is the process's (its record and its
    memory's high-water mark, kernel/sys.c k_getrusage), not the calling thread's: memory a DataLoader
    thread or a gauge's thread made resident counts."""
    import threading

    reader = ProcReader()
    try:
        start = reader.start_cell()
        worker = threading.Thread(target=_touch, args=(96 * MiB,))
        worker.start()
        worker.join()
        rss, peak = reader.end_cell()
        assert peak >= start + 90 * MiB and rss < start + 48 * MiB
        assert abs(peak - _status_peak()) <= 1 * MiB
    finally:
        reader.close()
