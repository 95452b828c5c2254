"""A bit policy in one file: more bits when the loss stops falling.

Starts every quantized layer at ``initial_bits``; whenever the mean loss of the last
``window`` iterations has not fallen below the best such mean for ``patience`` iterations,
adds one bit (up to ``max_bits``) and starts counting again. It reads only the loss rank 0
already has, so it costs nothing on the wire. From the repository root::

    PYTHONPATH=examples/plugins mpiexec -n 3 python -m mpi4py -m mpigrad train \\
        --policy plateau:PlateauBits --policy-opt patience=20 --trace runs/plateau.h5

The contract (docs/extending.rst): subclass ``Policy``, set ``policy_id``, take the
hyperparameters as keyword-only ``__init__`` arguments before ``n_layers`` and ``seed``,
implement ``_config``, ``bits_range`` and ``decide``; keep what a resumed run needs in
``state_dict``; log rows for the trace through ``record_columns`` and ``drain_records``.
"""

from __future__ import annotations

from collections import deque

from mpigrad.policies import Observation, Policy, PolicyError
from mpigrad.policies.base import check_int


class PlateauBits(Policy):
    policy_id = "plateau"

    def __init__(self, *, initial_bits: int = 2, max_bits: int = 8, window: int = 10, patience: int = 30,
                 n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        self.initial_bits = check_int(self.policy_id, "initial_bits", initial_bits, 1, 32)
        self.max_bits = check_int(self.policy_id, "max_bits", max_bits, self.initial_bits, 32)
        self.window = check_int(self.policy_id, "window", window, 1)
        self.patience = check_int(self.policy_id, "patience", patience, 1)
        self.bits = self.initial_bits
        self.best = float("inf")
        self.since_best = 0
        self.losses: deque[float] = deque(maxlen=self.window)
        self.records: list[dict] = []

    def _config(self):
        return {"initial_bits": self.initial_bits, "max_bits": self.max_bits, "window": self.window,
                "patience": self.patience}

    def bits_range(self):
        return self.initial_bits, self.max_bits

    def decide(self, obs: Observation) -> tuple[int, ...]:
        self.losses.append(obs.loss)
        if len(self.losses) == self.window:
            mean = sum(self.losses) / self.window
            if mean < self.best:
                self.best, self.since_best = mean, 0
            else:
                self.since_best += 1
            if self.since_best >= self.patience and self.bits < self.max_bits:
                self.bits += 1
                self.since_best = 0
                self.records.append({"iteration": obs.iteration, "layer": -1, "bits": self.bits})
        return (self.bits,) * self.n_layers

    def drain_records(self):
        records, self.records = self.records, []
        return records

    def state_dict(self):
        return {"bits": self.bits, "best": self.best, "since_best": self.since_best, "losses": list(self.losses)}

    def load_state_dict(self, state):
        if not self.initial_bits <= state["bits"] <= self.max_bits:
            raise PolicyError(f"policy 'plateau': checkpoint bits {state['bits']} outside "
                              f"[{self.initial_bits}, {self.max_bits}]")
        self.bits, self.best, self.since_best = int(state["bits"]), float(state["best"]), int(state["since_best"])
        self.losses = deque(state["losses"], maxlen=self.window)
