"""``adaptive``: our reading of Oland & Raj's heuristic, as the MQGrad paper describes it.

The MQGrad paper says the "Adaptive" baseline chooses the bits "according to the
gradient's mean square error", needing more bits "when the gradient's norm is large".
Their paper is not available to us; the precise rule implemented here is:

    every ``interval`` iterations, for each quantized layer, take a fixed-size strided
    subsample g of the last averaged gradient and choose the fewest bits b in
    [min_bits, max_bits] with  err_b(g) <= threshold,  where err_b is
      - ``error="relative"``: ||Q_b(g) - g||^2 / ||g||^2  (scale-free), or
      - ``error="mse"``:      ||Q_b(g) - g||^2 / len(g)   (grows with the gradient's norm,
                              the literal "more bits when the norm is large"),
    and Q_b is the run's own codec set to b bits (``codec.with_bits(b).encode/decode``).
    If no b meets the threshold, max_bits. Without per-layer bits every layer gets the
    largest of the layers' choices. Before the first gradient arrives: ``initial_bits``.

Cost at rank 0: at most (max_bits - min_bits + 1) encode/decode pairs of ``sample_size``
elements per layer, once every ``interval`` iterations, plus one strided copy; the search
stops at the first b that meets the threshold. ``sample_size=0`` measures whole layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import (Observation, PeriodicPolicy, PolicyError, bits_codec, check_bits_range, check_bool,
                   check_choice, check_float, check_int, layer_gradients, register_policy)

ERRORS = ("relative", "mse")


def strided_sample(gradient: np.ndarray, size: int, offset: int, out: np.ndarray | None = None) -> np.ndarray:
    """Every (n // size)-th element from ``offset % (n // size)``: ``size`` float32 values
    (all of ``gradient`` when ``size`` is 0 or not smaller than it). Written into the
    front of ``out`` when given (float32, long enough)."""
    if size == 0 or gradient.size <= size:
        picked = gradient
    else:
        stride = gradient.size // size
        picked = gradient[offset % stride::stride][:size]
    if out is None:
        return np.ascontiguousarray(picked, dtype=np.float32)
    view = out[:picked.size]
    np.copyto(view, picked, casting="same_kind")
    return view


def quantization_error(codec: Any, sample: np.ndarray, kind: str,
                       workspace: Workspace | None = None) -> float:
    """``relative``: ||Q(g) - g||^2 / ||g||^2 (0 for g = 0); ``mse``: ||Q(g) - g||^2 / len(g).

    ``sample`` is contiguous float32; sums are float32 dot products (ample for a threshold).
    """
    work = workspace or Workspace()
    decoded = codec.decode(codec.encode(sample, out=work.encoded(codec, sample.size)),
                           out=work.decoded(sample.size))
    np.subtract(decoded, sample, out=decoded)
    squared = float(np.dot(decoded, decoded))
    if kind == "mse":
        return squared / max(sample.size, 1)
    energy = float(np.dot(sample, sample))
    return squared / energy if energy > 0.0 else 0.0


class Workspace:
    """Reused buffers so that a decision allocates nothing sample-sized (fresh pages cost
    more than the encode itself at 64K elements)."""

    def __init__(self):
        self._buffers: dict[str, np.ndarray] = {}

    def _get(self, name: str, size: int, dtype) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.size < size:
            buf = self._buffers[name] = np.empty(size, dtype)
        return buf

    def sample(self, size: int) -> np.ndarray:
        return self._get("sample", size, np.float32)

    def decoded(self, size: int) -> np.ndarray:
        return self._get("decoded", size, np.float32)[:size]

    def encoded(self, codec: Any, size: int) -> np.ndarray:
        return self._get("encoded", codec.max_encoded_size(size), np.uint8)


@register_policy
class AdaptivePolicy(PeriodicPolicy):
    """Fewest bits whose estimated quantization error stays under ``threshold``."""

    policy_id = "adaptive"
    uses_gradients = True

    def __init__(self, *, threshold: float = 0.01, error: str = "relative", interval: int = 5,
                 sample_size: int = 65536, min_bits: int = 2, max_bits: int = 8,
                 initial_bits: int | None = None, per_layer: bool = False, n_layers: int = 1,
                 seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        self.threshold = check_float(pid, "threshold", threshold, 0.0, low_open=True)
        self.error = check_choice(pid, "error", error, ERRORS)
        self.interval = check_int(pid, "interval", interval, 1)
        self.sample_size = check_int(pid, "sample_size", sample_size, 0)
        self.min_bits, self.max_bits = check_bits_range(pid, min_bits, max_bits)
        self.initial_bits = None if initial_bits is None else check_int(
            pid, "initial_bits", initial_bits, self.min_bits, self.max_bits)
        self.per_layer = check_bool(pid, "per_layer", per_layer)
        start = self.max_bits if self.initial_bits is None else self.initial_bits
        self._workspace = Workspace()
        self._start((start,) * self.n_layers)   # _decisions also moves the subsample's offset

    def _config(self):
        return {"threshold": self.threshold, "error": self.error, "interval": self.interval,
                "sample_size": self.sample_size, "min_bits": self.min_bits,
                "max_bits": self.max_bits, "initial_bits": self.initial_bits,
                "per_layer": self.per_layer}

    def bits_range(self):
        return self.min_bits, self.max_bits

    def _choose(self, obs: Observation) -> tuple[int, ...]:
        codec = bits_codec(self.policy_id, obs)
        rows = []
        for layer, gradient in enumerate(layer_gradients(self.policy_id, obs, self.n_layers)):
            sample = strided_sample(gradient, self.sample_size, self._decisions,
                                    self._workspace.sample(self.sample_size or gradient.size))
            errors = np.full(self.max_bits - self.min_bits + 1, np.nan)
            chosen = self.max_bits
            for bits in range(self.min_bits, self.max_bits + 1):
                try:
                    errors[bits - self.min_bits] = quantization_error(
                        codec.with_bits(bits), sample, self.error, self._workspace)
                except ValueError as exc:
                    raise PolicyError(f"policy 'adaptive': layer {layer} at {bits} bits: {exc}") from None
                if errors[bits - self.min_bits] <= self.threshold:
                    chosen = bits
                    break
            rows.append({"iteration": int(obs.iteration), "layer": layer, "layer_bits": chosen,
                         "error": errors, "sample_size": sample.size,
                         "sample_norm": float(np.sqrt(np.dot(sample, sample)))})
        choices = [row["layer_bits"] for row in rows]
        bits = tuple(choices) if self.per_layer else (max(choices),) * self.n_layers
        for row, layer_bits in zip(rows, bits):
            row["bits"] = layer_bits
        self._records.extend(rows)
        return bits

    def record_columns(self):
        levels = self.max_bits - self.min_bits + 1
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ()),
                "layer_bits": ("i4", ()), "error": ("f8", (levels,)), "sample_size": ("i8", ()),
                "sample_norm": ("f8", ())}
