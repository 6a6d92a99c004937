"""Which entry of a GPU's process list is this process.

NVML (and amdsmi) name processes by their pid in the host's PID namespace: NVML's documentation of
`nvmlDeviceGetComputeRunningProcesses` gives `nvmlProcessInfo_t.pid`, the pid the driver knows, and a
container with a PID namespace of its own sees its processes by other numbers, so `os.getpid()` matches
nothing there, or by chance another process. Outside a PID namespace the pid is compared; inside one, this
process is the listed entry whose memory fits what torch has reserved here plus a CUDA context, where
exactly one does (else it is not known). A process's memory that the list does not give (`usedGpuMemory`
None: NVML_VALUE_NOT_AVAILABLE, as under Windows' WDDM or for another container's processes on some
drivers) is unknown, never 0.
"""
from __future__ import annotations

import os

#: the inode of the initial PID namespace (PROC_PID_INIT_INO in the kernel's include/linux/proc_ns.h):
#: /proc/self/ns/pid reads "pid:[4026531836]" outside every container's PID namespace
INIT_PID_NAMESPACE = "pid:[4026531836]"
#: the most a CUDA context (and what else the runtime takes outside the caching allocator) holds: about
#: 300-600 MiB on current GPUs, more with CUDA_MODULE_LOADING=EAGER
CONTEXT_MAX = 2 * 1024**3


def in_pid_namespace() -> bool:
    """Whether this process runs in a PID namespace of its own (a container): its pids are not NVML's.
    False where that cannot be read (not Linux)."""
    try:
        return os.readlink("/proc/self/ns/pid") != INIT_PID_NAMESPACE
    except OSError:
        return False


def this_process_pid(processes, reserved: int | None, in_use: bool) -> tuple[int | None, bool]:
    """(the pid by which `processes` ((pid, used bytes or None) pairs) names this process or None where no
    entry is this process, whether that is known). `reserved`: what torch has reserved on the device here;
    in_use: whether this process has a context on it."""
    me = os.getpid()
    if not in_pid_namespace():
        return (me if any(pid == me for pid, _ in processes) else None), True
    if not in_use:
        return None, True              # no context here: no entry is this process
    low = reserved or 0
    fits = [pid for pid, used in processes if used is not None and low <= used <= low + CONTEXT_MAX]
    if me in fits:
        return me, True                # the same number here and on the host, and the figures agree
    unknown = [pid for pid, used in processes if used is None]
    if len(fits) == 1 and not unknown:
        return fits[0], True
    return None, False


def others_total(processes, own: int | None) -> int | None:
    """What the processes other than `own` hold; None where one of them does not say."""
    total = 0
    for pid, used in processes:
        if pid == own:
            continue
        if used is None:
            return None
        total += used
    return total
