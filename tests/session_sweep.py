"""A world scenario (``tests/world_server.py``'s ``main(comm, folder)``) for
tests/test_session_world.py: three runs of a script's own loop with ``mpigrad.Session`` in
the same processes, one after another on the scenario's communicator: A, B (another codec,
policy, error feedback and server layout), A again, each writing FOLDER/{a1,b,a2}.h5."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpigrad

#: Deterministic (the simulated clock on a fixed compute time): two runs of A agree bit for bit.
COMMON = dict(iterations=6, net_mode="virtual", compute_time=0.02, cost_model="none", progress_every=0,
              checksum_every=3, timeout=60.0)
RUNS = {
    "a1": dict(policy="fixed", bits=2, seed=21),
    "b": dict(codec="qsgd", policy="adaptive", bits=4, error_feedback="residual", servers="colocated", seed=22),
    "a2": dict(policy="fixed", bits=2, seed=21),
}


def one_run(comm, trace: str, options: dict) -> None:
    with torch.random.fork_rng():  # the script's own draws: the model's weights, its batches
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 600), torch.nn.ReLU(), torch.nn.Linear(600, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        session = mpigrad.Session(model, comm=comm, trace=trace, optimizer=optimizer, **COMMON, **options)
        if not session.is_worker:
            session.serve()
            session.close()
            return
        g = torch.Generator().manual_seed(10 + session.worker_index)
        with session:
            for _ in range(session.iterations):
                x, y = torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                session.exchange(loss)
                optimizer.step()


def main(comm, folder: str) -> int:
    for name, options in RUNS.items():
        one_run(comm, f"{folder}/{name}.h5", options)
    return 0
