"""Taking a snapshot: the devices' memory and the census of live tensors, as plain records."""
from __future__ import annotations

from cuda_magic.devices.backends import read_devices
from cuda_magic.memory.census import take_census
from cuda_magic.memory.kinds import bytes_by_kind
from cuda_magic.memory.snapshot import Snapshot
from cuda_magic.ipython import output_hist, shell_or_current, user_variables


def user_namespace(shell):
    """(the user's own variables, the output cache) that name tensors; outside IPython `__main__`'s
    variables (a script's), as the release names them, and no output cache."""
    if shell is None:
        return user_variables(None), None
    return user_variables(shell), output_hist(shell)


def snapshot(shell=None, *, top: int = 10, tensors: bool = True) -> Snapshot:
    """Where memory is now. `shell` (an IPython shell) names tensors by the user's variables.

    Outside IPython pass nothing: tensors are then listed without names. The result holds no tensor.
    """
    shell = shell_or_current(shell)
    records, per_device, notes = [], {}, []
    if tensors:
        namespace, out_cache = user_namespace(shell)
        records, per_device, notes = take_census(namespace, out_cache=out_cache)
    reading = read_devices(cpu_tensor_bytes=per_device.get("cpu", 0))
    snap = Snapshot(device_list=reading.devices, tensor_list=records, processes=reading.processes,
                    notes=reading.notes + notes, tensor_count=len(records), tensor_bytes=per_device)
    snap.top = top
    if tensors:
        from cuda_magic.devices.simulated import active_device

        snap.kind_bytes = bytes_by_kind(records, {d.key: d.torch_allocated for d in reading.devices},
                                        active_device())
    return snap


def kinds_on(key: str, *, allocated: int | None = None, simulated=None) -> dict[str, int]:
    """PyTorch's tensors on one device by kind, now (memory.kinds): what an out-of-memory report shows
    of the moment it failed. No names are looked up. `simulated`: the SimulatedDevice behind `key`."""
    records, _, _ = take_census(None, with_names=False)
    return bytes_by_kind(records, {key: allocated}, simulated)[key]
