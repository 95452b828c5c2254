"""MCGQ's dynamic sampling (Mordido, Alg. 3): the sampling amount K of each layer follows
the W1 distance between a gradient and its decoded MCGQ buffer, K <- K + step * (d' - d).

``DynamicSampling`` holds the rule and the per-layer state, for callers that drive a plain
``mcgq`` codec with ``encode(x, K=...)``; ``MCGQ(dynamic=True)`` uses the same rule inside
one codec instance. ``wasserstein1`` is the distance both use.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Hashable

import numpy as np

from .base import CodecError
from .kernels import mcgq as kernels

__all__ = ["DynamicSampling", "wasserstein1", "check_sampling_amount", "K_LIMIT"]

#: Largest sampling amount K (keeps N below 2**45 and B_g below 47 bits).
K_LIMIT = 1024


def check_sampling_amount(K: Any) -> float:
    if isinstance(K, bool) or not isinstance(K, Real) or not 0 < K <= K_LIMIT:
        raise CodecError(f"mcgq: K must be a number in (0, {K_LIMIT}], got {K!r}")
    return float(K)


def wasserstein1(g: np.ndarray, q: np.ndarray) -> float:
    """W1 between the distributions |g|/||g||_1 and |q|/||q||_1 over the index axis.

    Element k sits at k / n, so the result lies in [0, 1) whatever the layer size:
    W1 = (1/n) sum_k |CDF_g(k) - CDF_q(k)|. Two zero vectors are at distance 0; a zero
    vector and a non-zero one at distance 1.
    """
    g = _float_vector(g, "g")
    q = _float_vector(q, "q")
    if g.size != q.size:
        raise CodecError(f"wasserstein1: g has {g.size} elements, q has {q.size}")
    return _wasserstein1(g, q)


def _wasserstein1(g: np.ndarray, q: np.ndarray) -> float:
    """``wasserstein1`` of finite contiguous vectors of one size, unchecked and allocation-free."""
    g_zero = not g.any()
    q_zero = not q.any()
    if g_zero or q_zero:
        return 0.0 if g_zero and q_zero else 1.0
    return float(kernels.wasserstein1_index(g, q))


def _float_vector(x: Any, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype.kind != "f":
        raise CodecError(f"{name} must be a 1-D numpy floating-point array")
    if not np.isfinite(x).all():
        raise CodecError(f"{name} contains NaN or infinity")
    return np.ascontiguousarray(x)


class DynamicSampling:
    """Per-layer sampling amount K, adapted by Alg. 3: K <- K + step * (d' - d).

    d is ``wasserstein1(g, decoded)`` of this call (W1 over the index axis, see there),
    d' the previous call's for the same layer; the first call of a layer only records d.
    K is clipped to [K_min, K_max]. As in the paper, K grows when the distance shrank.

        K = sampler.sampling_amount(key)
        decoded = codec.decode(codec.encode(g, K=K))
        sampler.update(key, g, decoded)
    """

    def __init__(self, K_init: float = 0.1, step: float = 1.0, K_min: float = 0.01, K_max: float = 1.0):
        self.K_min = check_sampling_amount(K_min)
        self.K_max = check_sampling_amount(K_max)
        self.K_init = check_sampling_amount(K_init)
        if not self.K_min <= self.K_init <= self.K_max:
            raise CodecError(f"dynamic sampling needs K_min <= K_init <= K_max, got "
                             f"{self.K_min} <= {self.K_init} <= {self.K_max}")
        if isinstance(step, bool) or not isinstance(step, Real) or not 0 <= step < math.inf:
            raise CodecError(f"dynamic sampling step must be a finite number >= 0, got {step!r}")
        self.step = float(step)
        self._K: dict[Hashable, float] = {}
        self._distance: dict[Hashable, float] = {}

    def sampling_amount(self, key: Hashable) -> float:
        return self._K.get(key, self.K_init)

    def distance(self, key: Hashable) -> float | None:
        """The last W1 distance recorded for ``key`` (None before its first update)."""
        return self._distance.get(key)

    def update(self, key: Hashable, g: np.ndarray, decoded: np.ndarray) -> float:
        """Record this call's distance and return the layer's next K."""
        d = wasserstein1(g, decoded)
        self._K[key] = self.next_amount(self.sampling_amount(key), self._distance.get(key), d)
        self._distance[key] = d
        return self._K[key]

    def next_amount(self, K: float, previous: float | None, d: float) -> float:
        """Alg. 3 for one layer: K + step * (previous - d) clipped to [K_min, K_max];
        K itself when there is no previous distance (the layer's first call)."""
        if previous is None:
            previous = d
        return min(max(K + self.step * (previous - d), self.K_min), self.K_max)

    def state_dict(self) -> dict[str, dict]:
        return {"K": dict(self._K), "distance": dict(self._distance)}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        K = {key: float(v) for key, v in state["K"].items()}
        distance = {key: float(v) for key, v in state["distance"].items()}
        if set(K) != set(distance):
            raise CodecError("dynamic sampling state: the K and distance entries name different layers")
        bad = [key for key, v in K.items() if not self.K_min <= v <= self.K_max]
        if bad:
            raise CodecError(f"dynamic sampling state: K of layers {bad} lies outside "
                             f"[{self.K_min}, {self.K_max}]")
        self._K, self._distance = K, distance
