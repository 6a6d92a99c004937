"""`-r`, `--search` and `--predict -r` against each cell's fit map, at two scales (issue 36).

    .venv/bin/python bench/bench_fitmap.py [--cells mlp cnn gpt llama bert resnet generate]
        [--scale small|large] [--start-factor 2] [--every N] [--window 0.2] [--grid 6]
        [--estimate CELL=N ...] [--json OUT] [--maps IN]

For each cell (bench/bench_predict.py's cells: the MLP, CNN and GPT of bench_retry_training.py, and the
transformers Llama, BERT and `generate` and the ResNet of tests/model_cells.py, built from configs), in a
real IPython shell with `%gpumem --simulate CAP` on (the simulated device reserves as torch's caching
allocator does: 2 and 20 MiB segments, rounded blocks, its cache):

- the methods, each from the same start state at `start` (`--start-factor` times a first estimate of the
  largest, a value too large): `-r bs` (runs of the cell, the value kept), `-r bs --search` (probes, then
  the real run), `--predict -r bs` (its largest, and whether that value fits when run); whether the model
  and optimizer after `-r` and `--search` equal one clean run's at the value kept;
- the fit map: the cell run from the start state at every value from 1 to 25% above the largest any
  method or the estimate found, where that is at most `--every` values; else (`fit_map`) the values
  within 1% of each value found, 12 spread over `--window` around them and a coarse grid (`--grid`
  values) below, with the estimate's own bisection runs. Its largest fitting value is the largest.
  Compact: ranges that fit and that do not.

`--scale small`: the cells' own small devices (32-192 MiB, where a 20 MiB segment is 10-60% of it);
`--scale large`: 2 GiB and up (a 20 MiB segment under 1%), the cells made larger per row where a run at
that size would take more than a few seconds on two cores (see LARGE). `--maps IN` reads the largest
values of an earlier run's JSON instead of mapping again (to measure another version of the code against
the same maps).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_predict as bp  # noqa: E402
import bench_retry_training as brt  # noqa: E402

# large scale: the capacity, and the set-up's edits that make a row larger (wider, longer) so that the
# largest value stays small enough for a run to take seconds
LARGE = {
    # the MLP narrowed at both ends (16 inputs, 16 after the wide layer): its memory is the wide layer's
    # activations, elementwise work, not the matrix products that made a run at 2 GiB take 20 s and more
    "mlp": ("2GiB", [("nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(),\n                      nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10)",
                      "nn.Linear(16, 8192), nn.BatchNorm1d(8192), nn.ReLU(),\n                      nn.Linear(8192, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)")]),
    # the CNN narrower (16-32 channels, less compute per byte) and its data set larger (16384 images)
    "cnn": ("2GiB", [("(4096, 3, 32, 32)", "(16384, 3, 32, 32)"), ("(4096,)", "(16384,)"),
                     ("*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), nn.MaxPool2d(2),\n                      *block(128, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)",
                      "*block(3, 16), *block(16, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2),\n                      *block(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)")]),
    "gpt": ("2GiB", [("V, T, D = 512, 64, 128", "V, T, D = 4096, 256, 32")]),
    "llama": ("2GiB", [("vocab_size=512, hidden_size=64, intermediate_size=176", "vocab_size=8192, hidden_size=64, intermediate_size=176")]),
    "bert": ("2GiB", [("vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,\n                 max_position_embeddings=128", "vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,\n                 max_position_embeddings=512")]),
}
LARGE_CELL = {
    "mlp": [("torch.randn(bs, 256)", "torch.randn(bs, 16)")],
    "llama": [("(bs, 32)", "(bs, 128)")],
    "bert": [("48", "384")],
}


def prepared(ip, key: str, scale: str) -> tuple[str, str]:
    """The cell's simulated GPU on and its set-up run: (the cell, the capacity)."""
    what, setup, cell, cap = bp.CELLS[key]
    if scale == "large":
        if key not in LARGE:
            raise SystemExit(f"{key}: no large-scale sizing (LARGE)")
        cap, edits = LARGE[key]
        for old, new in edits:
            if old not in setup:
                raise SystemExit(f"{key}: {old!r} not in its set-up")
            setup = setup.replace(old, new)
        for old, new in LARGE_CELL.get(key, ()):
            if old not in cell:
                raise SystemExit(f"{key}: {old!r} not in its cell")
            cell = cell.replace(old, new)
    brt.run(ip, "%gpumem --simulate off -q")
    brt.run(ip, f"%gpumem --simulate {cap} -q")
    brt.run(ip, setup)
    ip.user_ns["STEPS"] = bp.STEPS
    brt.settle(ip)
    brt.CELL = cell
    return cell, cap


PARTIAL: dict = {}      # the cell being measured, written to `--json` after every run so that a stopped run keeps it


def save(path) -> None:
    if path:
        Path(path).write_text(json.dumps(PARTIAL, indent=1, default=str))


def fits(ip, value: int, seen: dict) -> bool:
    if value not in seen:
        t0 = time.perf_counter()
        brt.fresh(ip, value)
        seen[value] = brt.fits(ip, value)
        print(f"    map {value}: {'fits' if seen[value] else 'oom'} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        save(PARTIAL.get("_json"))
    return seen[value]


def estimate(ip, seen: dict) -> int:
    """A first estimate of the largest value (doubling, then bisection: monotone, so not the truth)."""
    hi = 8
    while fits(ip, hi, seen):
        hi *= 2
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ip, mid, seen) else (lo, mid)
    return lo


def fit_map(ip, found: list[int], every: int, window: float, grid: int, seen: dict, fine: float = 0.01,
            spread: int = 12) -> None:
    """Every value up to 25% above the largest found where that is at most `every` values; else the values
    within `fine` of each value found (every one, or 1 in f/300 above 300), `spread` values evenly over
    `window` around them, and a coarse grid (`grid` values) below: on these 2 cores, shared, a run takes
    2-10 s and every value of a window of hundreds is out of reach."""
    top = int(1.25 * max(found)) + 1
    if top <= every:
        values = set(range(1, top + 1))
    else:
        low, high = int(min(found) * (1 - window)), int(max(found) * (1 + window)) + 1
        values = {low + (high - low) * i // spread for i in range(spread + 1)}
        values |= {max(1, low * i // grid) for i in range(1, grid)}
        for f in found:
            values |= set(range(max(1, int(f * (1 - fine))), int(f * (1 + fine)) + 2, max(1, f // 300)))
            values |= {f - 1, f, f + 1}
    for v in sorted(values):
        fits(ip, v, seen)


def ranges(seen: dict) -> str:
    from cuda_magic.recover.largest import FitMap

    return FitMap(seen).ranges()


def methods(ip, cell: str, start: int, seen: dict, chosen=("r", "search", "predict")) -> dict:
    out = {}
    for key, flags in [(k, f) for k, f in (("r", ""), ("search", "--search")) if k in chosen]:
        t0 = time.perf_counter()
        result = brt.guarded(ip, start, flags)
        result["seconds"] = time.perf_counter() - t0
        _, clean = brt.clean_run(ip, result["found"]) if result["found"] else (0, None)
        result["equal"] = bool(clean is not None and ip.user_ns["same"](result.pop("after"), clean))
        out[key] = result
        print(f"  {key}: {result['values']} -> {result['found']}", file=sys.stderr)
    if "predict" not in chosen:
        return out
    brt.fresh(ip, start)
    pred = brt.run(ip, "%%oomguard --predict -q -o -r bs\n" + cell)
    largest = pred.largest
    # its value run from the start state, as every value of the map (and kept in it)
    out["predict"] = {"found": largest, "fits": bool(largest) and fits(ip, largest, seen)}
    print(f"  predict: {largest} fits={out['predict']['fits']}", file=sys.stderr)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["mlp", "cnn", "gpt", "llama", "bert", "resnet", "generate"])
    parser.add_argument("--scale", choices=["small", "large"], default="small")
    parser.add_argument("--start-factor", type=float, default=2.0)
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--window", type=float, default=0.2)
    parser.add_argument("--grid", type=int, default=6)
    parser.add_argument("--estimate", nargs="*", default=[], metavar="CELL=N",
                        help="a first estimate of the largest, known already (skips finding it)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--maps", help="an earlier run's JSON: its largest values and starts, not mapped again")
    parser.add_argument("--methods", nargs="+", choices=["r", "search", "predict"], default=["r", "search", "predict"],
                        help="with --maps: only these (the others' figures taken from the maps' JSON)")
    args = parser.parse_args(argv)
    earlier = json.loads(Path(args.maps).read_text()) if args.maps else {}
    ip = brt.shell()
    results = {}
    for key in args.cells:
        print(f"{key}:", file=sys.stderr)
        cell, cap = prepared(ip, key, args.scale)
        seen: dict[int, bool] = {}
        PARTIAL.clear()
        PARTIAL.update(results, _json=args.json, _partial={key: {"cap": cap, "seen": seen}})
        t0 = time.perf_counter()
        if key in earlier:
            est, start = earlier[key]["estimate"], earlier[key]["start"]
        else:
            known = dict(item.split("=") for item in args.estimate)
            est = int(known[key]) if key in known else estimate(ip, seen)
            start = int(est * args.start_factor)
        run_seconds = time.perf_counter() - t0
        PARTIAL["_partial"][key].update(estimate=est, start=start)
        found = methods(ip, cell, start, seen, args.methods)
        if key in earlier:
            found = {**{k: v for k, v in earlier[key]["methods"].items() if k not in args.methods}, **found}
        PARTIAL["_partial"][key].update(methods=found)
        save(args.json)
        if key in earlier:
            largest, compact = earlier[key]["largest"], earlier[key]["map"]
        else:
            fit_map(ip, [est] + [m["found"] for m in found.values() if m["found"]], args.every, args.window,
                    args.grid, seen)
            largest, compact = max(v for v, ok in seen.items() if ok), ranges(seen)
        results[key] = dict(cap=cap, estimate=est, start=start, largest=largest, map=compact, methods=found,
                            estimate_seconds=run_seconds)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    command = "command: .venv/bin/python bench/bench_fitmap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(command.rstrip() + "\n")
    head = ["cell", "device", "start", "largest (fit map)", "`-r` runs: values", "`-r` of largest",
            "`--search` runs (probes): values", "`--search` of largest", "`--predict -r`", "fits when run",
            "state = one clean run (-r, --search)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key, r in results.items():
        m, big = r["methods"], r["largest"]

        def share(v):
            return f"{v} ({100 * v / big:.0f}%)" if v else "none"

        rr, ss, pp = m["r"], m["search"], m["predict"]
        print("| " + " | ".join([
            key, r["cap"], str(r["start"]), str(big),
            f"{rr['runs']}: {' '.join(map(str, rr['values']))}", share(rr["found"]),
            f"{ss['runs']} ({ss['probes']}): {' '.join(map(str, ss['values']))}", share(ss["found"]),
            share(pp["found"]), "yes" if pp["fits"] else "NO",
            f"{'yes' if rr['equal'] else 'no'}, {'yes' if ss['equal'] else 'no'}"]) + " |")
    print("\nfit maps (values run from the start state; ranges that fit and do not):")
    for key, r in results.items():
        print(f"- {key} ({r['cap']}): {r['map']}")


if __name__ == "__main__":
    main()
