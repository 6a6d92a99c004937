"""How far through the model's forward pass a failure came (recover/progress.py), read from a real
out-of-memory error on the simulated device: the retry's prediction uses it (issue 9, item 2)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_magic.devices.simulated import simulated_device  # noqa: E402
from cuda_magic.recover.progress import forward_progress  # noqa: E402


def progress_of(model, x_shape, capacity) -> float | None:
    with simulated_device(capacity):
        x = torch.randn(*x_shape)
        try:
            model(x)
        except torch.OutOfMemoryError as exc:
            return forward_progress(exc.__traceback__)
    raise AssertionError("the forward pass fitted")


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(),
                         nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU()), nn.Linear(256, 10))


def test_the_failing_modules_place_among_the_leaves_is_the_share_done():
    model = mlp()                                         # made before: its weights do not count
    # each 256-wide output of 4096 rows is 4 MiB, the input 1 MiB; the first BatchNorm's output is freed
    # once the ReLU ran (ReLU keeps its own output for backward): in 14 MiB the 5th leaf (the second
    # BatchNorm, inside the nested Sequential) fails, in 6 MiB the 2nd (the first BatchNorm)
    assert progress_of(model, (4096, 64), 14 << 20).share == pytest.approx(5 / 7)
    assert progress_of(model, (4096, 64), 6 << 20).share == pytest.approx(2 / 7)


def test_a_failure_outside_a_module_call_says_nothing():
    with simulated_device(1 << 20):
        try:
            torch.ones(1 << 20)
        except torch.OutOfMemoryError as exc:
            assert forward_progress(exc.__traceback__) is None
    assert forward_progress(None) is None


def test_a_custom_forward_that_fails_between_its_children():
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 256)

        def forward(self, x):
            h = self.a(x)
            h = torch.cat([h, h, h, h], dim=1)          # 16 MiB: fails in Net itself, between a and b
            return self.b(h[:, :256])

    # in Net, not in a child: counted as if all its leaves were done (an upper bound of the share)
    assert progress_of(Net(), (4096, 64), 12 << 20).share == pytest.approx(1.0)
