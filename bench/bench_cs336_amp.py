"""`--predict` of the recorded cs336 forward passes under bf16 autocast against the real GPU's peaks.

The recordings (../shared/gpu_traces/cs336_ctx{128,256,512}_fwd_mixed.pickle.gz, SOURCES.md there): a
3.41B-parameter Transformer LM (d_model 2560, d_ff 10240, 32 layers, 32 heads, vocabulary 10000, RoPE
theta 10000), batch 4, fp32 weights, its forward under torch.autocast('cuda', bfloat16), on an 80 GB
Hopper GPU with torch 2.6. The model code is the public kkaitlyn111/cs336-assignment1's
cs336_basics/transformer.py, imported from where `fetch` left it (a git directory under /work/.mirror, or
a checkout given with --repo); it needs einops and jaxtyping (--deps: a folder to put on sys.path).
Nothing of it is copied here. The prediction runs on fake tensors: no real memory.

    .venv/bin/python bench/bench_cs336_amp.py [--repo DIR] [--deps DIR] [--ctx 128 256 512]

Prints, per context: the recorded peak (allocated, from the trace), the predicted peak (a simulated 80 GB
device standing in for the H100: CUDA's cast lists, a 32 MiB cuBLAS workspace per matmul thread), the
difference, and the same prediction with the CPU's cast lists (what --predict did before issue 38).
"""
from __future__ import annotations

import argparse
import gzip
import os
import pickle
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: ../shared/gpu_traces next to the repository (a worktree under wt/ has it one more level up)
TRACES = next((p for p in (os.path.join(HERE, "..", "..", "shared", "gpu_traces"),
                           os.path.join(HERE, "..", "..", "..", "shared", "gpu_traces")) if os.path.isdir(p)),
              os.path.join(HERE, "..", "..", "shared", "gpu_traces"))
MIRROR = "/work/.mirror/kkaitlyn111+cs336-assignment1/repo"
GiB = 2**30


def recorded_peak(path: str) -> int:
    """The peak of allocated bytes over a recording: the blocks alive at its end, less the trace's net
    change, is the start; the trace's running sum from there gives the peak."""
    snap = pickle.load(gzip.open(path))
    trace = snap["device_traces"][0]
    end = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    level = peak = 0
    for e in trace:
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == "free_requested":
            level -= e["size"]
        peak = max(peak, level)
    return end - level + peak


def model_source(repo: str | None) -> str | None:
    """A folder holding cs336_basics/transformer.py: `repo`, else extracted from the fetched mirror."""
    if repo:
        return repo if os.path.exists(os.path.join(repo, "cs336_basics", "transformer.py")) else None
    if not os.path.isdir(MIRROR):
        return None
    out = tempfile.mkdtemp(prefix="cs336_")
    files = subprocess.run(["git", "--git-dir", MIRROR, "show", "HEAD:cs336_basics/transformer.py"],
                           capture_output=True, text=True)
    if files.returncode:
        return None
    os.makedirs(os.path.join(out, "cs336_basics"))
    with open(os.path.join(out, "cs336_basics", "transformer.py"), "w") as fh:
        fh.write(files.stdout)
    open(os.path.join(out, "cs336_basics", "__init__.py"), "w").close()
    return out


def predict_forward(ctx: int, *, cuda_lists: bool = True, workspace: int = 32 * 2**20):
    """The prediction of the forward pass at context `ctx` on a simulated 80 GB GPU."""
    import torch

    import cuda_magic
    from cuda_magic.devices.simulated import simulated_device
    from cuda_magic.fakerun import cuda_autocast

    from cs336_basics.transformer import TransformerLM

    def forward(ctx):
        model = TransformerLM(d_model=2560, num_heads=32, d_ff=10240, vocab_size=10000, context_length=ctx,
                              num_layers=32, theta=10000.0)
        x = torch.randint(0, 10000, (4, ctx))
        out = model(x)
        return out

    saved = cuda_autocast.prediction_autocast
    if not cuda_lists:                                    # the CPU's lists, as before
        from cuda_magic.devices.meter import autocast

        cuda_autocast.prediction_autocast = autocast
    try:
        with simulated_device(80 * GiB) as dev:
            dev.cublas_workspace = workspace
            return cuda_magic.predict(forward, ctx, amp="bf16")
    finally:
        cuda_autocast.prediction_autocast = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", help="a checkout of kkaitlyn111/cs336-assignment1")
    parser.add_argument("--deps", default="/tmp/cs336deps", help="a folder with einops and jaxtyping")
    parser.add_argument("--ctx", type=int, nargs="+", default=[128, 256, 512])
    args = parser.parse_args(argv)
    source = model_source(args.repo)
    if source is None:
        print("the model code is not here: fetch kkaitlyn111/cs336-assignment1 or give --repo")
        return 2
    sys.path[:0] = [source] + ([args.deps] if os.path.isdir(args.deps) else [])
    print(f"`{' '.join(['.venv/bin/python', 'bench/bench_cs336_amp.py', *(argv or sys.argv[1:])])}`\n")
    print("| context | recorded peak | predicted (CUDA lists + cuBLAS workspace) | difference | CPU lists, no workspace | difference |")
    print("|---|---|---|---|---|---|")
    for ctx in args.ctx:
        real = recorded_peak(os.path.join(TRACES, f"cs336_ctx{ctx}_fwd_mixed.pickle.gz"))
        new = predict_forward(ctx).peak
        old = predict_forward(ctx, cuda_lists=False, workspace=0).peak
        print(f"| {ctx} | {real / GiB:.3f} GiB | {new / GiB:.3f} GiB | {100 * (new - real) / real:+.2f}% | "
              f"{old / GiB:.3f} GiB | {100 * (old - real) / real:+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
