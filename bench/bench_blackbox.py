"""What the black box costs: a realistic training step on the simulated device, with and without recording,
and the simulated device itself against plain CPU, side by side in one run.

    .venv/bin/python bench/bench_blackbox.py [--steps 20] [--rounds 7] [--profile]

The step: a small transformer built from torch.nn (2 encoder layers, d_model 256, 4 heads, feed-forward
1024, batch 16 x 128 tokens, LayerNorm, dropout), forward, cross-entropy loss, backward, AdamW step.
Variants, interleaved round by round, each the median over rounds of --steps steps:
  cpu        plain CPU, nothing of cuda_magic
  sim        on a simulated device (every op's outputs sized on the meta device first)
  sim+box    the same, with the black box recording (what a guarded run does by default)
  guarded    `%%oomguard`'s engine around each step without the timeline, and `guarded+box` with it
Goals: recording adds at most 5% to the guarded step (guarded+box against guarded); the simulated device
toward 1.25x plain CPU. --profile prints where the simulated step's time goes (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_RECORDING = 0.05
GOAL_SIM = 1.25


def build():
    import torch
    from torch import nn

    torch.manual_seed(0)
    vocab, d = 1000, 256

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, 4, 1024, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (16, 128))
    targets = torch.randint(0, vocab, (16, 128))

    def step():
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def variants(step):
    from cuda_magic.devices.recorder import Recorder
    from cuda_magic.devices.meter import SimMeter
    from cuda_magic.devices.simulated import SimulatedDevice
    from cuda_magic.recover.guarded import GuardedRun, GuardOptions

    dev = SimulatedDevice(64 << 30)

    def cpu(n):
        for _ in range(n):
            step()

    def sim(n):
        with dev:
            for _ in range(n):
                step()

    def sim_box(n):
        rec = Recorder(cell_filename=__file__)
        dev.attach_recorder(rec)
        try:
            with dev:
                rec.begin_attempt(0)
                for _ in range(n):
                    step()
        finally:
            dev.detach_recorder(rec)

    def guarded(timeline):
        def run(n):
            with dev:
                meter = SimMeter(dev)
                for _ in range(n):
                    GuardedRun(meter, GuardOptions(timeline=timeline)).run(step)
        return run

    return {"cpu": cpu, "sim": sim, "sim+box": sim_box, "guarded": guarded(False), "guarded+box": guarded(None)}


def measure(steps: int, rounds: int) -> dict[str, float]:
    step = build()
    runs = variants(step)
    for run in runs.values():        # warm up: meta kernels, allocator, caches
        run(2)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run(steps)
            times[key].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def profile(steps: int) -> str:
    step = build()
    run = variants(step)["sim+box"]
    run(2)
    prof = cProfile.Profile()
    prof.enable()
    run(steps)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)          # the machine is shared: one thread keeps the comparison steady
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, 1 thread")
    t = measure(args.steps, args.rounds)
    for key, value in t.items():
        print(f"  {key:12s} {value * 1e3:8.2f} ms/step   {value / t['cpu']:5.2f}x cpu")
    recording = t["guarded+box"] / t["guarded"] - 1
    sim = t["sim"] / t["cpu"]
    print(f"recording adds {recording:+.1%} to the guarded step (goal: at most {GOAL_RECORDING:.0%}); "
          f"sim+box against sim: {t['sim+box'] / t['sim'] - 1:+.1%}")
    print(f"the simulated device costs {sim:.2f}x plain CPU (goal: toward {GOAL_SIM}x)")
    if args.profile:
        print(profile(args.steps))
    return 0 if recording <= GOAL_RECORDING else 1


if __name__ == "__main__":
    raise SystemExit(main())
