"""Misuses of mpigrad.Session, one per ``--case``, for tests/test_api_mpi.py (run under
``mpiexec -n 3 python -m mpi4py tests/api_misuse.py --case CASE --trace PATH``): a small
model, random batches, torch's SGD, fp32 on one server and two workers."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import mpigrad

CASES = ("models-differ", "foreign-optimizer", "no-backward", "leaves-early", "same-batches", "raises",
         "iterations-differ", "exchanges-twice", "no-serve", "serve-late")
#: The cases where rank 0 never serves: a short timeout, so the workers' wait ends soon.
NO_SERVE = ("no-serve", "serve-late")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--trace", required=True)
    args = parser.parse_args()
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    torch.manual_seed(1 if args.case == "models-differ" and rank == 2 else 0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 600), torch.nn.ReLU(), torch.nn.Linear(600, 3))
    other = torch.nn.Linear(20, 3)
    optimizer = torch.optim.SGD(other.parameters() if args.case == "foreign-optimizer" and rank == 1
                                else model.parameters(), lr=0.05)
    session = mpigrad.Session(model, codec="fp32", policy="fixed", iterations=4, trace=args.trace,
                              optimizer=optimizer, progress_every=0, timeout=10.0 if args.case in NO_SERVE else 60.0)
    if args.case == "iterations-differ" and rank == 2:
        session.iterations = 3
    if not session.is_worker:
        if args.case == "no-serve":
            return  # the Session says so at exit, and ends every rank
        if args.case == "serve-late":
            time.sleep(120)  # longer than the workers' timeout: they give up first, naming serve()
        session.serve()
        print(f"rank {rank}: served", flush=True)
        return
    g = torch.Generator().manual_seed(0 if args.case == "same-batches" else 10 + session.worker_index)
    with session:
        for m in range(session.iterations):
            if args.case == "leaves-early" and rank == 2 and m == 2:
                break
            if args.case == "raises" and rank == 1 and m == 1:
                raise ValueError("the script's own bug")
            x, y = torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if not (args.case == "no-backward" and rank == 2 and m == 1):
                loss.backward()
            session.exchange(loss)
            if args.case == "exchanges-twice" and rank == 2 and m == 2:
                session.exchange(loss)  # the same gradients again
            optimizer.step()
    if args.case == "same-batches":
        try:
            session.exchange(loss)
        except mpigrad.UsageError as exc:
            print(f"rank {rank}: {exc}", flush=True)


if __name__ == "__main__":
    main()
