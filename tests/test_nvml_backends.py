"""Device backends against a faked NVML: the real `pynvml` module with its functions replaced, so that
cuda_magic's NVML layer, backends and `%gpumem` run their real code paths on a machine without a GPU."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest
from IPython.core.error import UsageError

from cuda_magic.devices.backends import read_devices

GiB = 2**30
MiB = 2**20


@dataclass
class FakeGpu:
    name: str
    total: int
    used: int
    uuid: str
    compute: list = field(default_factory=list)     # (pid, used bytes)
    graphics: list = field(default_factory=list)
    fail: dict = field(default_factory=dict)        # pynvml function name -> NVML error code


class FakeNvml:
    """The functions of pynvml that cuda_magic calls, answering from a list of FakeGpu."""

    def __init__(self, gpus, *, init_error=None, names=None):
        self.gpus = gpus
        self.init_error = init_error
        self.names = names or {}
        self.initialized = False
        self.shutdowns = 0

    def _check(self, fn, gpu=None):
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if gpu is not None and fn in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[fn])

    def install(self, monkeypatch):
        def init():
            if self.init_error is not None:
                raise pynvml.NVMLError(self.init_error)
            self.initialized = True

        def shutdown():
            self.initialized = False
            self.shutdowns += 1

        def count():
            self._check("nvmlDeviceGetCount")
            return len(self.gpus)

        def handle(i):
            self._check("nvmlDeviceGetHandleByIndex")
            if not 0 <= i < len(self.gpus):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return self.gpus[i]

        def name(h):
            self._check("nvmlDeviceGetName", h)
            return h.name

        def memory(h):
            self._check("nvmlDeviceGetMemoryInfo", h)
            return SimpleNamespace(total=h.total, used=h.used, free=h.total - h.used)

        def procs(kind):
            def listing(h):
                self._check(kind, h)
                rows = h.compute if kind == "nvmlDeviceGetComputeRunningProcesses" else h.graphics
                return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in rows]
            return listing

        def process_name(pid):
            self._check("nvmlSystemGetProcessName")
            if pid not in self.names:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return self.names[pid]

        def uuid(h):
            self._check("nvmlDeviceGetUUID", h)
            return h.uuid

        for attr, fn in {
            "nvmlInit": init, "nvmlShutdown": shutdown, "nvmlDeviceGetCount": count,
            "nvmlDeviceGetHandleByIndex": handle, "nvmlDeviceGetName": name,
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetComputeRunningProcesses": procs("nvmlDeviceGetComputeRunningProcesses"),
            "nvmlDeviceGetGraphicsRunningProcesses": procs("nvmlDeviceGetGraphicsRunningProcesses"),
            "nvmlSystemGetProcessName": process_name, "nvmlDeviceGetUUID": uuid,
        }.items():
            monkeypatch.setattr(pynvml, attr, fn)
        return self


ME = os.getpid()
OTHER = 4_000_001      # pids that do not exist here
THIRD = 4_000_002


def _two_gpus():
    return [
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                compute=[(ME, 3 * GiB), (OTHER, 10 * GiB)]),
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 6 * GiB, "GPU-bbbb2222-0000",
                compute=[(THIRD, 4 * GiB)], graphics=[(OTHER, 2 * GiB)]),
        FakeGpu(b"Tesla T4", 16 * GiB, 0, "GPU-cccc3333-0000"),
    ]


@pytest.fixture
def fake(monkeypatch, fresh_nvml):
    """Install a FakeNvml of three GPUs; CUDA_VISIBLE_DEVICES unset; torch's CUDA not in use."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process: its figures would mix with the fake")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return FakeNvml(_two_gpus(), names={ME: "/usr/bin/python3", OTHER: "/opt/train.py"}).install(monkeypatch)


def test_several_gpus_parts_add_up(fake):
    reading = read_devices()
    assert reading.gpu_present
    assert [d.key for d in reading.devices] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [d.name for d in reading.devices] == ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "Tesla T4"]
    for dev in reading.devices:
        assert sum(dev.parts().values()) == dev.capacity, dev
    first, second, third = reading.devices
    assert first.other_this_process == 3 * GiB and first.other_processes == 10 * GiB
    assert first.free == 27 * GiB
    assert second.other_this_process == 0 and second.other_processes == 6 * GiB
    assert third.free == 16 * GiB
    assert not any("No GPU found" in n for n in reading.notes)


def test_processes_listed_and_this_one_marked(fake):
    reading = read_devices()
    rows = {(p.device, p.pid): p for p in reading.processes}
    assert set(rows) == {("cuda:0", ME), ("cuda:0", OTHER), ("cuda:1", THIRD), ("cuda:1", OTHER)}
    assert rows[("cuda:0", ME)].this_process and rows[("cuda:0", ME)].used == 3 * GiB
    assert not rows[("cuda:0", OTHER)].this_process
    assert rows[("cuda:0", OTHER)].name == "train.py"
    assert rows[("cuda:1", OTHER)].used == 2 * GiB


def test_gpumem_processes_marks_this_process(fake, ip, capsys):
    capsys.readouterr()
    ip.run_line_magic("gpumem", "--processes")
    out = capsys.readouterr().out
    mine = [line for line in out.splitlines() if str(ME) in line and "cuda:0" in line]
    assert len(mine) == 1 and "this process" in mine[0]
    assert "train.py" in out
    assert "No GPU found" not in out
    snap = ip.run_line_magic("gpumem", "-o -q -d cuda:1")
    assert [d.key for d in snap.device_list] == ["cuda:1"]
    assert {p.device for p in snap.processes} == {"cuda:1"}
    assert [d.key for d in ip.run_line_magic("gpumem", "-o -q -d 2").device_list] == ["cuda:2"]
    with pytest.raises(UsageError) as excinfo:
        ip.run_line_magic("gpumem", "-d cuda:3")
    assert type(excinfo.value) is UsageError


def test_without_processes_flag_the_process_table_is_not_shown(fake, ip, capsys):
    capsys.readouterr()
    ip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    assert "cuda:0" in out and "Processes using the GPUs" not in out


@pytest.mark.parametrize("code, words", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "Library Not Found"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"),
])
def test_init_failure_is_a_one_line_note(monkeypatch, fresh_nvml, ip, capsys, code, words):
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process")
    FakeNvml(_two_gpus(), init_error=code).install(monkeypatch)
    reading = read_devices()
    assert not reading.gpu_present
    assert [d.key for d in reading.devices] == ["cpu"]
    assert len(reading.notes) == 1 and words in reading.notes[0] and "No GPU found" in reading.notes[0]
    capsys.readouterr()
    ip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if words in line]
    assert len(notes) == 1
    assert "Traceback" not in out


def test_process_list_without_permission_degrades_with_a_note(fake, ip, capsys):
    fake.gpus[0].fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NO_PERMISSION
    reading = read_devices()
    first = reading.devices[0]
    assert first.capacity == 40 * GiB and sum(first.parts().values()) == first.capacity
    assert any("process list" in n and "Insufficient Permissions" in n for n in first.notes)
    assert {p.pid for p in reading.processes if p.device == "cuda:0"} == set()
    capsys.readouterr()
    ip.run_line_magic("gpumem", "--processes")
    out = capsys.readouterr().out
    assert "Insufficient Permissions" in out and "Traceback" not in out


def test_lost_gpu_degrades_with_a_note_and_the_others_still_read(fake, ip, capsys):
    fake.gpus[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    reading = read_devices()
    lost = reading.devices[1]
    assert lost.capacity is None and lost.free is None
    assert any("GPU is lost" in n for n in lost.notes)
    for dev in (reading.devices[0], reading.devices[2]):
        assert sum(dev.parts().values()) == dev.capacity
    capsys.readouterr()
    snap = ip.run_line_magic("gpumem", "-o")
    out = capsys.readouterr().out
    assert "GPU is lost" in out and "Traceback" not in out
    assert snap.devices["capacity"].isna().sum() == 1


@pytest.mark.parametrize("spec, names", [
    ("2,0", ["GPU-cccc3333-0000", "GPU-aaaa1111-0000"]),
    ("1", ["GPU-bbbb2222-0000"]),
    ("GPU-bbbb,GPU-aaaa", ["GPU-bbbb2222-0000", "GPU-aaaa1111-0000"]),
    ("0,7,1", ["GPU-aaaa1111-0000"]),          # CUDA stops at the first invalid entry
    ("", []),
    ("-1", []),
])
def test_cuda_visible_devices_mapping(fake, monkeypatch, spec, names):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    reading = read_devices()
    gpus = [d for d in reading.devices if d.kind == "cuda"]
    by_uuid = {g.total - g.used: g.uuid for g in fake.gpus}   # free bytes are distinct per fake GPU
    assert [by_uuid[d.free] for d in gpus] == names
    assert [d.key for d in gpus] == [f"cuda:{i}" for i in range(len(names))]
    if not names:
        assert [d.key for d in reading.devices] == ["cpu"]


def test_nvml_starts_once_and_shuts_down(fake):
    from cuda_magic.devices.nvml import get_nvml

    nvml = get_nvml()
    assert nvml.start() and nvml.start()
    assert fake.initialized
    nvml.shutdown()
    assert fake.shutdowns == 1 and not fake.initialized



def test_the_no_gpu_note_is_one_sentence_without_nested_parentheses(monkeypatch, fresh_nvml):
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process")
    FakeNvml(_two_gpus(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    note, = read_devices().notes
    assert note.startswith("No GPU found: NVML is not available (NVML Shared Library Not Found). "), note
    assert note.count("(") == 1 and note.count(")") == 1
