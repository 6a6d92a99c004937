"""`-r`, `--search` and accelerate's `find_executable_batch_size` side by side on a training cell.

    .venv/bin/python bench/bench_retry_training.py [--start N ...] [--capacity 64MiB] [--steps 3]
        [--cell mlp|cnn|gpt|llama|bert|generate] [--methods r search accelerate] [--maximum N]

The cell: three optimizer steps (SGD with momentum) of an MLP with BatchNorm on random batches of `bs`
rows, in a real IPython shell with `%gpumem --simulate 64MiB` on (every method runs on the same simulated
GPU). Each method starts from the same model, optimizer and RNG state. Reported per method: runs of the
cell (attempts), total time against one clean run at the final value, the value found against the
largest that fits (found by bisection, each probe from the start state), and whether the model and the
optimizer afterwards equal one clean run's at the final value from the same start. accelerate is not a
dependency of cuda_magic: without it, its row is skipped with a note.

`--cell llama|bert|generate`: the real models of tests/model_cells.py (transformers, built from configs),
on the capacity each is sized for unless --capacity says otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SETUP = """
import copy, random, gc
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
                      nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
from torch.utils._python_dispatch import _disable_current_modes
with _disable_current_modes():      # the benchmark's copy of the start, not on the simulated GPU
    START = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state(),
             random.getstate())

def reset():
    for name in ("x", "y", "loss", "xb", "yb", "loader"):          # the previous run's batch and graph: not part of the start
        globals().pop(name, None)
    gc.collect()
    model.load_state_dict(START[0]); opt.load_state_dict(copy.deepcopy(START[1]))
    for p in model.parameters():
        p.grad = None
    torch.set_rng_state(START[2]); random.setstate(START[3])

def fingerprint():
    # copies kept by the benchmark, not on the simulated GPU
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return ({k: v.clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})

def same(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and a[1].keys() == b[1].keys()
            and all(torch.equal(a[1][i][k], b[1][i][k]) for i in a[1] for k in a[1][i]))
"""

# a CNN on CIFAR-sized images (uint8 in memory, as a dataset usually is) through a DataLoader built in the
# cell with the batch size tried: conv, BatchNorm, ReLU, pooling, SGD with momentum, several steps
SETUP_CNN = SETUP.replace("""model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
                      nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))""",
"""from torch.utils.data import DataLoader, TensorDataset
images = torch.randint(0, 256, (4096, 3, 32, 32), dtype=torch.uint8)
labels = torch.randint(0, 10, (4096,))
data = TensorDataset(images, labels)
def block(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
model = nn.Sequential(*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), nn.MaxPool2d(2),
                      *block(128, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))""")

CELL_CNN = """model.train()
loader = DataLoader(data, batch_size=bs, shuffle=True)
for step, (xb, yb) in enumerate(loader):
    if step == STEPS:
        break
    x = xb.float().div_(255)
    loss = nn.functional.cross_entropy(model(x), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# a small GPT with its own forward (embeddings, causal attention, Dropout, LayerNorm) trained with AdamW on
# random tokens: no nn.Sequential chain, so its memory is known only by measuring it
SETUP_GPT = SETUP.replace("""model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
                      nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)""",
"""import torch.nn.functional as F
V, T, D = 512, 64, 128
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1))
    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.ln2(x))
class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))
model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)""").replace('("x", "y", "loss", "xb", "yb", "loader")',
                                                                 '("x", "y", "loss", "xb", "yb", "loader", "data", "logits")')

CELL_GPT = """model.train()
for step in range(STEPS):
    data = torch.randint(0, V, (bs, T + 1))
    x, y = data[:, :-1], data[:, 1:]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
"""

CELL = """model.train()
for step in range(STEPS):
    x = torch.randn(bs, 256)
    y = torch.randint(0, 10, (bs,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

ACCELERATE = """
from accelerate.utils import find_executable_batch_size

def train(batch_size):
    global bs
    bs = batch_size
    try:
        exec(CELL_CODE, globals())
    except torch.cuda.OutOfMemoryError as exc:
        # the simulated device's message says "CUDA out of memory (simulated device)."; accelerate looks
        # for " out of memory." as in CUDA's own message
        raise RuntimeError("CUDA out of memory. " + str(exc)) from None
    return batch_size

attempts = []
def counted(batch_size):
    attempts.append(batch_size)
    return train(batch_size)
"""


def shell():
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "cuda_magic")
    return ip


def run(ip, code: str):
    """Run a cell (its output is not shown); its value."""
    from IPython.utils.capture import capture_output

    with capture_output():
        result = ip.run_cell(code)
    if not result.success:
        raise RuntimeError(f"{result.error_before_exec or result.error_in_exec!r}\n{code}")
    return result.result


def fits(ip, value: int) -> bool:
    """Whether the cell fits at `value` from the start state; a failure's memory is given back after."""
    from IPython.utils.capture import capture_output

    from cuda_magic import release

    run(ip, f"reset()\nbs = {value}")
    with capture_output():
        result = ip.run_cell(CELL)
    ok = result.success
    if not ok and not isinstance(result.error_in_exec, ip.user_ns["torch"].cuda.OutOfMemoryError):
        raise result.error_in_exec
    del result
    release(ip)
    return ok


def largest_fitting(ip, hi: int) -> int:
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ip, mid) else (lo, mid)
    return lo


BASELINE: set[str] = set()     # the names after the set-up (settle()): those the cell binds are not


def settle(ip) -> None:
    """After the set-up: the names that stay. An out-of-memory error leaves the cell's own names bound
    (a `loss` whose graph a failed backward kept holds its activations; cuda_magic never deletes a user's
    name), so fresh() drops the names the set-up did not make."""
    BASELINE.clear()
    BASELINE.update(ip.user_ns)


def fresh(ip, value: int) -> None:
    """The start state, with nothing left over from the previous measurement."""
    from cuda_magic import release

    for name in [n for n in ip.user_ns if BASELINE and n not in BASELINE and not n.startswith("_")]:
        del ip.user_ns[name]
    release(ip)
    run(ip, f"reset()\nbs = {value}")
    from cuda_magic.devices.simulated import active_device

    print(f"  bs={value}: {active_device().allocated} bytes allocated before", file=sys.stderr)


def clean_run(ip, value: int) -> tuple[float, object]:
    fresh(ip, value)
    t0 = time.perf_counter()
    run(ip, CELL)
    seconds = time.perf_counter() - t0
    return seconds, ip.user_ns["fingerprint"]()


def guarded(ip, start: int, flags: str) -> dict:
    fresh(ip, start)
    t0 = time.perf_counter()
    report = run(ip, f"%%oomguard -q -o -r bs {flags}\n" + CELL)
    seconds = time.perf_counter() - t0
    after = ip.user_ns["fingerprint"]()
    return dict(runs=len(report.attempts), probes=sum(a.probe for a in report.attempts), seconds=seconds,
                found=report.final_value, after=after, values=[a.value for a in report.attempts])


def accelerate(ip, start: int) -> dict | None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return None
    fresh(ip, start)
    run(ip, ACCELERATE)
    run(ip, f"attempts.clear()\nCELL_CODE = compile({CELL!r}, '<cell>', 'exec')")
    t0 = time.perf_counter()
    found = run(ip, f"find_executable_batch_size(counted, starting_batch_size={start})()")
    seconds = time.perf_counter() - t0
    after = ip.user_ns["fingerprint"]()
    tried = ip.user_ns["attempts"]
    return dict(runs=len(tried), probes=0, seconds=seconds, found=found, after=after,
                values=tried if len(tried) <= 6 else [*tried[:3], "...", *tried[-2:]])


METHODS = {"r": "`-r bs`", "search": "`-r bs --search`", "accelerate": "accelerate `find_executable_batch_size`"}
CELLS = {
    "mlp": ("{steps} steps of SGD with momentum on an MLP with BatchNorm (256-1024-1024-10)", SETUP, CELL),
    "cnn": ("{steps} steps of SGD with momentum on a CNN with BatchNorm (4 conv blocks, 32x32x3 images) through "
            "a DataLoader built in the cell", SETUP_CNN, CELL_CNN),
    "gpt": ("{steps} steps of AdamW on a small GPT with its own forward (4 blocks of causal attention, width 128, "
            "64 tokens, vocabulary 512)", SETUP_GPT, CELL_GPT),
}


def main(argv=None) -> None:
    global CELL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, nargs="+", default=[4096, 1200])
    parser.add_argument("--capacity", help="the simulated GPU (default 64MiB, or the real model's own)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cell", choices=sorted(CELLS) + ["bert", "generate", "llama"], default="mlp")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--maximum", type=int, help="the largest value that fits, if known (skips finding it)")
    args = parser.parse_args(argv)
    if args.cell in CELLS:
        what, setup, CELL = CELLS[args.cell]
        capacity = args.capacity or "64MiB"
    else:
        from model_cells import MODELS

        what, setup, CELL, cap, _ = MODELS[args.cell]
        capacity = args.capacity or cap
    ip = shell()
    ip.run_line_magic("gpumem", f"--simulate {capacity} -q")   # first: the model counts on it
    run(ip, setup)
    ip.user_ns["STEPS"] = args.steps
    settle(ip)
    maximum = args.maximum or largest_fitting(ip, max(args.start) * 2)
    print(f"command: .venv/bin/python bench/bench_retry_training.py {' '.join(argv or sys.argv[1:])}".rstrip())
    print(f"cell: {what.format(steps=args.steps)}, simulated GPU of {capacity}; largest bs that fits: "
          f"{maximum}\n")
    have_accelerate = True
    rows = []
    measures = {"r": lambda s: guarded(ip, s, ""), "search": lambda s: guarded(ip, s, "--search"),
                "accelerate": lambda s: accelerate(ip, s)}
    for start in args.start:
        for key in args.methods:
            name, measure = METHODS[key], measures[key]
            print(f"{start} {name}", file=sys.stderr)
            result = measure(start)
            if result is None:
                have_accelerate = False
                continue
            clean_seconds, clean = clean_run(ip, result["found"])
            equal = ip.user_ns["same"](result["after"], clean)
            values = " ".join(str(v) for v in result.get("values", ()))
            rows.append([str(start), name, f"{result['runs']}" + (f" ({result['probes']} probes)" if result["probes"] else ""),
                         values, f"{result['seconds']:.2f} s", f"{result['seconds'] / clean_seconds:.1f}x",
                         f"{result['found']} ({result['found'] / maximum:.1%})", "yes" if equal else "no"])
    if not have_accelerate:
        print("note: accelerate is not installed, so its rows are skipped (pip install accelerate)\n")
    head = ["start", "method", "runs of the cell", "values tried", "total time", "vs one clean run",
            "found (of largest)", "model = one clean run"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
