"""Giving device memory back without a kernel restart: what `%freecuda` and the clean-up after an OOM do.

A failed cell's tensors stay alive through references that only the notebook machinery holds:
`sys.last_*`, IPython's stored traceback, the last `ExecutionResult`, the frames of the traceback (and
their cached `f_locals`), and the output cache (`_`, `__`, `___`, `_N`, `Out[N]`, the displayhook's own
attributes). This module drops those, never a user variable unless it is named, then collects garbage and
empties the allocator cache, in that order. What still holds memory after it (the names, what deleting
each gives back) is memory/holders.py's.

torch is never imported here: a tensor can only exist once the user imported torch, so the module is
looked up in `sys.modules`.
"""
from __future__ import annotations

import gc

from cuda_magic.ipython import shell_or_current, user_variables
from cuda_magic.recover.notebook_refs import drain_autograd, drop_exception_refs, drop_output_cache
from cuda_magic.devices.probe import cuda_started, has_gpu, loaded_torch, mps_available, xpu_started
from cuda_magic.devices.simulated import active_device
from cuda_magic.memory.holders import held_rows, held_storages, holders_largest_first, sharing_notes
from cuda_magic.memory.reach import storage_key_and_bytes
from cuda_magic.units import format_bytes
from cuda_magic.recover.report import ReleaseReport


class MissingNames(KeyError):
    """`%freecuda NAME ...` named variables that do not exist; nothing was changed."""

    def __init__(self, names):
        self.names = list(names)
        super().__init__(self.names)

    def __str__(self) -> str:
        listed = ", ".join(self.names)
        return f"no variable named {listed}: nothing was deleted"



# ----------------------------------------------------------------------------------- measurement

def _device_usage() -> dict[str, int]:
    """Bytes in use per device key, as the allocators see them (reserved, i.e. what the device lost). With
    no GPU, the CPU's tensors, unless a simulated device stands in for the GPU: then only its count."""
    torch = loaded_torch()
    usage: dict[str, int] = {}
    if torch is None:
        return usage
    if cuda_started():
        for i in range(torch.cuda.device_count()):
            usage[f"cuda:{i}"] = torch.cuda.memory_reserved(i)
    xpu = getattr(torch, "xpu", None)
    # torch.xpu.memory_reserved is torch 2.5+ (2.4 has torch.xpu without its allocator counters)
    if xpu_started() and hasattr(xpu, "memory_reserved"):
        for i in range(xpu.device_count()):
            usage[f"xpu:{i}"] = xpu.memory_reserved(i)
    mps = getattr(torch, "mps", None)
    if mps is not None and mps_available():
        usage["mps"] = mps.driver_allocated_memory()
    sim = active_device()
    if not has_gpu() and sim is None:
        usage["cpu"] = cpu_tensor_bytes()
    if sim is not None:
        # its tensors are CPU tensors: the same bytes are reported once, on the device the user meters
        usage[sim.key] = int(sim.allocated)
    return usage


def cpu_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages alive in this process (a gc scan)."""
    torch = loaded_torch()
    if torch is None:
        return 0
    storages: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor):
            try:
                if o.device.type != "cpu":
                    continue
            except Exception:
                continue
            key, nbytes = storage_key_and_bytes(o)
            storages[key] = nbytes
    return sum(storages.values())


def empty_caches(meter=None) -> None:
    """Give the allocators' cached, unused blocks back to the devices. Creates no CUDA context.

    The simulated devices' caching allocators too, as torch.cuda.empty_cache() does on a GPU: those counting
    now and the one `meter` reads (a `-l` run's device, stopped once its run ended, keeps its cache)."""
    from cuda_magic.devices.simulated import empty_caches as empty_simulated

    empty_simulated()
    device = getattr(meter, "device", None)
    if getattr(device, "kind", None) == "simulated" and not device.active:
        device.empty_cache()
    torch = loaded_torch()
    if torch is None:
        return
    if cuda_started():
        torch.cuda.empty_cache()
    if xpu_started():
        torch.xpu.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and hasattr(mps, "empty_cache") and mps_available():
        mps.empty_cache()


# ------------------------------------------------------------------------------ user variables

def all_device_variables(shell) -> list[str]:
    """The user variables `%freecuda --all` deletes: those holding device tensors, largest first."""
    return [h.name for h in holders_largest_first(shell_or_current(shell))]


# -------------------------------------------------------------------------------------- release

def release(shell=None, *, dry_run: bool = False) -> ReleaseReport:
    """The clean-up of `%freecuda` without namespace changes: drop the last exception's references
    and output-cache entries holding device tensors, collect garbage, empty the allocator cache."""
    return _release(shell_or_current(shell), dry_run=dry_run)


def _release(shell, *, dry_run: bool, change_namespace=None, report: ReleaseReport | None = None,
             exclude=()) -> ReleaseReport:
    report = report or ReleaseReport()
    report.dry_run = dry_run
    if dry_run:
        report.dropped += drop_exception_refs(shell, dry_run=True)
        report.dropped += drop_output_cache(shell, dry_run=True) if shell is not None else []
        held = holders_largest_first(shell, exclude)
        report.still_held = held_rows(held)
        report.notes += sharing_notes(held)
        report.notes.append("dry run: nothing was changed")
        return report

    before = _device_usage()
    if change_namespace is not None:
        change_namespace()
    # References first, then a gc pass (they form cycles), then the cache: in this order, and never
    # inside an `except` block, where the live traceback would keep everything.
    report.dropped += drop_exception_refs(shell)
    if shell is not None:
        report.dropped += drop_output_cache(shell)
    drain_autograd()
    gc.collect()
    empty_caches()
    after = _device_usage()
    for key, used in before.items():
        report.freed[key] = max(0, used - after.get(key, used))
    if not has_gpu():
        report.notes.append("no GPU: the simulated device stands in for one (the tensors it counts are listed)"
                            if active_device() is not None else
                            "no GPU: the CPU is the device (CPU tensors are counted)")
    held = holders_largest_first(shell)
    report.still_held = held_rows(held)
    report.notes += sharing_notes(held)
    return report


def free_variables(shell, names, *, offload: bool = False, dry_run: bool = False) -> ReleaseReport:
    """`%freecuda NAME ...`: delete (or, with offload, move to the CPU) the named variables, then
    release. If any name does not exist, raise MissingNames before changing anything."""
    shell = shell_or_current(shell)
    names = list(dict.fromkeys(names))
    missing = [n for n in names if n not in shell.user_ns]
    if missing:
        raise MissingNames(missing)
    report = ReleaseReport()
    if offload:
        report.offloaded = list(names)
        if not has_gpu():
            if active_device() is not None:
                report.notes.append("no GPU: offloading copies the tensors off the simulated device into "
                                    "CPU memory it does not count")
            else:
                report.notes.append("no GPU: the CPU is the device, so offloading moves nothing")
    else:
        report.deleted = list(names)
    if dry_run:
        return _release(shell, dry_run=True, report=report, exclude=() if offload else names)

    def change_namespace():
        hidden = getattr(shell, "user_ns_hidden", {}) or {}
        if offload:
            from cuda_magic.recover.offload import offload as move
            # one call, so that a model and its optimizer are moved together
            moved = move([shell.user_ns[name] for name in names])
            for name, value in zip(names, moved):
                shell.user_ns[name] = value
            report.notes.extend(_optimizers_left_behind(shell, names))
            return
        for name in names:
            value = shell.user_ns.pop(name)
            if name in hidden and hidden[name] is value:
                del hidden[name]
            del value

    return _release(shell, dry_run=False, change_namespace=change_namespace, report=report)


def free_all_variables(shell, *, offload: bool = False, dry_run: bool = False) -> ReleaseReport:
    """`%freecuda --all`: every user variable that holds device tensors, deleted (or offloaded), listed."""
    shell = shell_or_current(shell)
    names = all_device_variables(shell)
    if names:
        return free_variables(shell, names, offload=offload, dry_run=dry_run)
    report = release(shell, dry_run=dry_run)
    report.notes.append("--all: no user variable holds device tensors")
    return report


def _optimizers_left_behind(shell, names) -> list[str]:
    """A note for each optimizer not named whose parameters were moved while its state stays on the device
    (it would step a model on the CPU with state on the GPU): offload it with them."""
    torch = loaded_torch()
    if torch is None:
        return []
    moved = {id(p) for n in names for p in _parameters_of(shell.user_ns.get(n), torch)}
    notes = []
    for name, value in user_variables(shell).items():
        if name in names or not issubclass(type(value), torch.optim.Optimizer):
            continue
        params = [p for g in value.param_groups for p in g["params"]]
        held = sum(held_storages(list(value.state.values())).values())
        if held and any(id(p) in moved for p in params):
            notes.append(f"{name}'s state stays on the device ({format_bytes(held)}) "
                         f"while the parameters it steps moved: `%freecuda {' '.join(names)} {name} --offload` "
                         "moves it with them")
    return notes


def _parameters_of(value, torch) -> list:
    if issubclass(type(value), torch.nn.Module):
        return list(value.parameters())
    if issubclass(type(value), torch.Tensor):
        return [value]
    return []
