"""A fake run's optimizer takes the implementation the real run takes: torch/optim/optimizer.py's
`_default_to_fused_or_foreach` (2.2 to 2.13) picks the foreach kernels for tensors whose type is in
`_foreach_supported_types` and whose device is in `_get_foreach_kernels_supported_devices()` (cuda, xpu,
privateuse1: a GPU run's default). A fake copy is a FakeTensor, not a Parameter, so without cuda_magic's
hand every prediction took the one-tensor-at-a-time path, whose temporaries are one parameter's at a time,
where a GPU's foreach step (`_foreach_sqrt` of every second moment at once) holds a whole set."""
from __future__ import annotations

import pytest

from conftest import run_ok

MiB = 2**20

BIG_PARAMS = """
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))     # 8 x 1 MiB of weights
opt = torch.optim.Adam(model.parameters())
"""
STEP = """for step in range(3):
    loss = model(torch.randn(4, 512)).square().mean()
    loss.backward()
    opt.step(); opt.zero_grad()
"""


def _predict(ip, cell):
    result = ip.run_cell("%%oomguard --predict -q -o\n" + cell)
    assert result.error_in_exec is None, result.error_in_exec
    return result.result


def _measured(ip, cell):
    report = ip.run_cell("%%oomguard -q -o --no-raise --no-live\n" + cell).result
    assert report.outcome == "ok"
    return report.peaks["sim:0"]


@pytest.fixture
def big(tip):
    run_ok(tip, "%gpumem --simulate 256MiB")
    run_ok(tip, BIG_PARAMS)
    return tip


def test_where_torch_picks_foreach_for_the_real_parameters_the_fake_run_does_too(big, monkeypatch):
    import torch
    import torch.optim.adam as adam
    import torch.optim.optimizer as optimizer

    single = _predict(big, STEP).peak
    # the CPU made a foreach device, as cuda is on a GPU: the real run's Adam now takes _multi_tensor_adam
    supported = optimizer._get_foreach_kernels_supported_devices
    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: [*supported(), "cpu"])
    paths = []
    multi = adam._multi_tensor_adam
    monkeypatch.setattr(adam, "_multi_tensor_adam", lambda *a, **k: (paths.append(
        type(a[0][0]).__name__), multi(*a, **k))[1])
    real = _measured(big, STEP)
    assert paths and "FakeTensor" not in paths
    paths.clear()
    foreach = _predict(big, STEP)
    assert "FakeTensor" in paths, "the fake run took the one-tensor path where the real run took foreach"
    assert abs(foreach.peak - real) <= 0.01 * real, (foreach.peak, real)
    # a whole set of temporaries (8 MiB of square roots) where one at a time holds one weight's two (2 MiB)
    assert foreach.peak - single >= 5 * MiB, (foreach.peak, single)
    from torch._subclasses.fake_tensor import FakeTensor

    assert FakeTensor not in optimizer._foreach_supported_types      # given back after the run
    del torch


def test_on_the_cpu_the_fake_run_keeps_the_one_tensor_path_as_the_real_run(big):
    real = _measured(big, STEP)
    p = _predict(big, STEP)
    assert abs(p.peak - real) <= 0.01 * real, (p.peak, real)
