"""`-r`, `--search` and `--predict -r` against each cell's fit map, at two scales (issue 36).

    .venv/bin/python bench/bench_fitmap.py [--cells mlp cnn gpt llama bert resnet generate]
        [--scale small|large] [--start-factor 2] [--every N] [--window 0.2] [--grid 6]
        [--estimate CELL=N ...] [--guess CELL=N ...] [--within 0.05] [--map-first] [--json OUT] [--maps IN]
        [--map-only [--below-every N] [--resume]]

For each cell (bench/bench_predict.py's cells: the MLP, CNN and GPT of bench_retry_training.py, and the
transformers Llama, BERT and `generate` and the ResNet of tests/model_cells.py, built from configs), in a
real IPython shell with `%gpumem --simulate CAP` on (the simulated device reserves as torch's caching
allocator does: 2 and 20 MiB segments, rounded blocks, its cache):

- the methods, each from the same start state at `start` (`--start-factor` times a first estimate of the
  largest, a value too large): `-r bs` (runs of the cell, the value kept), `-r bs --search` (probes, then
  the real run), `--predict -r bs` (its largest, and whether that value fits when run); whether the model
  and optimizer after `-r` and `--search` equal one clean run's at the value kept;
- the fit map: the cell run from the start state at every value from 1 to 20% (`--window`) above the
  largest any method or the estimate found, where that is at most `--every` values; else (`fit_map`) every
  value from `--window` below the smallest value found to `--window` above the largest, and a coarse grid
  (`--grid` values) below, with the estimate's own runs. Its largest fitting value is the largest. Compact:
  ranges that fit and that do not; `seen` in the JSON: every value run and whether it fitted.
- the estimate: doubling from `--guess` (default 8), then bisection until the bracket is within
  `--within` of its lower end (the map around it finds the largest). `--map-first`: the map around the
  estimate is run and written to `--json` before the methods run (so that `--maps` can use it elsewhere).

`--scale small`: the cells' own small devices (32-192 MiB, where a 20 MiB segment is 10-60% of it);
`--scale large`: 2 GiB (a 20 MiB segment under 1%), each cell's rows made larger (wider, longer, bigger
images; see LARGE) so that its largest value at 2 GiB is about 50-150 and a window of 20% is tens of runs. `--maps IN` reads the largest
values of an earlier run's JSON instead of mapping again (to measure another version of the code against
the same maps). `--map-only`: no method run; the map of every value from 1 (or every `--below-every`-th
under the window) to `--window` above the largest that fits, around the largest of `--maps` (whose
methods' figures are carried and scored against the new largest) or `--estimate`.
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
    # the MLP narrow at both ends (16 inputs, 16 after the wide layer) and very wide between (2**20): its
    # memory is the wide layer's activations, about 16 MiB a row, elementwise work rather than matrix products
    "mlp": ("2GiB", [("nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(),\n                      nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10)",
                      "nn.Linear(16, 1048576), nn.BatchNorm1d(1048576), nn.ReLU(),\n                      nn.Linear(1048576, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)")]),
    # the CNN narrower (4-16 channels, pooled after each block: less compute per byte) on 384x384 images
    # (144 times the pixels), 320 of them
    "cnn": ("2GiB", [("(4096, 3, 32, 32)", "(320, 3, 384, 384)"), ("(4096,)", "(320,)"),
                     ("*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), nn.MaxPool2d(2),\n                      *block(128, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)",
                      "*block(3, 4), nn.MaxPool2d(2), *block(4, 8), nn.MaxPool2d(2), *block(8, 16), nn.MaxPool2d(2),\n                      *block(16, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)")]),
    "gpt": ("2GiB", [("V, T, D = 512, 64, 128", "V, T, D = 4096, 256, 32")]),
    "llama": ("2GiB", [("vocab_size=512, hidden_size=64, intermediate_size=176", "vocab_size=8192, hidden_size=64, intermediate_size=176")]),
    "bert": ("2GiB", [("vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,\n                 max_position_embeddings=128", "vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,\n                 max_position_embeddings=512")]),
    # the ResNet narrower (4-8-16 channels: a quarter of the compute per byte of 16-32-64) on 384x384 images
    # (144 times the pixels), 256 of them
    "resnet": ("2GiB", [("(512, 3, 32, 32)", "(256, 3, 384, 384)"), ("(512,)", "(256,)"),
                        ("nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)",
                         "nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4)"),
                        ("Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2)",
                         "Block(4, 4, 1), Block(4, 8, 2), Block(8, 16, 2)"),
                        ("nn.Linear(64, 10)", "nn.Linear(16, 10)")]),
    # `generate` with a vocabulary of 2**20 on a width of 8: its memory is each step's logits (the last
    # position's, 4 MiB a row) and what generate makes of them (about 24.5 MiB a row in all), computed at
    # 8 multiply-adds a float; 2 new tokens: largest 81, a run 2-14 s here. (1024-token prompts made the
    # largest about 416 at 40-87 s a run: the KV cache costs the prompt's length in attention work per float)
    "generate": ("2GiB", [("vocab_size=512, hidden_size=64, intermediate_size=176",
                           "vocab_size=1048576, hidden_size=8, intermediate_size=32")]),
}
LARGE_CELL = {
    "mlp": [("torch.randn(bs, 256)", "torch.randn(bs, 16)")],
    "llama": [("(bs, 32)", "(bs, 128)")],
    "bert": [("48", "512")],
    "generate": [("max_new_tokens=48, min_new_tokens=48", "max_new_tokens=2, min_new_tokens=2")],
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


def fresh(ip, value: int) -> None:
    """bench_retry_training.fresh, then the cache emptied: its `reset()` (the optimizer's state reloaded,
    a gc pass) runs after its release, so what the previous run left and reset() freed stayed cached at the
    next run's start (a 392 and a 20 MiB segment on the 2 GiB MLP), and whether a value fitted depended on
    the run before it (97-98 fit after 96, not as the first run); a retry's runs start with the cache
    emptied (recover/retrying.py)."""
    from cuda_magic import release

    brt.fresh(ip, value)
    release(ip)


def fits(ip, value: int, seen: dict) -> bool:
    if value not in seen:
        t0 = time.perf_counter()
        fresh(ip, value)
        seen[value] = brt.fits(ip, value)
        print(f"    map {value}: {'fits' if seen[value] else 'oom'} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        save(PARTIAL.get("_json"))
    return seen[value]


def estimate(ip, seen: dict, guess: int = 8, within: float = 0.0) -> int:
    """A first estimate of the largest value (doubling from `guess`, then bisection until the bracket is
    within `within` of its lower end: monotone, so not the truth; the map around it finds the largest)."""
    hi = max(2, guess)
    lo = 1
    while fits(ip, hi, seen):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, int(lo * within)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ip, mid, seen) else (lo, mid)
    return lo


def fit_map(ip, found: list[int], every: int, window: float, grid: int, seen: dict) -> None:
    """Every value from 1 to 20% above the largest found where that is at most `every` values; else every
    value within `window` of the values found (from `window` below the smallest to `window` above the
    largest) and a coarse grid (`grid` values) below."""
    top = int((1 + window) * max(found)) + 1
    if top <= every:
        values = set(range(1, top + 1))
    else:
        low = max(1, int(min(found) * (1 - window)))
        values = set(range(low, top + 1))
        values |= {max(1, low * i // grid) for i in range(1, grid)}
    for v in sorted(values):
        fits(ip, v, seen)


def every_value(ip, largest: int, window: float, below: int, seen: dict) -> None:
    """`--map-only`: every value from `window` under `largest` to `window` above the largest value that
    fits (raised while a value above it fits, so a fitting value past the first window is followed), then
    every `below`-th value under the window, counted down from it (1: every value from 1). Above `largest`
    first (what says whether it is the largest), then down from it, so that a stopped map has those."""
    low = max(1, int(largest * (1 - window)))
    v = largest
    while v <= int((1 + window) * max([largest] + [u for u, ok in seen.items() if ok])) + 1:
        fits(ip, v, seen)
        v += 1
    for v in range(largest - 1, low - 1, -1):
        fits(ip, v, seen)
    for v in range(low - max(1, below), 0, -max(1, below)):
        fits(ip, v, seen)


def islands(seen: dict) -> list[tuple[int, int]]:
    """The values that run out below the largest that fits, in ranges (first, last) of consecutive values
    run: where fitting is not monotone."""
    top = max([v for v, ok in seen.items() if ok], default=0)
    out: list[list[int]] = []
    last = None
    for v in sorted(seen):
        if v >= top:
            break
        if not seen[v]:
            if out and last is not None and not seen[last] and out[-1][1] == last:
                out[-1][1] = v
            else:
                out.append([v, v])
        last = v
    return [(a, b) for a, b in out]


def ranges(seen: dict) -> str:
    from cuda_magic.recover.largest import FitMap

    return FitMap(seen).ranges()


def methods(ip, cell: str, start: int, seen: dict, chosen=("r", "search", "predict")) -> dict:
    out = {}
    for key, flags in [(k, f) for k, f in (("r", ""), ("search", "--search")) if k in chosen]:
        fresh(ip, start)     # guarded's own fresh() then leaves nothing cached
        t0 = time.perf_counter()
        result = brt.guarded(ip, start, flags)
        result["seconds"] = time.perf_counter() - t0
        if result["found"]:
            fresh(ip, result["found"])
        _, clean = brt.clean_run(ip, result["found"]) if result["found"] else (0, None)
        result["equal"] = bool(clean is not None and ip.user_ns["same"](result.pop("after"), clean))
        out[key] = result
        print(f"  {key}: {result['values']} -> {result['found']}", file=sys.stderr)
    if "predict" not in chosen:
        return out
    fresh(ip, start)
    pred = brt.run(ip, "%%oomguard --predict -q -o -r bs\n" + cell)
    largest = pred.largest
    # its value run from the start state, as every value of the map (and kept in it)
    out["predict"] = {"found": largest, "fits": bool(largest) and fits(ip, largest, seen)}
    print(f"  predict: {largest} fits={out['predict']['fits']}", file=sys.stderr)
    return out


def map_only(args, earlier: dict) -> dict:
    """`--map-only`: each cell's map of every value (every_value) around the largest of `--maps` (or
    `--estimate`), the methods not run: their figures are carried from `--maps` and scored against the new
    largest. `--resume`: the values a `--map-only` JSON (or its partial part) has already run are kept."""
    known = dict(item.split("=") for item in args.estimate)
    befores = {key: earlier.get(key) or earlier.get("_partial", {}).get(key) or {} for key in args.cells}
    for key, before in befores.items():      # checked for every cell before any runs
        if key not in known and "largest" not in before:
            raise SystemExit(f"{key}: --map-only needs its largest from --maps or --estimate {key}=N")
        if args.resume and before and not before.get("map_only"):
            raise SystemExit(f"{key}: --resume reads only a --map-only JSON (another map's runs started "
                             "from another state)")
    ip = brt.shell()
    results: dict = {}
    for key in args.cells:
        before = befores[key]
        print(f"{key}:", file=sys.stderr)
        _, cap = prepared(ip, key, args.scale)
        seen: dict[int, bool] = ({int(v): ok for v, ok in before.get("seen", {}).items()} if args.resume else {})
        first = int(known[key]) if key in known else before.get("first_largest", before["largest"])
        entry = dict(cap=cap, map_only=True, window=args.window, below_every=args.below_every,
                     first_largest=first, estimate=before.get("estimate"), start=before.get("start"),
                     methods=before.get("methods"), seconds=before.get("seconds", 0.0) if args.resume else 0.0)
        PARTIAL.clear()
        PARTIAL.update(results, _json=args.json, _partial={key: {**entry, "largest": first, "seen": seen}})
        t0 = time.perf_counter()
        every_value(ip, first, args.window, args.below_every, seen)
        entry["seconds"] += time.perf_counter() - t0
        results[key] = dict(entry, largest=max(v for v, ok in seen.items() if ok), map=ranges(seen),
                            islands=islands(seen), runs=len(seen),
                            seen={str(v): ok for v, ok in sorted(seen.items())})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("command: .venv/bin/python bench/bench_fitmap.py " + " ".join(args.argv) + "\n")
    for key, r in results.items():
        big = r["largest"]
        scored = ", ".join(f"{k} {m['found']} ({100 * m['found'] / big:.0f}%)"
                           for k, m in (r["methods"] or {}).items() if m.get("found"))
        gaps = ", ".join(f"{a}-{b}" if b != a else f"{a}" for a, b in r["islands"]) or "none"
        print(f"- {key} ({r['cap']}, {r['runs']} runs, {r['seconds']:.0f} s): largest {big} (was {r['first_largest']}); "
              f"{r['map']}; out of memory below the largest: {gaps}" + (f"; methods: {scored}" if scored else ""))
    return results


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
    parser.add_argument("--guess", nargs="*", default=[], metavar="CELL=N",
                        help="where the estimate's doubling starts (default 8)")
    parser.add_argument("--within", type=float, default=0.0,
                        help="the estimate's bisection stops within this share (the map finds the largest)")
    parser.add_argument("--map-first", action="store_true",
                        help="map around the estimate and write it before running the methods")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--maps", help="an earlier run's JSON: its largest values and starts, not mapped again")
    parser.add_argument("--methods", nargs="+", choices=["r", "search", "predict"], default=["r", "search", "predict"],
                        help="with --maps: only these (the others' figures taken from the maps' JSON)")
    parser.add_argument("--map-only", action="store_true",
                        help="only the map of every value around the largest of --maps or --estimate")
    parser.add_argument("--below-every", type=int, default=1,
                        help="with --map-only: every N-th value under the window (1: every value from 1)")
    parser.add_argument("--resume", action="store_true",
                        help="with --map-only: keep the values the --maps JSON (a --map-only one) has run")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    earlier = json.loads(Path(args.maps).read_text()) if args.maps else {}
    if args.map_only:
        map_only(args, earlier)
        return
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
            guesses = dict(item.split("=") for item in args.guess)
            est = (int(known[key]) if key in known else
                   estimate(ip, seen, int(guesses.get(key, 8)), args.within))
            start = int(est * args.start_factor)
        run_seconds = time.perf_counter() - t0
        PARTIAL["_partial"][key].update(estimate=est, start=start)

        def result(found):
            if key in earlier:
                largest, compact, kept = earlier[key]["largest"], earlier[key]["map"], earlier[key].get("seen")
            else:
                largest, compact = max(v for v, ok in seen.items() if ok), ranges(seen)
                kept = {str(v): ok for v, ok in sorted(seen.items())}
            return dict(cap=cap, estimate=est, start=start, largest=largest, map=compact, methods=found,
                        estimate_seconds=run_seconds, runs=len(seen), seen=kept)

        if key not in earlier and args.map_first:
            # the map around the estimate first, written out before the methods run (for `--maps` elsewhere)
            fit_map(ip, [est], args.every, args.window, args.grid, seen)
            results[key] = PARTIAL[key] = result(None)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        found = methods(ip, cell, start, seen, args.methods)
        if key in earlier:
            found = {**{k: v for k, v in earlier[key]["methods"].items() if k not in args.methods}, **found}
        PARTIAL["_partial"][key].update(methods=found)
        save(args.json)
        if key not in earlier:
            fit_map(ip, [est] + [m["found"] for m in found.values() if m["found"]], args.every, args.window,
                    args.grid, seen)
        results[key] = result(found)
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
