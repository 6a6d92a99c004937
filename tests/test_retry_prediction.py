"""`-r` on a real training cell (issue 9, item 2): the first retry is predicted from how far through the
model's forward pass the failure came, so it fits and lands within 15% of the largest value that fits:
2 runs of the cell. An MLP with BatchNorm and SGD with momentum, two steps, on the simulated device."""
from __future__ import annotations

import pytest

from conftest import run_ok

SETUP = """
import copy
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(),
                      nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))

def reset():
    for name in ("x", "y", "loss"):
        globals().pop(name, None)
    gc.collect()
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1]))
    for p in model.parameters():
        p.grad = None
"""

CELL = """model.train()
for step in range(2):
    x = torch.randn(bs, 64)
    y = torch.randint(0, 10, (bs,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture
def trainer(tip):
    tip.run_line_magic("gpumem", "--simulate 32MiB -q")
    try:
        run_ok(tip, SETUP)
        yield tip
    finally:
        tip.run_line_magic("gpumem", "--simulate off -q")


def fits(ip, value: int) -> bool:
    from cuda_magic import release

    run_ok(ip, f"reset()\nbs = {value}")
    result = ip.run_cell(CELL)
    ok = result.success
    del result
    release(ip)
    return ok


def test_the_first_retry_fits_within_15_percent_of_the_largest(trainer):
    lo, hi = 1, 4096
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(trainer, mid) else (lo, mid)
    maximum = lo
    for start in (int(maximum * 1.4), int(maximum * 1.9)):
        run_ok(trainer, f"reset()\nbs = {start}")
        report = trainer.run_cell("%%oomguard -q -o -r bs\n" + CELL).result
        values = [a.value for a in report.attempts]
        assert len(values) == 2 and 0.85 * maximum <= report.final_value <= maximum, (values, maximum)
        # reading the failed frames' locals (which module failed, its input) kept nothing of that attempt
        assert report.attempts[1].start_allocated == report.attempts[0].start_allocated
