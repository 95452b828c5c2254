"""``progress``: per-layer bits that maximise expected progress per second (mpigrad's own controller).

Written against the public policy API only (``Policy``, ``Observation``, the option checks of
``mpigrad.policies.base``, the error measurement of ``adaptive``, the cost model of
``mpigrad.costmodel``), as a user would write a policy of their own (docs/extending.rst); it
is registered as ``progress`` but would work unchanged as ``--policy
mpigrad.policies.progress:ProgressPolicy``.

The model. For quantized layer l (n_l elements) at width b:

- bytes: s(l, b) = the codec's buffer for the layer at b bits (``max_encoded_size``);
- network time: t_net(l, b) = k x s(l, b) x c, where c is the network's measured
  milliseconds per byte (``last_comm_ms / last_bytes`` of every iteration, an exponential
  mean with weight ``smoothing``) and k the copies of a layer's buffer an iteration puts on
  the network (P up and P down for a star with one server). k is measured from the bytes:
  bytes per iteration = k x Q(bits) + F with Q(bits) = sum_l s(l, b_l) and F what the widths
  do not change (float32 layers, losses, control); two iterations at widths of different Q
  give k = (bytes_1 - bytes_2) / (Q_1 - Q_2). Until the run has measured two, k = bytes / Q
  (F taken as 0: an upper bound, which overstates what wide layers cost);
- local time: t_cpu(l, b) = 2 encodes + 2 decodes + (P - 1) decode-adds of n_l elements at
  b bits by the cost model (``cost_model``: the package's measured model by default, or a
  file of ``mpigrad bench calibrate``; ``none`` leaves it out), the one-server star's count
  (``mpigrad.costmodel.LocalWork``) with P = k / 2; a codec the model lacks costs 0;
- t(l, b) = t_net(l, b) + t_cpu(l, b);
- optimisation cost: the relative quantization variance v(l, b) = ||Q_b(g_l) - g_l||^2 /
  ||g||^2, g the workers' averaged gradient of the last iteration as rank 0 sees it (before
  re-quantization), measured with the run's own codec at b bits on a strided subsample of
  ``sample_size`` elements (as ``adaptive`` and ``lgreco`` do), the sample's squared error
  and energy each scaled by n_l / sample, ||g||^2 summed over every quantized layer.

The QSGD-style bound says the iterations to a target grow like (1 + sum_l v(l, b_l)), so the
expected time to the target is proportional to

    J(b) = (1 + ``variance_weight`` x sum_l v(l, b_l)) x (T_fixed + sum_l t(l, b_l))

with T_fixed the iteration's time that the widths do not change, measured: the exponential
mean of ``last_iteration_ms - last_comm_ms`` (compute, the policy, the codecs) less the
codecs' modelled share at the widths in force, plus F x c. The policy chooses b minimising
J over [min_bits, max_bits] per layer: exactly, by enumerating every combination, when there
are at most ``exhaustive_limit`` of them; otherwise from the best of the Lagrangian
solutions (for every lambda at which a layer's choice changes, each layer minimising
lambda x v(l, b) + t(l, b): the supported points of the (variance, time) front) improved by
coordinate descent (one layer's width changed at a time while J falls), which can miss an
optimum inside the front's hull. Every layer starts at ``max_bits`` (the widest width, before
anything is measured); the first decision comes at the first iteration with both a gradient
and a measurement, then every ``interval`` iterations. Each decision logs one trace row per
layer (``drain_records``): the chosen bits, v and t at every width, k, c, T_fixed and J.

What it reads is what a running system measures: the bytes and the communication time of
its own last iteration, the iteration's duration, the gradient rank 0 already has, and the
cost model measured by ``mpigrad bench calibrate`` on a machine. It reads no network
schedule and no configured bandwidth (``tests/test_progress_policy.py`` checks that).
Its own decision costs rank 0 about 0.15-0.3 ms per iteration at the paper CNN's size
(``mpigrad bench calibrate --policies progress``: 7 encode/decode pairs of ``sample_size``
elements per layer every ``interval`` iterations), charged on the simulated clock by the
package's cost model like every built-in policy's.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..costmodel import CostModel, CostModelError, resolve
from .adaptive import Workspace, quantization_error, strided_sample
from .base import (Observation, Policy, PolicyError, bits_codec, check_bits_range, check_float, check_int,
                   layer_gradients, register_policy)

__all__ = ["ProgressPolicy", "choose_widths", "objective"]


def objective(variance: np.ndarray, seconds: np.ndarray, t_fixed: float, picks, weight: float = 1.0) -> float:
    """J = (1 + weight x sum_l variance[l, k_l]) x (t_fixed + sum_l seconds[l, k_l])."""
    rows = np.arange(len(picks))
    picks = np.asarray(picks)
    return (1.0 + weight * float(variance[rows, picks].sum())) * (t_fixed + float(seconds[rows, picks].sum()))


def choose_widths(variance: np.ndarray, seconds: np.ndarray, t_fixed: float, weight: float = 1.0,
                  exhaustive_limit: int = 4096) -> list[int]:
    """Column per row (layer) of ``variance``/``seconds`` (layers x candidates, both >= 0)
    minimising ``objective``; ties go to the later column (the wider width). Exact when
    candidates ** layers <= ``exhaustive_limit``; otherwise the best Lagrangian solution
    improved by coordinate descent (see the module docstring)."""
    variance = weight * np.asarray(variance, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    n_layers, n_choices = variance.shape
    if n_choices ** n_layers <= exhaustive_limit:
        combos = np.array(list(itertools.product(range(n_choices), repeat=n_layers)), dtype=np.int64)
        rows = np.arange(n_layers)
        values = (1.0 + variance[rows, combos].sum(axis=1)) * (t_fixed + seconds[rows, combos].sum(axis=1))
        best = np.flatnonzero(values <= values.min() * (1 + 1e-12))
        return [int(k) for k in combos[best[-1]]]   # itertools.product order: the last is the widest

    def value(picks):
        return objective(variance, seconds, t_fixed, picks)

    def widest_argmin(scores: np.ndarray) -> list[int]:
        return [int(n_choices - 1 - np.argmin(row[::-1])) for row in scores]

    # Every lambda > 0 at which some layer's argmin of lambda * v + t can change; lambda = 0
    # (least time) and lambda -> infinity (least variance) as the ends.
    lambdas = set()
    for row_v, row_t in zip(variance, seconds):
        for i, j in itertools.combinations(range(n_choices), 2):
            if row_v[i] != row_v[j]:
                lam = (row_t[j] - row_t[i]) / (row_v[i] - row_v[j])
                if lam > 0:
                    lambdas.add(float(lam))
    candidates = [widest_argmin(seconds), widest_argmin(variance)]
    candidates += [widest_argmin(lam * variance + seconds) for lam in sorted(lambdas)]
    picks = min(candidates, key=value)
    current = value(picks)
    improved = True
    while improved:
        improved = False
        for layer in range(n_layers):
            for k in range(n_choices):
                trial = picks[:layer] + [k] + picks[layer + 1:]
                v = value(trial)
                if v < current * (1 - 1e-12):
                    picks, current, improved = trial, v, True
    return picks


@register_policy
class ProgressPolicy(Policy):
    """Per-layer bits minimising (1 + sum of relative quantization variances) x iteration time."""

    policy_id = "progress"
    uses_gradients = True   # the averaged gradient and the codec, for the variances
    reads_clock = True      # the measured communication time and iteration duration

    def __init__(self, *, interval: int = 10, min_bits: int = 2, max_bits: int = 8, sample_size: int = 65536,
                 smoothing: float = 0.3, variance_weight: float = 1.0, cost_model: str = "default",
                 exhaustive_limit: int = 4096, n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        # Hyperparameters.
        self.interval = check_int(pid, "interval", interval, 1)
        self.min_bits, self.max_bits = check_bits_range(pid, min_bits, max_bits)
        self.sample_size = check_int(pid, "sample_size", sample_size, 0)
        if 0 < self.sample_size < 16:
            raise PolicyError(f"policy {pid!r}: sample_size must be 0 (whole layers) or >= 16, got {sample_size!r}")
        self.smoothing = check_float(pid, "smoothing", smoothing, 0.0, 1.0, low_open=True)
        self.variance_weight = check_float(pid, "variance_weight", variance_weight, 0.0)
        if not isinstance(cost_model, str) or not cost_model:
            raise PolicyError(f"policy {pid!r}: cost_model must be 'default', 'none' or a file, got {cost_model!r}")
        try:
            self._model: CostModel | None = resolve(cost_model)
        except CostModelError as exc:
            raise PolicyError(f"policy {pid!r}: {exc}") from None
        self.cost_model = cost_model
        self.exhaustive_limit = check_int(pid, "exhaustive_limit", exhaustive_limit, 1)
        self._workspace = Workspace()
        # State.
        self._next_iteration = 0
        self._next_decision = 0
        self._decisions = 0
        self._bits = (self.max_bits,) * self.n_layers
        self._ms_per_byte = math.nan        # exponential mean of last_comm_ms / last_bytes
        self._local_ms = math.nan           # exponential mean of last_iteration_ms - last_comm_ms
        self._last_bytes = 0                # bytes of the last measured iteration
        self._bytes_at: dict[int, int] = {}  # Q (quantized bytes of a width choice) -> bytes measured at it
        self._sizes: np.ndarray | None = None  # layers x candidates: s(l, b), from the first gradient
        self._records: list[dict[str, Any]] = []

    def _config(self):
        return {"interval": self.interval, "min_bits": self.min_bits, "max_bits": self.max_bits,
                "sample_size": self.sample_size, "smoothing": self.smoothing,
                "variance_weight": self.variance_weight, "cost_model": self.cost_model,
                "exhaustive_limit": self.exhaustive_limit}

    def bits_range(self):
        return self.min_bits, self.max_bits

    # ---- decisions ----------------------------------------------------------------
    def decide(self, obs: Observation) -> tuple[int, ...]:
        m = int(obs.iteration)
        if m != self._next_iteration:
            raise PolicyError(f"policy 'progress' expected iteration {self._next_iteration}, got {m} "
                              f"(decide() must be called once per iteration, in order)")
        self._next_iteration = m + 1
        if m > 0 and obs.last_bytes > 0:
            self._measure(obs)
        if len(obs.gradients) and m >= self._next_decision and not math.isnan(self._ms_per_byte):
            self._bits = self._choose(obs)
            self._next_decision = m + self.interval
            self._decisions += 1
        return self._bits

    def _measure(self, obs: Observation) -> None:
        """Fold iteration m-1's measurements (at ``self._bits``) into the means."""
        w = self.smoothing
        cost = float(obs.last_comm_ms) / int(obs.last_bytes)
        local = max(0.0, float(obs.last_iteration_ms) - float(obs.last_comm_ms))
        first = math.isnan(self._ms_per_byte)
        self._ms_per_byte = cost if first else (1 - w) * self._ms_per_byte + w * cost
        self._local_ms = local if first else (1 - w) * self._local_ms + w * local
        self._last_bytes = int(obs.last_bytes)
        if self._sizes is not None:
            self._bytes_at[self._quantized_bytes(self._bits)] = self._last_bytes
            while len(self._bytes_at) > 2:   # the two most recent distinct widths
                del self._bytes_at[next(iter(self._bytes_at))]

    def _quantized_bytes(self, bits) -> int:
        return int(sum(self._sizes[layer, b - self.min_bits] for layer, b in enumerate(bits)))

    def _copies(self) -> float:
        """k: copies of a quantized layer's buffer per iteration (module docstring)."""
        upper = self._last_bytes / self._quantized_bytes(self._bits)
        if len(self._bytes_at) == 2:
            (q1, b1), (q2, b2) = self._bytes_at.items()
            return min(upper, max(0.0, (b1 - b2) / (q1 - q2)))
        return upper

    def _choose(self, obs: Observation) -> tuple[int, ...]:
        codec = bits_codec(self.policy_id, obs)
        gradients = layer_gradients(self.policy_id, obs, self.n_layers)
        widths = range(self.min_bits, self.max_bits + 1)
        codecs = []
        for bits in widths:
            try:
                codecs.append(codec.with_bits(bits))
            except ValueError as exc:
                raise PolicyError(f"policy 'progress': {bits} bits: {exc}") from None
        if self._sizes is None:
            self._sizes = np.array([[c.max_encoded_size(g.size) for c in codecs] for g in gradients], np.float64)
            self._bytes_at = {self._quantized_bytes(self._bits): self._last_bytes}
        squared = np.zeros((self.n_layers, len(codecs)))
        energy = 0.0
        for layer, gradient in enumerate(gradients):
            sample = strided_sample(gradient, self.sample_size, self._decisions,
                                    self._workspace.sample(self.sample_size or gradient.size))
            # The sample's squared error and energy, each scaled to the layer (n_l / sample).
            energy += float(np.dot(sample, sample)) / max(sample.size, 1) * gradient.size
            for k, at_bits in enumerate(codecs):
                squared[layer, k] = quantization_error(at_bits, sample, "mse", self._workspace) * gradient.size
        variance = squared / energy if energy > 0.0 else np.zeros_like(squared)
        copies = self._copies()
        cpu = self._cpu_ms(getattr(codec, "codec_id", ""), [g.size for g in gradients], copies)
        seconds = copies * self._sizes * self._ms_per_byte + cpu
        rows = np.arange(self.n_layers)
        now = np.array([b - self.min_bits for b in self._bits])
        other_bytes = max(0.0, self._last_bytes - copies * self._quantized_bytes(self._bits))
        t_fixed = max(0.0, self._local_ms - float(cpu[rows, now].sum())) + other_bytes * self._ms_per_byte
        picks = choose_widths(variance, seconds, t_fixed, self.variance_weight, self.exhaustive_limit)
        value = objective(variance, seconds, t_fixed, picks, self.variance_weight)
        chosen = tuple(self.min_bits + k for k in picks)
        for layer, bits in enumerate(chosen):
            self._records.append({"iteration": int(obs.iteration), "layer": layer, "bits": bits,
                                  "variance": variance[layer].copy(), "time_ms": seconds[layer].copy(),
                                  "copies": copies, "ms_per_byte": self._ms_per_byte,
                                  "t_fixed_ms": t_fixed, "objective": value})
        return chosen

    def _cpu_ms(self, codec_id: str, sizes: list[int], copies: float) -> np.ndarray:
        """t_cpu(l, b) in ms, layers x candidates (zeros without a model or for its codec)."""
        cpu = np.zeros((self.n_layers, self.max_bits - self.min_bits + 1))
        if self._model is None or codec_id not in self._model.codecs:
            return cpu
        workers = max(1.0, round(copies / 2))
        for layer, n in enumerate(sizes):
            for k, bits in enumerate(range(self.min_bits, self.max_bits + 1)):
                seconds = self._model.seconds
                cpu[layer, k] = 1e3 * (2 * seconds(codec_id, bits, "encode", n) + 2 * seconds(codec_id, bits, "decode", n)
                                       + (workers - 1) * seconds(codec_id, bits, "accumulate", n))
        return cpu

    def record_columns(self):
        levels = self.max_bits - self.min_bits + 1
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ()),
                "variance": ("f8", (levels,)), "time_ms": ("f8", (levels,)), "copies": ("f8", ()),
                "ms_per_byte": ("f8", ()), "t_fixed_ms": ("f8", ()), "objective": ("f8", ())}

    def drain_records(self):
        records, self._records = self._records, []
        return records

    # ---- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.get_config(), "n_layers": self.n_layers, "next_iteration": self._next_iteration,
                "next_decision": self._next_decision, "decisions": self._decisions, "bits": list(self._bits),
                "ms_per_byte": self._ms_per_byte, "local_ms": self._local_ms, "last_bytes": self._last_bytes,
                "bytes_at": [[q, b] for q, b in self._bytes_at.items()],
                "sizes": None if self._sizes is None else self._sizes.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config") != self.get_config() or state.get("n_layers") != self.n_layers:
            raise PolicyError(f"policy 'progress': checkpoint was written with config {state.get('config')} "
                              f"and {state.get('n_layers')} layers, this run has {self.get_config()} "
                              f"and {self.n_layers}")
        bits = tuple(int(b) for b in state["bits"])
        if len(bits) != self.n_layers or not all(self.min_bits <= b <= self.max_bits for b in bits):
            raise PolicyError(f"policy 'progress': checkpoint bits {bits} do not fit {self.n_layers} layers "
                              f"in [{self.min_bits}, {self.max_bits}]")
        self._next_iteration = int(state["next_iteration"])
        self._next_decision = int(state["next_decision"])
        self._decisions = int(state["decisions"])
        self._bits = bits
        self._ms_per_byte = float(state["ms_per_byte"])
        self._local_ms = float(state["local_ms"])
        self._last_bytes = int(state["last_bytes"])
        self._bytes_at = {int(q): int(b) for q, b in state["bytes_at"]}
        self._sizes = None if state["sizes"] is None else np.array(state["sizes"], np.float64)
        self._records = []
