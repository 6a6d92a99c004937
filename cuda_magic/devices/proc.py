"""This process's memory from the operating system: /proc/meminfo, resident bytes and their peak."""
from __future__ import annotations

import os
import sys

try:
    import resource
except ImportError:   # Windows
    resource = None

# bound once: `--watch` reads them twice a cell, and a module attribute looked up each time costs more than
# the system call's own Python wrapper
_pread, _write = os.pread, os.write
if resource is not None:
    # the peak a ProcReader reads: ru_maxrss is the process's for RUSAGE_THREAD too (the larger of the
    # process's record and its memory's high-water mark: kernel/sys.c, getrusage), without the walk over
    # every thread's times that RUSAGE_SELF makes (about 1 us less a call here, 2 us after a cell)
    _getrusage = resource.getrusage
    _WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def meminfo() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/meminfo", "rb") as fh:   # one read, parsed as bytes: about half the time of text lines
            text = fh.read()
    except OSError:
        return values
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.decode()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == b"kB" else 1)
    return values


def process_rss() -> tuple[int | None, int | None]:
    """(resident bytes now, resident peak bytes) of this process, from the operating system."""
    rss = hwm = None
    try:
        with open("/proc/self/status", "rb") as fh:
            text = fh.read()
        rss, hwm = status_bytes(text, b"\nVmRSS:"), status_bytes(text, b"\nVmHWM:")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm = peak if sys.platform == "darwin" else peak * 1024
    return rss, hwm


def status_bytes(text: bytes, field: bytes) -> int | None:
    """A `kB` field of /proc/self/status (`field` with its leading newline), in bytes."""
    i = text.find(field)
    return int(text[i + len(field):text.index(b"kB", i)]) * 1024 if i >= 0 else None



_PEAK_SLACK = 256 * 1024   # bytes: how far getrusage's mark may sit above the RSS figures and be taken
_resets = 0                # resets of the process's peak by any reader: a reader trusts getrusage only
                           # for readings after its own reset
_mark_floor = None         # bytes: the lowest getrusage mark read in this process (see ProcReader)


class ProcReader:
    """Reads this process's memory through descriptors opened once.

    The peak: /proc/self/status (VmHWM) costs about 10-20 us to generate; /proc/self/statm (RSS) and
    getrusage a few each. getrusage's ru_maxrss is the larger of VmHWM and the process's own record
    (signal->maxrss: kernel/sys.c, getrusage), which holds the mark of the image this process replaced at
    exec (fs/exec.c, exec_mmap; a Jupyter kernel started by a large server carries the server's) and
    changes again only when the whole process exits (kernel/exit.c, do_exit): a constant while we run.
    So a mark above the lowest mark ever read here (`_mark_floor`, at least that record) is VmHWM
    itself; a mark within `_PEAK_SLACK` of the RSS at the reset or now is the peak to the slack (the peak
    since the reset lies between those and the mark); anything else is read from /proc/self/status.
    `start_cell` resets the peak and reads RSS (two system calls); until another reset (by any reader)
    the peak then costs two more (statm, getrusage), and a read of /proc/self/status only where the mark
    may be that record.
    """

    def __init__(self):
        self.status_fd = self.clear_fd = self.statm_fd = self.meminfo_fd = None
        self.page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._since = None          # (the reset count after this reader's reset, RSS right after it)
        try:
            self.status_fd = os.open("/proc/self/status", os.O_RDONLY)
            self.statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
            self.meminfo_fd = os.open("/proc/meminfo", os.O_RDONLY)
            self.clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        except OSError:
            pass

    def reset_peak(self) -> bool:
        global _resets
        if self.clear_fd is None:
            return False
        try:
            _write(self.clear_fd, b"5")
        except OSError:
            return False
        _resets += 1
        return True

    def _status(self) -> tuple[int | None, int | None]:
        if self.status_fd is None:
            return None, None
        text = os.pread(self.status_fd, 4096, 0)
        return status_bytes(text, b"\nVmRSS:"), status_bytes(text, b"\nVmHWM:")

    def rss_and_peak(self) -> tuple[int | None, int | None]:
        """(resident bytes now, resident peak since the last reset): statm's RSS and getrusage's mark
        where that mark is the peak (see the class), else one read of /proc/self/status."""
        global _mark_floor
        since = self._since
        if since is None or since[0] != _resets or self.statm_fd is None:
            return self._status()
        rss = self.rss()
        peak = _getrusage(_WHO).ru_maxrss * 1024
        if _mark_floor is None or peak < _mark_floor:
            _mark_floor = peak
        if peak == _mark_floor and peak > (rss if rss > since[1] else since[1]) + _PEAK_SLACK:
            return self._status()          # the exec'd image's record, or this run's peak: VmHWM says
        return rss, peak if peak > rss else rss   # (the kernel's RSS counters lag a little: at least RSS)

    def memory(self) -> tuple[int | None, int | None]:
        """(MemTotal, MemAvailable) in bytes: two fields found in one read of /proc/meminfo, a fifth of the
        time of parsing every line (meminfo())."""
        if self.meminfo_fd is None:
            info = meminfo()
            return info.get("MemTotal"), info.get("MemAvailable")
        text = b"\n" + os.pread(self.meminfo_fd, 8192, 0)
        return status_bytes(text, b"\nMemTotal:"), status_bytes(text, b"\nMemAvailable:")

    def rss(self) -> int | None:
        """Resident bytes now, from /proc/self/statm (its second field, in pages)."""
        if self.statm_fd is None:
            return self._status()[0]
        return int(_pread(self.statm_fd, 128, 0).split()[1]) * self.page_size

    def start_cell(self) -> int | None:
        """Reset the peak and return the resident bytes now (two system calls: the reset, statm); the peak
        is read from then on as the class says."""
        self._since = None
        reset = self.reset_peak()
        rss = self.rss()
        if reset and self.statm_fd is not None and resource is not None:
            self._since = (_resets, rss)
        return rss

    def end_cell(self) -> tuple[int | None, int | None]:
        """(resident bytes now, resident peak since start_cell)."""
        return self.rss_and_peak()

    def close(self) -> None:
        for fd in (self.status_fd, self.clear_fd, self.statm_fd, self.meminfo_fd):
            if fd is not None:
                os.close(fd)
        self.status_fd = self.clear_fd = self.statm_fd = self.meminfo_fd = None

    def __del__(self):
        # a reader dropped without close() (a watcher never stopped) gives its descriptors back
        try:
            self.close()
        except OSError:
            pass


_shared = None


def shared_reader() -> ProcReader:
    """One reader for every guarded cell on the CPU: its descriptors are opened once per process."""
    global _shared
    if _shared is None:
        _shared = ProcReader()
    return _shared
