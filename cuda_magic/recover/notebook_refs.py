"""The references only the notebook machinery holds after an error or a displayed result: `sys.last_*`,
IPython's stored traceback and last result, the traceback's frames (and their cached `f_locals`), and
the output cache (`_`, `__`, `___`, `_N`, `Out[N]`, the displayhook's own attributes), and the autograd
engine's work left over from a backward pass that failed. Dropping them never touches a user variable."""
from __future__ import annotations

import sys

from cuda_magic.ipython import UNDERSCORES, is_output_cache_name, output_cache_number, output_hist, shell_or_current
from cuda_magic.memory.reach import holds_device_memory
from cuda_magic.devices.errors import exception_chain

_SYS_LAST = ("last_type", "last_value", "last_traceback", "last_exc")
_CO_OPTIMIZED = 0x0001


def _frames_of(tb) -> list:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def clear_frame(frame, user_ns=None) -> bool:
    """Drop a finished frame's locals. Module-level frames (whose locals are a namespace) are left alone;
    executing frames cannot be cleared. Returns whether the frame was cleared."""
    optimized = bool(frame.f_code.co_flags & _CO_OPTIMIZED)
    if not optimized:
        f_locals = frame.f_locals
        if f_locals is frame.f_globals or (user_ns is not None and f_locals is user_ns):
            return False
    try:
        frame.clear()
    except RuntimeError:  # still executing (e.g. the caller's own frame)
        return False
    if optimized and sys.version_info < (3, 13):
        # 3.11/3.12: clear() leaves the cached f_locals dict (filled by any formatter that read it)
        # holding the old values; reading f_locals again resyncs it with the now empty fast locals.
        frame.f_locals
    return True


def drain_autograd() -> bool:
    """After an error inside a backward pass: let the autograd engine drop what is left of the failed
    graph (its nodes with their saved tensors, and the gradients computed so far), which it keeps until
    the next backward pass on the same thread. torch/csrc/autograd/engine.cpp (2.2 to 2.13): the calling
    thread runs `thread_main(graph_task)` over its thread-local ready queue and leaves it as soon as that
    graph task's future is completed, and an error completes it at once; the next backward's pass over
    the queue drops the tasks whose graph task is gone. On the simulated device, whose tensors are the
    CPU's, the whole rest of the graph is there (tests/test_release.py: 46 MiB of a ResNet's activations
    held after its `loss` was deleted). One backward of a fresh scalar, with no mode counting it, does it;
    returns whether it ran (torch loaded)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "autograd"):
        return False
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        (torch.zeros((), requires_grad=True) * 1).backward()
    return True


def clear_traceback_frames(tb, user_ns=None) -> int:
    """Clear every frame of a traceback; returns how many were cleared."""
    return sum(clear_frame(f, user_ns) for f in _frames_of(tb))


def drop_exception(exc, *, user_ns=None, sever: bool = True) -> int:
    """Make an exception hold nothing: clear the frames of its traceback and of every exception chained
    to it; with `sever`, also cut `__traceback__`, `__context__` and `__cause__`. Returns frames cleared.
    Call it outside the `except` block that caught exc (there the frames are still executing)."""
    cleared = 0
    family = list(exception_chain(exc))
    for e in family:
        cleared += clear_traceback_frames(e.__traceback__, user_ns)
    if sever:
        for e in family:
            e.__traceback__ = None
            e.__context__ = None
            e.__cause__ = None
    return cleared


def drop_exception_refs(shell=None, *, dry_run: bool = False) -> list[str]:
    """Drop the last exception everywhere the interpreter and IPython keep it, clearing its frames.
    Returns what was (or, with dry_run, would be) dropped, by name."""
    shell = shell_or_current(shell)
    user_ns = getattr(shell, "user_ns", None)
    dropped: list[str] = []
    excs: list = []
    tbs: list = []

    for attr in ("last_value", "last_exc"):
        if getattr(sys, attr, None) is not None:
            excs.append(getattr(sys, attr))
    if getattr(sys, "last_traceback", None) is not None:
        tbs.append(sys.last_traceback)
    if any(getattr(sys, a, None) is not None for a in _SYS_LAST):
        dropped.append("sys.last_value")

    itb = getattr(shell, "InteractiveTB", None)
    if getattr(itb, "tb", None) is not None:
        tbs.append(itb.tb)
        dropped.append("IPython's stored traceback")

    result = getattr(shell, "last_execution_result", None)
    if getattr(result, "error_in_exec", None) is not None:
        excs.append(result.error_in_exec)
        dropped.append("IPython's last error")
    result_holds = result is not None and getattr(result, "result", None) is not None \
        and holds_device_memory(result.result) > 0
    if result_holds:
        dropped.append("IPython's last result")

    if dry_run:
        return dropped

    for exc in excs:
        drop_exception(exc, user_ns=user_ns, sever=False)
    for tb in tbs:
        clear_traceback_frames(tb, user_ns)
    for attr in _SYS_LAST:
        if hasattr(sys, attr):
            delattr(sys, attr)
    if itb is not None and getattr(itb, "tb", None) is not None:
        itb.tb = None
    if getattr(result, "error_in_exec", None) is not None:
        result.error_in_exec = None
    if result_holds:
        result.result = None
    return dropped



def drop_output_cache(shell, *, only_device: bool = True, dry_run: bool = False) -> list[str]:
    """Drop output-cache entries (only those holding device tensors, by default) and name them:
    'Out[7]', '_7', '_'. A user variable is never touched, even one named `_x` or `_7`."""
    shell = shell_or_current(shell)
    if shell is None:
        return []

    def wanted(value) -> bool:
        return not only_device or holds_device_memory(value) > 0

    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {}) or {}
    hist = output_hist(shell)
    dropped: list[str] = []
    actions = []

    for n, value in list(hist.items()):
        if not wanted(value):
            continue
        dropped.append(f"Out[{n}]")
        actions.append(lambda n=n: hist.pop(n, None))
    for ns, where in ((user_ns, ""), (hidden, " (hidden)")):
        for name, value in list(ns.items()):
            if output_cache_number(name) is None or not wanted(value):
                continue
            if ns is not hidden and not is_output_cache_name(shell, name, value):
                continue
            if not where:
                dropped.append(name)
            actions.append(lambda ns=ns, name=name: ns.pop(name, None))

    displayhook = getattr(shell, "displayhook", None)
    for name in UNDERSCORES:
        value = getattr(displayhook, name, None)
        if value is None or isinstance(value, str) or not wanted(value):
            continue
        dropped.append(name)
        for ns in (user_ns, hidden):
            if name in ns and ns[name] is value:
                actions.append(lambda ns=ns, name=name: ns.__setitem__(name, ""))
        actions.append(lambda name=name: setattr(displayhook, name, ""))

    if not dry_run:
        for act in actions:
            act()
    return dropped
