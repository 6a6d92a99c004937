"""The process's resident peak, read per guarded or watched cell: after a reset, from getrusage (a few
microseconds) where that is the peak since the reset, else from /proc/self/status (VmHWM). Both ways give
the peak since the last reset by any reader. Linux only (/proc/self/clear_refs)."""
from __future__ import annotations

import os

import pytest

from cuda_magic.devices.meter import CpuMeter
from cuda_magic.devices.proc import ProcReader

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="needs Linux's /proc/self/clear_refs to reset the resident peak")

MiB = 1 << 20


def _touch(nbytes: int) -> None:
    """Make `nbytes` resident for a moment, then give them back."""
    block = bytearray(nbytes)
    for i in range(0, nbytes, 4096):
        block[i] = 1
    del block


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
