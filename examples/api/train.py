"""A training script of one's own, run with mpigrad's method: its model, its data, torch's
AdamW and OneCycleLR, a DataLoader with worker processes and a DistributedSampler, and the
loop written out. Nothing here ships with mpigrad: the data are stripes whose orientation is
the class, drawn from a seed, and the model is a small CNN written below.

    # mpigrad: rank 0 schedules and serves, ranks 1 and 2 train (the method of a config file)
    mpiexec -n 3 python -m mpi4py examples/api/train.py --config examples/compare/fix2.toml \\
        --trace runs/api-fix2.h5
    # the same loop under torch DDP (gloo), as its users run it: 2 ranks, both train
    mpiexec -n 2 python -m mpi4py examples/api/train.py --ddp

The two differ in a few lines, marked ``# mpigrad`` and ``# DDP`` (docs/api.rst shows them
side by side). ``--losses PREFIX`` writes each worker's losses to PREFIX-K.json (K its index).

Checkpoints, as a Slurm job that is requeued needs them (jobscripts/script.sbatch): with
``--checkpoint FILE`` worker 0 saves the model, the optimizer, the schedule and mpigrad's state
in FILE whenever mpigrad checkpoints (``--set checkpoint_every=N``, and on a walltime signal,
SIGUSR1 or SIGTERM, after which every rank exits 75), and a start that finds FILE continues
from it into the same trace; the finished run removes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

BATCH = 32
CLASSES = 4


class Stripes(Dataset):
    """Noisy 3x16x16 images of stripes at one of four orientations (the class)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        angle = self.y.float() * (math.pi / CLASSES)
        grid = torch.arange(16, dtype=torch.float32)
        u, v = torch.meshgrid(grid, grid, indexing="ij")
        phase = torch.rand(n, generator=g) * 2 * math.pi
        wave = torch.sin(0.8 * (u * torch.cos(angle)[:, None, None] + v * torch.sin(angle)[:, None, None])
                         + phase[:, None, None])
        self.x = wave[:, None].repeat(1, 3, 1, 1) + 2.5 * torch.randn(n, 3, 16, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class StripesNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main(argv: list[str] | None = None, comm=None) -> None:
    """The script; ``argv`` its options (default: the command line's), ``comm`` mpigrad's
    communicator (default: every rank of the job)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", action="store_true", help="run the same loop under torch DDP (gloo) instead")
    parser.add_argument("--config", help="mpigrad: a config file of mpigrad train (its method)")
    parser.add_argument("--trace", default="runs/api.h5", help="mpigrad: the HDF5 trace (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="mpigrad: overwrite the trace")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="mpigrad: another config key, e.g. --set policy=mqgrad (repeatable)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--loader-workers", type=int, default=3)
    parser.add_argument("--losses", metavar="PREFIX", help="write each worker's losses to PREFIX-K.json")
    parser.add_argument("--port", type=int, default=29512, help="DDP: the rendezvous port on this host")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help="mpigrad: save checkpoints to FILE (worker 0), and resume from it where it exists")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = StripesNet()
    dataset = Stripes(args.samples, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    resume = not args.ddp and args.checkpoint and os.path.exists(args.checkpoint)
    saved = torch.load(args.checkpoint, weights_only=False) if resume else None
    if saved is not None:
        model.load_state_dict(saved["model"])  # on every rank: the Session checks they agree

    if args.ddp:  # DDP
        from mpi4py import MPI
        import torch.distributed as dist

        rank, workers = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=workers)
        net, index = torch.nn.parallel.DistributedDataParallel(model), rank
        iterations = args.epochs * math.ceil(math.ceil(len(dataset) / workers) / BATCH)
    else:  # mpigrad
        import mpigrad
        from mpigrad.options import parse_assignments

        options = parse_assignments(args.set, "--set") or {}  # KEY=VALUE, the values parsed as numbers where they are
        session = mpigrad.Session(model, args.config, optimizer=optimizer, trace=args.trace, force=args.force,
                                  resume=saved and saved["mpigrad"], comm=comm, **options)
        net, index, workers = model, session.worker_index, session.workers
        session.iterations = iterations = args.epochs * math.ceil(math.ceil(len(dataset) / workers) / BATCH)
        if not session.is_worker:
            code = session.serve()  # rank 0 (and any shard servers): until the workers have finished
            if code:
                session.exit(code)  # stopped for a requeue: 75 on every rank, once worker 0 has saved
            return

    sampler = DistributedSampler(dataset, num_replicas=workers, rank=index, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=args.loader_workers)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=iterations)
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    start = 0 if args.ddp else session.start_iteration  # mpigrad: where a resumed run goes on
    losses, m = [], 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            m += 1
            if m <= start:
                continue  # a batch the run before the requeue trained on
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            if args.ddp:
                loss.backward()  # DDP: the all-reduce in backward's hooks
            else:
                done = session.backward(loss)  # mpigrad: backward, the decoded average of the workers' into .grad
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if args.ddp:
                continue
            if done.checkpoint and index == 0 and args.checkpoint:  # mpigrad: its state with the script's
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "mpigrad": session.state_dict()}
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            if done.stop:  # a walltime signal: requeue
                session.exit(mpigrad.EXIT_REQUEUE)
            if done.last and index == 0 and args.checkpoint and os.path.exists(args.checkpoint):
                os.remove(args.checkpoint)  # a finished run has nothing to resume
    if index == 0 and losses:
        print(f"worker 0: loss {losses[0]:.4f} -> {sum(losses[-8:]) / len(losses[-8:]):.4f} (mean of the last 8) "
              f"in {len(losses)} iterations", flush=True)
    if args.losses:
        os.makedirs(os.path.dirname(os.path.abspath(args.losses)), exist_ok=True)
        with open(f"{args.losses}-{index}.json", "w") as f:
            json.dump(losses, f)
    if args.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
