"""The retry across the ranks of a torch.distributed process group (SPEC "Under torch.distributed"):
real processes on the gloo backend, each rank with its own simulated device (tests/dist_worker.py). Every
test is bounded: the processes are killed at HARD_LIMIT, the process group and the agreement time out."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402

HARD_LIMIT = 150     # seconds for all the processes of one test (2 shared cores: imports take a while)
WORKER = Path(__file__).with_name("dist_worker.py")


def run_ranks(tmp_path, world: int, scenario: str) -> tuple[list[dict], list[str], float]:
    init = tmp_path / "init"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    outs = [open(tmp_path / f"out{r}.txt", "w+") for r in range(world)]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(init), scenario, str(tmp_path)],
                              stdout=outs[r], stderr=subprocess.STDOUT, env=env) for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=max(1, HARD_LIMIT - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.monotonic() - t0
    texts = []
    for f in outs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    assert wall < HARD_LIMIT, f"the ranks did not finish within {HARD_LIMIT} s:\n" + "\n".join(texts)
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.pt"
        assert path.exists(), f"rank {r} saved nothing (exit {procs[r].returncode}):\n{texts[r]}"
        results.append(torch.load(path, weights_only=False))
    return results, texts, wall


def failing_phases(log) -> list[str]:
    """The phase each undone attempt stopped in (what it logged last before the next start)."""
    out, last = [], None
    for item in log:
        if isinstance(item, tuple):
            if last is not None and last != "done":
                out.append(last)
            last = None
        else:
            last = item
    return out


def assert_same_and_clean(results, world, scenario):
    phase, who = scenario.split(":")[:2]
    for res in results:
        assert "error" not in res, res.get("trace")
    values = {res["value"] for res in results}
    accums = {res["final_accum"] for res in results}
    assert len(values) == 1 and len(accums) == 1, (values, accums)
    value, accum = values.pop(), accums.pop() or 1
    assert value < dist_worker.BATCH
    model, opt = dist_worker.reference(world, phase, who, value, accum)
    for res in results:
        for k, v in model.items():
            assert torch.allclose(res["model"][k], v, atol=1e-6), (res["rank"], k)
        for key, state in opt["state"].items():
            for name, t in state.items():
                assert torch.allclose(res["optimizer"]["state"][key][name], t, atol=1e-6), (res["rank"], name)
    return value, accum


@pytest.mark.parametrize("world,scenario", [
    (2, "forward:one"), (4, "forward:all"), (2, "backward:all"), (2, "backward:one"), (2, "step:one"),
    (4, "step:all")])
def test_every_rank_retries_together(tmp_path, world, scenario):
    results, texts, wall = run_ranks(tmp_path, world, scenario)
    value, _ = assert_same_and_clean(results, world, scenario)
    phase, who = scenario.split(":")[:2]
    failing = [1] if who == "one" else list(range(world))
    for res in results:
        assert res["outcome"] == "recovered"
        first = res["ranks"][0]                     # every rank keeps every rank's figures
        assert [e["rank"] for e in first] == list(range(world))
        assert {e["rank"] for e in first if e["state"] == "oom"} == set(failing)
        phases = failing_phases(res["log"])
        if res["rank"] in failing:                  # it ran out where the scenario put it
            assert phases and phases[0] == phase, res["log"]
        elif phase == "backward":                   # the others waited in DDP's gradient all-reduce
            assert res["log"][:3] == [("start", 64, 1), "forward", "backward"], res["log"]
            assert isinstance(res["log"][3], tuple), res["log"]
        elif phase == "step":                       # the others ran the step through, and undid it
            assert res["log"][:5] == [("start", 64, 1), "forward", "backward", "step", "done"], res["log"]
    assert "out of memory" not in texts[1]          # shown once, on rank 0 (silent here: it recovered)
    if phase == "forward":                          # the rank that failed inside the model measured it on
        for res in results:                         # slices of its batch (no collective): 2 runs
            assert len(res["ranks"]) == 2, res["ranks"]
        assert "predicted from the model measured on" in results[failing[0]]["reasons"][1], results[1]["reasons"]


def test_accumulate_keeps_the_global_batch(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "forward:one:accum")
    value, accum = assert_same_and_clean(results, 2, "forward:one:accum")
    assert value * accum * 2 >= dist_worker.BATCH * 2


def test_an_error_that_is_not_oom_stops_every_rank_alike(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "error:one")
    errors = {res.get("error") for res in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("RankError:") and "rank 1 of 2 stopped with ValueError: a bug on rank 1" in error


def test_a_stuck_rank_stops_every_rank_within_the_bound(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "stall:one")
    for res in results:
        assert res.get("error", "").startswith("RankError:"), res
    rank0 = results[0]
    assert rank0["seconds"] < dist_worker.AGREE_TIMEOUT + 15
    assert "did not all reach" in rank0["error"]


def test_accelerate_notebook_launcher(tmp_path):
    pytest.importorskip("accelerate")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(WORKER.with_name("dist_launcher.py"))], capture_output=True,
                          text=True, timeout=HARD_LIMIT, env=env, cwd=tmp_path)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, done.stdout + done.stderr
    assert all("recovered" in line for line in lines)
    ends = {line.split(": ", 1)[1] for line in lines}     # the same value and the same parameters
    assert len(ends) == 1, lines


def test_torchrun(tmp_path):
    # the README's script, on gloo: torchrun sets RANK, WORLD_SIZE and the rendezvous in the environment
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", "--max_restarts=0",
                           str(WORKER.with_name("dist_launcher.py"))],
                          capture_output=True, text=True, timeout=HARD_LIMIT, env=env, cwd=tmp_path)
    lines = sorted(line.split("]:", 1)[-1].strip() for line in done.stdout.splitlines() if "rank " in line)
    assert len(lines) == 2, done.stdout + done.stderr
    assert all("of 2: batch_size=" in line and "recovered" in line for line in lines), lines
    ends = {line.split(": ", 1)[1] for line in lines}     # the same value and the same parameters
    assert len(ends) == 1, lines


def test_search_agrees_on_every_probe(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "forward:one:search")
    value, _ = assert_same_and_clean(results, 2, "forward:one:search")
    attempts = [[(e["value"], e["state"]) for e in entries] for entries in results[0]["ranks"]]
    assert attempts == [[(e["value"], e["state"]) for e in entries] for entries in results[1]["ranks"]]
    assert len(attempts) >= 2 and attempts[-1] == [(value, "ok"), (value, "ok")]


def test_outside_a_process_group_nothing_distributed_is_imported():
    from cuda_magic import oomguard, simulated_device

    @oomguard(retry="n")
    def fill(n=64):
        return torch.zeros(n, 1024).sum()

    with simulated_device(100_000, allocator="plain"):
        fill()
    assert fill.last_report.outcome == "recovered"
    assert "cuda_magic.recover.ranks" not in sys.modules and "cuda_magic.recover.ranked_retry" not in sys.modules


def test_a_group_of_one_rank_retries_as_a_single_process(tmp_path):
    code = f"""
import datetime, sys, torch, torch.distributed as dist
from cuda_magic import oomguard, simulated_device
dist.init_process_group("gloo", init_method="file://{tmp_path}/init", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=10))
@oomguard(retry="n")
def fill(n=64):
    return torch.zeros(n, 1024).sum()
with simulated_device(100_000, allocator="plain"):
    fill()
print(fill.last_report.outcome, "cuda_magic.recover.ranks" in sys.modules, fill.last_report.ranks is not None)
dist.destroy_process_group()
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.split() == ["recovered", "False", "False"], done.stdout + done.stderr


def test_the_verdict_reads_every_rank_alike():
    from cuda_magic.recover.ranks import RankError, verdict

    ok = {"rank": 0, "state": "ok"}
    oom = {"rank": 1, "state": "oom"}
    timed_out = {"rank": 0, "state": "error", "error": "RuntimeError: [gloo] Timed out waiting 6000ms for recv"}
    bug = {"rank": 0, "state": "error", "error": "ValueError: a bug"}
    assert verdict([ok, dict(ok, rank=1)]) == "ok"
    assert verdict([ok, oom]) == "oom"
    assert verdict([timed_out, oom]) == "oom"        # it waited in DDP's all-reduce for the rank that failed
    with pytest.raises(RankError, match="rank 0 of 2 stopped with ValueError: a bug"):
        verdict([bug, oom])
    with pytest.raises(RankError, match="rank 0 of 2 stopped with RuntimeError"):
        verdict([timed_out, dict(ok, rank=1)])      # a collective failed with no rank out of memory


def test_a_policy_adopts_the_value_the_ranks_agreed_on():
    from cuda_magic.recover.retry import BatchSearch

    policy = BatchSearch(64, capacity=1 << 20)
    assert policy.first() == 64
    policy.record(64, False, requested=1 << 19, baseline=0, allocated_at_failure=1 << 20)
    assert policy.next() is not None
    policy.adopt(20, "agreed")
    policy.record(20, True, peak=1 << 18, baseline=0)
    assert policy.best == 20 and policy.next() is None
    policy = BatchSearch(64)
    policy.first()
    policy.record(64, False)
    policy.adopt(None)
    assert policy.next() is None and policy.done


def test_nothing_fits_every_rank_stops_and_rank_0_alone_shows_the_report(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "forward:one:floor")
    for res in results:
        assert res.get("error", "").startswith("OutOfMemoryError: batch_size=60: out of memory in this call"), res
        assert [[e["value"] for e in entries] for entries in res["ranks"]] == [[64, 64], [60, 60]]
    assert len({res["error"] for res in results}) == 1          # the same words on every rank
    assert "rank 1 out of memory" in texts[0] and "batch_size=60 on 2 ranks" in texts[0]   # every rank's figures
    assert "out of memory" not in texts[1]


def assert_blocks_alike(results):
    """The user's loop ran the same blocks on every rank: out of memory until one fitted everywhere."""
    runs = [[b["outcome"] for b in res.get("blocks", [])] for res in results]
    assert all(r == runs[0] for r in runs), runs
    assert len(runs[0]) >= 2 and runs[0][-1] == "ok" and set(runs[0][:-1]) == {"oom"}, runs


@pytest.mark.parametrize("scenario", ["forward:one:block", "backward:one:block"])
def test_a_with_block_ends_on_every_rank_together(tmp_path, scenario):
    results, texts, wall = run_ranks(tmp_path, 2, scenario)
    value, _ = assert_same_and_clean(results, 2, scenario)      # the user's loop, at its final value
    assert_blocks_alike(results)
    for res in results:
        first = res["blocks"][0]
        assert [(e["rank"], e["state"]) for e in first["ranks"][0]][1] == (1, "oom")
        said = " ".join(first["warnings"])
        assert "the block on 2 ranks: " in said and "rank 1 out of memory at `" in said, said
    if scenario.startswith("backward"):          # rank 0 waited in DDP's all-reduce, then learnt why
        assert results[0]["blocks"][0]["ranks"][0][0]["state"] == "error"
    assert "out of memory" not in texts[1]


def test_a_block_one_rank_ran_through_says_the_parameters_differ(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "step:one:block")
    assert_blocks_alike(results)
    for res in results:
        said = " ".join(res["blocks"][0]["warnings"])
        assert "the ranks' parameters differ now: rank 0 ran the block through" in said, said
    assert not all(torch.equal(results[0]["model"][k], results[1]["model"][k]) for k in results[0]["model"])


def test_a_block_raises_the_same_short_error_on_every_rank(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "forward:one:block:raise")
    errors = {res.get("error") for res in results}
    assert len(errors) == 1, errors
    assert errors.pop().startswith("OutOfMemoryError: out of memory in this block on rank 1 of 2: every rank "
                                   "stopped it")
    assert "rank 1 out of memory at `" in texts[0]          # rank 0 shows every rank's figures
    assert "out of memory" not in texts[1]


def test_an_error_in_a_block_stops_every_rank_alike(tmp_path):
    results, texts, wall = run_ranks(tmp_path, 2, "error:one:block")
    errors = {res.get("error") for res in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("RankError:") and "rank 1 of 2 stopped with ValueError: a bug on rank 1" in error


ONE_RANK_BOTH_WAYS = """
import datetime, json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from cuda_magic import oomguard, simulated_device
import cuda_magic.recover.retry_loop as loop
from test_retry_loop import CAPACITY, cliff_step
dist.init_process_group("gloo", init_method="file://{init}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=20))
loops = []

class Seen(loop.RetryLoop):                     # the loops made, to read their policy
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        loops.append(self)

loop.RetryLoop = Seen

@oomguard(retry="n", quiet=True, raise_on_oom=False)
def fill(n=1000):            # on 24 MiB of the caching allocator: its model trims the third value
    return len([torch.zeros(n, 5000) for _ in range(3)])

def runs():
    out = []
    with simulated_device(24 << 20):
        fill()
    out.append(fill.last_report)
    step = cliff_step([0], [None])
    with simulated_device(CAPACITY, allocator="plain"):
        step(torch.nn.Linear(4, 4))
    out.append(step.last_report)
    return [{{"attempts": [(a.value, str(a.outcome), a.probe, a.reason) for a in r.attempts],
              "outcome": str(r.outcome), "ranks": None if r.ranks is None else [r.ranks.rank, r.ranks.world,
                                                                             len(r.ranks)]}} for r in out]

alone = runs()
loop.ranks_in_group = lambda: 2           # the ranks' side of the loop, on this one rank
ranked = runs()
print(json.dumps({{"alone": alone, "ranked": ranked, "deciding": [type(l.deciding).__name__ for l in loops],
                  "allocator": [l.policy.allocator is not None and l.policy.allocator() is not None
                                for l in loops]}}))
dist.destroy_process_group()
"""


def test_the_ranks_run_the_same_loop_as_one_process(tmp_path):
    # one loop: with one rank, the ranks' side decides as one process does, the caching allocator's model
    # asked in both (the policy's allocator), and --search's last probe that ran out followed by the real
    # run at the value found (the copy the ranks had ended out of memory there)
    import json

    code = ONE_RANK_BOTH_WAYS.format(tests=str(Path(__file__).parent), init=tmp_path / "init")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HARD_LIMIT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["deciding"] == ["Alone", "Alone", "Ranked", "Ranked"]
    assert out["allocator"] == [True, False, True, False]     # the caching device's model; none on "plain"
    assert any("caching allocator" in a[3] for a in out["ranked"][0]["attempts"]), out["ranked"][0]
    for alone, ranked in zip(out["alone"], out["ranked"]):
        assert alone["outcome"] == ranked["outcome"] == "recovered", (alone, ranked)
        assert len(alone["attempts"]) >= 3
        assert ranked["attempts"] == [a[:3] + [a[3].replace("to fit", "to fit on every rank")]
                                      for a in alone["attempts"]]
        assert alone["ranks"] is None and ranked["ranks"] == [0, 1, len(ranked["attempts"])]


def test_r_under_ddp_on_the_caching_allocator_lands_within_15_percent():
    """bench/bench_distributed.py's -r: two ranks with DDP, rank 1 out of memory in the forward pass at 64 on
    a simulated device reserving as torch's caching allocator. The value replayed on the allocator's model
    is kept (before: the failure's memory scaled on the allocator cut a replayed 30 to 3, 9.4% of 32)."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "bench_distributed.py"
    done = subprocess.run([sys.executable, str(bench), "--only", "r", "--check"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| -r | rank 0: " in done.stdout, done.stdout
