"""How far through the model's forward pass a failure came (recover/progress.py), read from a real
out-of-memory error on the simulated device: the retry's prediction uses it (issue 9, item 2)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_magic.devices.simulated import simulated_device  # noqa: E402
from cuda_magic.recover.replay import read_model_calls  # noqa: E402


def forward_progress(tb):
    """The progress half of what the retry reads from a failure's traceback."""
    return read_model_calls(tb)[0]


def progress_of(model, x_shape, capacity) -> float | None:
    """The progress read from the failure of `model(x)` on a device of `capacity` bytes that counts the
    storages' bytes (allocator="plain"): the capacities below put the failure at a chosen layer by the
    tensors' sizes, which the caching allocator's 20 MiB segments would blur."""
    with simulated_device(capacity, allocator="plain"):
        x = torch.randn(*x_shape)
        try:
            model(x)
        except torch.cuda.OutOfMemoryError as exc:   # (torch.OutOfMemoryError is 2.5+)
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
        except torch.cuda.OutOfMemoryError as exc:   # (torch.OutOfMemoryError is 2.5+)
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


def cnn():
    from torch import nn

    def block(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*block(3, 16), nn.MaxPool2d(2), *block(16, 32, stride=2), nn.AvgPool2d(3, 2, 1),
                         nn.Sequential(*block(32, 32), nn.Dropout(0.1)), nn.Conv2d(32, 8, 1, padding="same"),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(8, 10), nn.ReLU(inplace=True))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("index", [0, 2, 5, 9, 13])
def test_the_sizes_of_the_layers_still_to_run_match_a_real_forward_pass(index, train):
    """recover/shapes.py: from the input shape of leaf `index`, the bytes the leaves after it allocate,
    against the outputs of a real forward pass (views and in-place layers allocate nothing)."""
    from cuda_magic.recover.shapes import rest_bytes, sequential_only

    model = cnn().train(train)
    leaves = [m for m in model.modules() if next(iter(m.children()), None) is None]
    h, shapes, real = torch.randn(4, 3, 30, 30), [], []
    with torch.no_grad():
        for leaf in leaves:
            shapes.append(tuple(h.shape))
            out = leaf(h)
            new = out.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
            real.append(out.nbytes if new else 0)          # (dropout's mask in training is not counted)
            h = out
    assert sequential_only(model, torch)
    assert rest_bytes(leaves, index, shapes[index], 4, torch) == sum(real[index + 1:])


def test_a_failure_in_a_chain_of_layers_knows_what_is_still_to_come():
    model = mlp()
    where = progress_of(model, (4096, 64), 14 << 20)      # fails in the second BatchNorm (leaf 5 of 7)
    assert where.rest_bytes == 4096 * 256 * 4 + 4096 * 10 * 4    # its ReLU, then the last Linear
    assert where.input_bytes == 4096 * 64 * 4
    assert where.grads_to_come == sum(p.nbytes for p in model.parameters())


def test_a_model_with_its_own_forward_is_extrapolated_not_walked():
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())

        def forward(self, x):
            return self.layers(x) * 2                  # not only its children: their sizes do not tell

    where = progress_of(Net(), (4096, 64), 8 << 20)      # fails in the first ReLU
    assert where is not None and where.rest_bytes is None and 0 < where.share < 1
