"""``aimd``: bandwidth-aware AIMD of the bit width, the heuristic of the NetSenseML kind.

The rule (docs/policies.rst has the defaults and where they come from):

    The policy starts at ``max_bits``. Every iteration m >= 1 it receives what iteration
    m-1 measured: its communication time and the bytes it put on the network
    (``Observation.last_comm_ms``, ``last_bytes``). Once ``window`` measurements taken at
    the bits in force are in hand it evaluates, and again at every iteration after that
    while the bits stay:

    - T = the mean communication time per iteration over the window;
    - c = the window's milliseconds per byte (sum of times / sum of bytes: the inverse of
      the measured bandwidth); c_best = the lowest c of any window so far (the fastest
      network the run has measured);
    - the budget T* = c_best x the bytes of an iteration at ``max_bits`` (the first
      window's mean): what communication costs at full width on the best network seen;
    - ratio = T / T*, and next_ratio = ratio x B_next / B, the ratio the next width would
      have: B the window's mean bytes per iteration, B_next the bytes of bits + ``increase``
      interpolated linearly between (bits, B) and (max_bits, B_full).

    Multiplicative decrease: ratio > 1 + ``band`` (communication has grown beyond the band)
    gives bits = max(min_bits, floor(bits x ``decrease``)). Additive increase: when the
    next width would stay within half the band, next_ratio <= 1 + ``band`` / 2,
    bits = min(max_bits, bits + ``increase``). Otherwise the bits stay. After a change the
    window starts again empty, so the next evaluation sees the new width only.

Hysteresis comes twice: the gap between "the next width fits" (<= 1 + band / 2) and "over
budget" (> 1 + band), and the fresh window after every change. One width for every layer, as
the public NetSenseML code (asu-gkg/NetSenseML) keeps one compression ratio for all buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any

from .base import (Observation, Policy, PolicyError, check_bits_range, check_float, check_int,
                   register_policy)


def aimd_step(bits: int, ratio: float, next_ratio: float, *, band: float, decrease: float, increase: int,
              min_bits: int, max_bits: int) -> int:
    """The bits after one evaluation: ``ratio`` = communication time / budget now,
    ``next_ratio`` = the same predicted at bits + increase."""
    if ratio > 1.0 + band:
        return max(min_bits, math.floor(bits * decrease))
    if bits < max_bits and next_ratio <= 1.0 + band / 2:
        return min(max_bits, bits + increase)
    return bits


def next_bytes(bits: int, nbytes: float, full_bytes: float, step: int, max_bits: int) -> float:
    """Bytes per iteration at ``bits + step`` (at most max_bits), interpolated linearly
    between ``nbytes`` measured at ``bits`` and ``full_bytes`` measured at ``max_bits``."""
    if bits >= max_bits:
        return nbytes
    return nbytes + (full_bytes - nbytes) * min(step, max_bits - bits) / (max_bits - bits)


@register_policy
class AIMDPolicy(Policy):
    """Multiplicative decrease of the bits while measured communication time per iteration
    exceeds its budget by more than ``band``; additive increase while the next width fits."""

    policy_id = "aimd"
    reads_clock = True  # it reads the measured communication time of each iteration

    def __init__(self, *, window: int = 10, band: float = 0.25, decrease: float = 0.5, increase: int = 1,
                 min_bits: int = 2, max_bits: int = 8, n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        self.window = check_int(pid, "window", window, 1)
        self.band = check_float(pid, "band", band, 0.0, low_open=True)
        if isinstance(decrease, bool) or not isinstance(decrease, Real) or not 0.0 < decrease < 1.0:
            raise PolicyError(f"policy {pid!r}: decrease must be a number > 0.0 and < 1.0, got {decrease!r}")
        self.decrease = float(decrease)
        self.min_bits, self.max_bits = check_bits_range(pid, min_bits, max_bits)
        if self.min_bits == self.max_bits:
            raise PolicyError(f"policy {pid!r}: min_bits = max_bits = {self.min_bits} leaves nothing to "
                              f"adapt; use --policy fixed --bits {self.min_bits}")
        self.increase = check_int(pid, "increase", increase, 1, self.max_bits - self.min_bits)
        # State.
        self._next_iteration = 0
        self._bits = self.max_bits
        self._comm_ms: list[float] = []     # measurements at the bits in force, oldest first
        self._bytes: list[int] = []
        self._full_bytes = math.nan         # mean bytes per iteration at max_bits (first window)
        self._best_cost = math.inf          # lowest ms per byte of any window
        self._records: list[dict[str, Any]] = []

    def _config(self):
        return {"window": self.window, "band": self.band, "decrease": self.decrease,
                "increase": self.increase, "min_bits": self.min_bits, "max_bits": self.max_bits}

    def bits_range(self):
        return self.min_bits, self.max_bits

    # ---- decisions ----------------------------------------------------------------
    def decide(self, obs: Observation) -> tuple[int, ...]:
        m = int(obs.iteration)
        if m != self._next_iteration:
            raise PolicyError(f"policy 'aimd' expected iteration {self._next_iteration}, got {m} "
                              f"(decide() must be called once per iteration, in order)")
        if m > 0 and obs.last_bytes > 0:  # iteration m-1, at the bits in force since the last change
            self._comm_ms.append(float(obs.last_comm_ms))
            self._bytes.append(int(obs.last_bytes))
            del self._comm_ms[:-self.window], self._bytes[:-self.window]
            if len(self._comm_ms) == self.window:
                self._evaluate(m)
        self._next_iteration = m + 1
        return (self._bits,) * self.n_layers

    def _evaluate(self, m: int) -> None:
        comm_ms, nbytes = sum(self._comm_ms), sum(self._bytes)
        if math.isnan(self._full_bytes):  # the first window: the policy starts at max_bits
            self._full_bytes = nbytes / self.window
        if comm_ms > 0.0:
            self._best_cost = min(self._best_cost, comm_ms / nbytes)
        budget = self._best_cost * self._full_bytes
        mean_ms, mean_bytes = comm_ms / self.window, nbytes / self.window
        ratio = mean_ms / budget if math.isfinite(budget) and budget > 0.0 else 0.0
        grown = next_bytes(self._bits, mean_bytes, self._full_bytes, self.increase, self.max_bits)
        bits = aimd_step(self._bits, ratio, ratio * grown / mean_bytes, band=self.band, decrease=self.decrease,
                         increase=self.increase, min_bits=self.min_bits, max_bits=self.max_bits)
        if bits != self._bits:
            self._records.append({"iteration": m, "layer": -1, "bits": bits, "previous_bits": self._bits,
                                  "comm_ms": mean_ms, "budget_ms": budget, "ratio": ratio,
                                  "bandwidth": nbytes / comm_ms / 1e3 if comm_ms > 0.0 else math.inf})
            self._bits = bits
            self._comm_ms, self._bytes = [], []

    def record_columns(self):
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ()),
                "previous_bits": ("i4", ()), "comm_ms": ("f8", ()), "budget_ms": ("f8", ()),
                "ratio": ("f8", ()), "bandwidth": ("f8", ())}

    def drain_records(self):
        records, self._records = self._records, []
        return records

    # ---- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.get_config(), "n_layers": self.n_layers, "next_iteration": self._next_iteration,
                "bits": self._bits, "comm_ms": list(self._comm_ms), "bytes": list(self._bytes),
                "full_bytes": self._full_bytes, "best_cost": self._best_cost}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config") != self.get_config() or state.get("n_layers") != self.n_layers:
            raise PolicyError(f"policy 'aimd': checkpoint was written with config {state.get('config')} "
                              f"and {state.get('n_layers')} layers, this run has {self.get_config()} "
                              f"and {self.n_layers}")
        bits = int(state["bits"])
        comm_ms: Sequence[float] = state["comm_ms"]
        if not self.min_bits <= bits <= self.max_bits or len(comm_ms) != len(state["bytes"]) \
                or len(comm_ms) > self.window:
            raise PolicyError(f"policy 'aimd': checkpoint state (bits {bits}, {len(comm_ms)} measurements) "
                              f"does not fit [{self.min_bits}, {self.max_bits}] and window {self.window}")
        self._next_iteration = int(state["next_iteration"])
        self._bits = bits
        self._comm_ms = [float(v) for v in comm_ms]
        self._bytes = [int(v) for v in state["bytes"]]
        self._full_bytes = float(state["full_bytes"])
        self._best_cost = float(state["best_cost"])
        self._records = []
