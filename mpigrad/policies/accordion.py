"""``accordion``: per-layer critical-regime detection (Agarwal et al., MLSys 2021), for bits.

Accordion switches each layer between two compression levels: low compression in a
*critical regime*, where the gradient changes fast, high compression otherwise. Our reading,
for a quantizer whose compression level is its bit width:

    every ``interval`` iterations, for each quantized layer l, take the norm N_l of the
    gradient accumulated (summed) over the last ``interval`` iterations and compare it with
    the previous check's N'_l: the layer is critical when |N'_l - N_l| / N'_l >= ``eta``
    (the paper's 0.5). A critical layer gets ``high_bits`` (low compression) for the next
    ``interval`` iterations, the others ``low_bits``. The first check has nothing to compare
    with: every layer counts as critical, as training starts in a critical regime, and until
    that check every layer gets ``high_bits``.

The gradients are the ones rank 0 observes (``Observation.gradients``): the average of the
workers' decoded gradients of the previous iteration, before the broadcast's quantization.
Accordion also enters a critical regime when the learning rate decays; mpigrad's learning
rate is constant, so that rule never fires and is left out.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import (Observation, Policy, PolicyError, check_bits_range, check_float, check_int,
                   layer_gradients, register_policy)


def is_critical(previous_norm: float, norm: float, eta: float) -> bool:
    """Accordion's test: |previous - current| / previous >= eta (True without a previous norm,
    or when the previous norm was 0 and the current is not)."""
    if math.isnan(previous_norm):
        return True
    if previous_norm == 0.0:
        return norm > 0.0
    return abs(previous_norm - norm) / previous_norm >= eta


@register_policy
class AccordionPolicy(Policy):
    """``high_bits`` for layers in a critical regime, ``low_bits`` for the rest, re-decided every ``interval``."""

    policy_id = "accordion"
    uses_gradients = True

    def __init__(self, *, eta: float = 0.5, interval: int = 20, low_bits: int = 2, high_bits: int = 8,
                 n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        self.eta = check_float(pid, "eta", eta, 0.0, low_open=True)
        self.interval = check_int(pid, "interval", interval, 1)
        self.low_bits, self.high_bits = check_bits_range(pid, low_bits, high_bits)
        self._bits: tuple[int, ...] = (self.high_bits,) * self.n_layers
        self._sums: list[np.ndarray | None] = [None] * self.n_layers
        self._count = 0                                      # gradients in the running sums
        self._previous = np.full(self.n_layers, np.nan)      # norms at the last check
        self._records: list[dict[str, Any]] = []

    def _config(self):
        return {"eta": self.eta, "interval": self.interval, "low_bits": self.low_bits,
                "high_bits": self.high_bits}

    def bits_range(self):
        return self.low_bits, self.high_bits

    def decide(self, obs: Observation) -> tuple[int, ...]:
        if not len(obs.gradients):
            return self._bits
        for layer, gradient in enumerate(layer_gradients(self.policy_id, obs, self.n_layers)):
            total = self._sums[layer]
            if total is None or total.shape != gradient.shape:
                if total is not None or self._count:
                    raise PolicyError(f"policy 'accordion': layer {layer} gradient changed length")
                total = self._sums[layer] = np.zeros(gradient.size, np.float64)
            total += gradient
        self._count += 1
        if self._count == self.interval:
            self._check(int(obs.iteration))
        return self._bits

    def _check(self, iteration: int) -> None:
        bits = []
        for layer, total in enumerate(self._sums):
            norm = float(np.sqrt(np.dot(total, total)))
            previous = float(self._previous[layer])
            critical = is_critical(previous, norm, self.eta)
            change = abs(previous - norm) / previous if previous > 0 else math.nan
            layer_bits = self.high_bits if critical else self.low_bits
            bits.append(layer_bits)
            self._records.append({"iteration": iteration, "layer": layer, "bits": layer_bits,
                                  "norm": norm, "previous_norm": previous, "change": change,
                                  "critical": critical})
            self._previous[layer] = norm
            total[:] = 0.0
        self._count = 0
        self._bits = tuple(bits)

    def record_columns(self):
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ()), "norm": ("f8", ()),
                "previous_norm": ("f8", ()), "change": ("f8", ()), "critical": ("?", ())}

    def drain_records(self):
        records, self._records = self._records, []
        return records

    def state_dict(self) -> dict[str, Any]:
        return {"bits": list(self._bits), "count": self._count, "previous": self._previous.copy(),
                "sums": [None if s is None else s.copy() for s in self._sums]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bits = tuple(int(b) for b in state["bits"])
        sums = state["sums"]
        if len(bits) != self.n_layers or len(sums) != self.n_layers \
                or not all(b in (self.low_bits, self.high_bits) for b in bits):
            raise PolicyError(f"policy 'accordion': checkpoint bits {bits} do not fit {self.n_layers} "
                              f"layers at {self.low_bits} or {self.high_bits} bits")
        self._bits = bits
        self._count = int(state["count"])
        self._previous = np.array(state["previous"], dtype=np.float64)
        self._sums = [None if s is None else np.array(s, dtype=np.float64) for s in sums]
        self._records = []
