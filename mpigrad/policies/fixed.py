"""``fixed``: the same bits for every layer at every iteration (the paper's Fix 2/4/8)."""

from __future__ import annotations

from .base import BITS_LIMITS, Observation, Policy, check_int, register_policy


@register_policy
class FixedPolicy(Policy):
    """Constant ``bits`` for every quantized layer."""

    policy_id = "fixed"

    def __init__(self, *, bits: int = 4, n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        self.bits = check_int(self.policy_id, "bits", bits, *BITS_LIMITS)
        self._decision = (self.bits,) * self.n_layers

    def _config(self):
        return {"bits": self.bits}

    def bits_range(self):
        return self.bits, self.bits

    def decide(self, obs: Observation) -> tuple[int, ...]:
        return self._decision

    def bits_ahead(self, iteration: int) -> tuple[int, ...]:
        return self._decision
