"""``lgreco``: per-layer bits by dynamic programming (Markov et al., MLSys 2024), for bits.

L-GreCo periodically chooses each layer's compression setting so that the total compressed
size is smallest while the total compression error stays at most that of a uniform
reference setting. Our reading, for a quantizer whose setting is its bit width:

    every ``interval`` iterations (and at the first iteration that has a gradient), for each
    quantized layer l and each candidate b in [min_bits, max_bits], measure
      e(l, b) = ||Q_b(g_l) - g_l||^2   (squared error, summed over the layer) and
      s(l, b) = bytes of the codec's buffer for the whole layer at b bits,
    with Q_b the run's codec at b bits and g_l the gradient rank 0 observes (the average of
    the workers' decoded gradients of the previous iteration, before the broadcast's
    quantization). Then choose b_l minimising sum_l s(l, b_l) subject to
    sum_l e(l, b_l) <= E_ref = sum_l e(l, reference_bits), by dynamic programming over the
    layers with errors in units of E_ref / ``error_levels`` rounded up (``assign_bits``).
    Until the first decision every layer gets ``reference_bits``.

Rounding errors up and giving the DP a capacity of sum_l ceil(e(l, ref) / unit) keeps the
reference always feasible; the chosen total error exceeds E_ref by at most
n_layers * E_ref / error_levels. With ``sample_size`` > 0 a layer's error is measured on a
strided subsample (as ``adaptive`` does) and scaled by len(layer) / len(sample). The paper
measures errors on the error-feedback-accumulated gradient of the workers; rank 0 sees the
average, which is what mpigrad's runs without error feedback quantize.

With ``--codec powersgd`` and its menus (``ranks``/``widths``) the candidates are the menu's
settings instead of [min_bits, max_bits] (``setup_codec``; ``Observation.settings``): a rank
r (the layer as rank-r factors) or a width b (the whole layer ``uniform`` at b bits), the
decision one setting code per layer. e(l, s) is the workers' mean squared error of their
error-feedback-accumulated M_i at setting s, as the codec would compute it: rank r one power
iteration from the current Q (float32 factors; ``factor_bits`` rounding not counted), width
b uniform's rounding; s(l, s) the bytes on the wire, one direction (P and Q for a rank,
the whole layer for a width); the reference, and every layer's setting until the first
decision, is the codec's ``rank``. ``reference_bits``, ``min_bits``, ``max_bits`` and
``sample_size`` do not apply then. The first decision is at the first iteration after
``start`` (the workers measure in the iteration before a decision only).
"""

from __future__ import annotations

import math

import numpy as np

from .adaptive import Workspace, quantization_error, strided_sample
from .base import (Observation, PeriodicPolicy, PolicyError, bits_codec, check_bits_range, check_int,
                   layer_gradients, register_policy)


def assign_bits(errors: np.ndarray, sizes: np.ndarray, reference: int, levels: int) -> list[int]:
    """Column index per row (layer) of ``errors``/``sizes`` (layers x candidates) minimising
    the summed size subject to summed error <= that of column ``reference``, errors counted
    in units of (reference total) / ``levels`` rounded up. Ties: the smaller error."""
    errors = np.asarray(errors, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    n_layers, n_choices = errors.shape
    budget = float(errors[:, reference].sum())
    if budget <= 0.0:  # the reference is exact: keep every candidate that is exact too
        return [int(np.flatnonzero(row <= 0.0)[np.argmin(size[row <= 0.0])])
                for row, size in zip(errors, sizes)]
    unit = budget / levels
    costs = np.ceil(errors / unit - 1e-9).astype(np.int64)
    capacity = int(costs[:, reference].sum())
    # best[c]: smallest total size of the layers so far with total cost exactly c.
    best = np.full(capacity + 1, math.inf)
    best[0] = 0.0
    choice = np.zeros((n_layers, capacity + 1), np.int64)
    for layer in range(n_layers):
        new = np.full(capacity + 1, math.inf)
        for k in range(n_choices):
            cost = int(costs[layer, k])
            if cost > capacity:
                continue
            candidate = np.full(capacity + 1, math.inf)
            candidate[cost:] = best[:capacity + 1 - cost] + sizes[layer, k]
            better = candidate < new
            new[better] = candidate[better]
            choice[layer, better] = k
        best = new
    # Smallest size; among equal sizes the smallest total cost.
    total = int(np.flatnonzero(best == best.min())[0])
    picks = []
    for layer in reversed(range(n_layers)):
        k = int(choice[layer, total])
        picks.append(k)
        total -= int(costs[layer, k])
    return picks[::-1]


@register_policy
class LGreCoPolicy(PeriodicPolicy):
    """Per-layer bits of least total size at no more total error than ``reference_bits`` everywhere."""

    policy_id = "lgreco"
    uses_gradients = True
    chooses_settings = True

    def __init__(self, *, interval: int = 50, reference_bits: int = 4, min_bits: int = 2,
                 max_bits: int = 8, error_levels: int = 1000, sample_size: int = 0,
                 n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        self.interval = check_int(pid, "interval", interval, 1)
        self.min_bits, self.max_bits = check_bits_range(pid, min_bits, max_bits)
        self.reference_bits = check_int(pid, "reference_bits", reference_bits, self.min_bits, self.max_bits)
        self.error_levels = check_int(pid, "error_levels", error_levels, 1, 10**6)
        self.sample_size = check_int(pid, "sample_size", sample_size, 0)
        self._workspace = Workspace()
        self._menu: tuple[int, ...] | None = None  # a low-rank codec's setting codes (setup_codec)
        self._start((self.reference_bits,) * self.n_layers)

    def setup_codec(self, codec) -> None:
        """A low-rank codec with menus: choose among its settings, every layer at its ``rank`` until then."""
        if getattr(codec, "two_rounds", False) and getattr(codec, "mixed", False):
            self._menu = tuple(codec.menu)
            self._start((codec.reference_setting,) * self.n_layers)

    def _config(self):
        return {"interval": self.interval, "reference_bits": self.reference_bits,
                "min_bits": self.min_bits, "max_bits": self.max_bits,
                "error_levels": self.error_levels, "sample_size": self.sample_size}

    def bits_range(self):
        if self._menu is not None:  # setting codes: the widths' -b up to the largest rank
            return min(self._menu), max(self._menu)
        return self.min_bits, self.max_bits

    def _choose(self, obs: Observation) -> tuple[int, ...]:
        if self._menu is not None:
            return self._choose_settings(obs)
        codec = bits_codec(self.policy_id, obs)
        candidates = range(self.min_bits, self.max_bits + 1)
        errors = np.zeros((self.n_layers, len(candidates)))
        sizes = np.zeros((self.n_layers, len(candidates)))
        for layer, gradient in enumerate(layer_gradients(self.policy_id, obs, self.n_layers)):
            sample = strided_sample(gradient, self.sample_size, self._decisions,
                                    self._workspace.sample(self.sample_size or gradient.size))
            for k, bits in enumerate(candidates):
                try:
                    at_bits = codec.with_bits(bits)
                    # mse * len(sample) is the sample's squared error; scale it to the layer.
                    errors[layer, k] = quantization_error(at_bits, sample, "mse", self._workspace) * gradient.size
                except ValueError as exc:
                    raise PolicyError(f"policy 'lgreco': layer {layer} at {bits} bits: {exc}") from None
                sizes[layer, k] = at_bits.max_encoded_size(gradient.size)
        picks = assign_bits(errors, sizes, self.reference_bits - self.min_bits, self.error_levels)
        chosen = tuple(self.min_bits + k for k in picks)
        reference = float(errors[:, self.reference_bits - self.min_bits].sum())
        for layer, bits in enumerate(chosen):
            self._records.append({"iteration": int(obs.iteration), "layer": layer, "bits": bits,
                                  "error": errors[layer].copy(), "size": sizes[layer].copy(),
                                  "reference_error": reference})
        return chosen

    def _choose_settings(self, obs: Observation) -> tuple[int, ...]:
        costs = obs.settings
        if costs is None or tuple(costs.codes) != self._menu or np.shape(costs.errors)[0] != self.n_layers:
            raise PolicyError(f"policy 'lgreco' chooses among settings {list(self._menu)} of {self.n_layers} "
                              f"layer(s), but the observation has {costs!r}")
        errors = np.asarray(costs.errors, dtype=np.float64)
        sizes = np.asarray(costs.sizes, dtype=np.float64)
        reference = self._menu.index(costs.reference)
        picks = assign_bits(errors, sizes, reference, self.error_levels)
        chosen = tuple(self._menu[k] for k in picks)
        budget = float(errors[:, reference].sum())
        for layer, code in enumerate(chosen):
            self._records.append({"iteration": int(obs.iteration), "layer": layer, "bits": code,
                                  "error": errors[layer].copy(), "size": sizes[layer].copy(),
                                  "reference_error": budget})
        return chosen

    def record_columns(self):
        levels = len(self._menu) if self._menu is not None else self.max_bits - self.min_bits + 1
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ()),
                "error": ("f8", (levels,)), "size": ("f8", (levels,)), "reference_error": ("f8", ())}
