"""Bit-selection policies: plain classes that choose the bits of every quantized layer.

    policy = get_policy({"id": "mqgrad", "T": 5}, n_layers=2, seed=123)
    bits = policy.decide(Observation(iteration=m, loss=L, last_iteration_ms=ms))

Policies know nothing of MPI; the runtime calls ``decide`` once per iteration, in order,
writes ``drain_records()`` to the trace and checkpoints ``state_dict()``.
"""

from .base import (BITS_LIMITS, Observation, PeriodicPolicy, Policy, PolicyError, SettingCosts, available, check_decision,
                   bits_option, get_policy, policy_class, policy_options, register_policy)
from . import fixed, schedule, adaptive, mqgrad, accordion, lgreco, aimd, progress  # noqa: F401,E402  (register the policies)

__all__ = ["BITS_LIMITS", "Observation", "PeriodicPolicy", "Policy", "PolicyError", "SettingCosts", "available",
           "bits_option", "check_decision", "get_policy", "policy_class", "policy_options", "register_policy"]
