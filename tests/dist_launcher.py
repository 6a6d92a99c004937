"""A guarded DDP step started by a launcher (tests/test_distributed.py runs this file): accelerate's
notebook_launcher (`python tests/dist_launcher.py`) or torchrun (`python -m torch.distributed.run
--nproc_per_node=2 tests/dist_launcher.py`, which sets RANK and the rendezvous in the environment). Rank
1 has a small simulated device and the longer sequence, rank 0 plenty; both print what they ended at."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def guarded_step():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dist_worker as w
    from cuda_magic import oomguard, simulated_device

    rank = dist.get_rank()
    model = DDP(w.make_model())
    opt = w.make_optimizer(model.parameters())
    X, Y = w.data_of(rank, "forward", "one")

    @oomguard(retry="batch_size", timeout=60)
    def step(model, opt, batch_size=64):
        w.loss_of(model, X[:batch_size].clone(), Y[:batch_size].clone(), False).backward()
        opt.step()
        opt.zero_grad()
        return batch_size

    with simulated_device(1 << 34 if rank == 0 else 1_000_000, allocator="plain"):
        value = step(model, opt)
    total = sum(float(p.sum()) for p in model.parameters())
    print(f"rank {rank} of {dist.get_world_size()}: batch_size={value} {step.last_report.outcome} "
          f"params={total:.6f}", flush=True)


def main():
    from accelerate import PartialState

    PartialState(cpu=True)      # accelerate sets up the process group (gloo: no GPU here)
    guarded_step()


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:       # started by torchrun: the rendezvous is in the environment
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        guarded_step()
        dist.destroy_process_group()
    else:
        from accelerate import notebook_launcher

        notebook_launcher(main, num_processes=2)
