"""Run under mpiexec: every rank checks BufferSync's result on a ResNet-20's BatchNorm buffers.

Arguments: one or more numbers of servers S (ranks 0..S-1; the others are workers), each
checked on a fresh model and a channel over its own duplicate of the world communicator.
Each rank prints ``servers S: rank R: ok`` (or ``MISMATCH``) per S and exits 1 if any failed.
In the test suite it runs in the worker's world as a program (``main(argv, comm=)``)."""

import sys

import numpy as np
import torch
from mpi4py import MPI

from mpigrad.models import build_model
from mpigrad.runtime.exchange.buffers import BufferSync
from mpigrad.runtime.wire.mpi import MpiChannel


def check(comm, servers: int) -> bool:
    """BufferSync with ``servers`` servers leaves every rank with the workers' average."""
    channel = MpiChannel(comm, servers, timeout=60)
    rank = comm.Get_rank()
    model = build_model("resnet20", input_shape=(1, 8, 8), num_classes=10, seed=0)
    bn = model.stages[1][0].bn2
    with torch.no_grad():
        if rank:  # each rank's statistics differ (a shard server's too); rank 0 keeps the initial ones
            for b in model.buffers():
                b.fill_(7 if not b.is_floating_point() else 0)
            bn.running_mean.copy_(torch.arange(32.0) * rank)
            bn.running_var.fill_(np.float32(0.1) * rank)
    sync = BufferSync(model, channel)
    assert sync.size == 1395, sync.size
    sync.run(0)
    ranks = np.arange(servers, comm.Get_size())  # the workers: the only ranks averaged
    expected_var = np.float32(np.mean(np.float32(0.1) * ranks.astype(np.float64)))
    ok = (torch.equal(bn.running_mean, torch.arange(32.0) * float(ranks.mean()))
          and bool((bn.running_var == torch.tensor(expected_var)).all())
          and all(int(m.num_batches_tracked) == 7 for m in model.modules() if hasattr(m, "num_batches_tracked")))
    plain = BufferSync(build_model("resnet20", input_shape=(1, 8, 8), num_classes=10, norm="group"), channel)
    plain.run(0)  # no buffers: returns at once on every rank, nothing sent
    crcs = comm.gather(b"".join(b.numpy().tobytes() for b in model.buffers()), root=0)
    if rank == 0:
        ok = ok and len(set(crcs)) == 1
    return ok and plain.size == 0


def main(argv: list[str] | None = None, comm=None) -> int:
    """Each S of ``argv`` checked on ``comm`` (default: the world; a test world's scenario
    communicator, where it runs as a program); 0 where every check passed, else 1."""
    comm = MPI.COMM_WORLD if comm is None else comm
    results = []
    for servers in map(int, sys.argv[1:] if argv is None else argv):
        own = comm.Dup()
        try:
            ok = check(own, servers)
        finally:
            own.Free()
        print(f"servers {servers}: rank {comm.Get_rank()}: {'ok' if ok else 'MISMATCH'}", flush=True)
        results.append(ok)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
