"""The MQGrad Q-network: n_inputs -> n_hidden (ReLU) -> n_outputs, float64 NumPy.

Tiny (5 -> 10 -> 7 in the paper), so plain NumPy beats any framework call overhead and
has no thread surprises. ``gradient(x, k)`` is the exact gradient of output ``k`` with
respect to every parameter, used by the semi-gradient SARSA update.
"""

from __future__ import annotations

import numpy as np

OUTPUT_INITS = ("zero", "uniform")


class QNetwork:
    """Two-layer perceptron. Parameters ``(W1, b1, W2, b2)`` with shapes
    ``(h, n), (h,), (k, h), (k,)``.

    The hidden layer is initialised like ``torch.nn.Linear`` (uniform in
    +-1/sqrt(fan_in)); the output layer likewise with ``output_init="uniform"``, or
    to zeros with ``output_init="zero"`` so that every output starts equal.
    """

    def __init__(self, n_inputs: int, n_hidden: int, n_outputs: int, rng: np.random.Generator,
                 output_init: str = "zero"):
        if output_init not in OUTPUT_INITS:
            raise ValueError(f"output_init must be one of {OUTPUT_INITS}, got {output_init!r}")
        bound1 = 1.0 / np.sqrt(n_inputs)
        bound2 = 1.0 / np.sqrt(n_hidden)
        self.W1 = rng.uniform(-bound1, bound1, (n_hidden, n_inputs))
        self.b1 = rng.uniform(-bound1, bound1, n_hidden)
        if output_init == "uniform":
            self.W2 = rng.uniform(-bound2, bound2, (n_outputs, n_hidden))
            self.b2 = rng.uniform(-bound2, bound2, n_outputs)
        else:
            self.W2 = np.zeros((n_outputs, n_hidden))
            self.b2 = np.zeros(n_outputs)

    @property
    def params(self) -> tuple[np.ndarray, ...]:
        return self.W1, self.b1, self.W2, self.b2

    def values(self, x: np.ndarray) -> np.ndarray:
        """All outputs at input ``x`` (1-D)."""
        hidden = np.maximum(self.W1 @ x + self.b1, 0.0)
        return self.W2 @ hidden + self.b2

    def gradient(self, x: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """d values(x)[k] / d params, one array per parameter (ReLU'(0) taken as 0)."""
        pre = self.W1 @ x + self.b1
        hidden = np.maximum(pre, 0.0)
        d_pre = self.W2[k] * (pre > 0.0)
        d_W2 = np.zeros_like(self.W2)
        d_W2[k] = hidden
        d_b2 = np.zeros_like(self.b2)
        d_b2[k] = 1.0
        return np.outer(d_pre, x), d_pre, d_W2, d_b2

    def add_(self, deltas: tuple[np.ndarray, ...], scale: float) -> None:
        """params += scale * deltas, in place."""
        for param, delta in zip(self.params, deltas):
            param += scale * delta

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: p.copy() for name, p in zip(("W1", "b1", "W2", "b2"), self.params)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for name, param in zip(("W1", "b1", "W2", "b2"), self.params):
            value = np.asarray(state[name], dtype=np.float64)
            if value.shape != param.shape:
                raise ValueError(f"Q-network {name} has shape {param.shape}, state holds {value.shape}")
            param[...] = value
