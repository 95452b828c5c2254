"""``schedule``: bits by iteration, e.g. ``"0:2,500:4,2000:8"`` (2 bits from iteration 0,
4 from 500, 8 from 2000), the same for every layer."""

from __future__ import annotations

import bisect
from typing import Any

from .base import (Observation, Policy, PolicyError, check_bits_range, check_int,
                   register_policy)


def parse_schedule(policy_id: str, schedule: Any) -> list[tuple[int, int]]:
    """``"m:b,m:b,..."`` or a list of ``[m, b]`` pairs -> sorted list of (iteration, bits).

    The first entry must start at iteration 0 and iterations must strictly increase.
    """
    if isinstance(schedule, str):
        pairs = []
        for item in schedule.split(","):
            start, sep, bits = item.partition(":")
            try:
                pairs.append((int(start), int(bits)))
            except ValueError:
                raise PolicyError(f"policy {policy_id!r}: schedule entry {item.strip()!r} is not "
                                  f"ITERATION:BITS (e.g. '0:2,500:4,2000:8')") from None
    elif isinstance(schedule, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in schedule):
        pairs = [(check_int(policy_id, "schedule iteration", m, 0),
                  check_int(policy_id, "schedule bits", b)) for m, b in schedule]
    else:
        raise PolicyError(f"policy {policy_id!r}: schedule must be a string like '0:2,500:4' or a "
                          f"list of [iteration, bits] pairs, got {schedule!r}")
    if not pairs or pairs[0][0] != 0:
        raise PolicyError(f"policy {policy_id!r}: schedule must start at iteration 0, got {schedule!r}")
    for (m0, _), (m1, _) in zip(pairs, pairs[1:]):
        if m1 <= m0:
            raise PolicyError(f"policy {policy_id!r}: schedule iterations must strictly increase "
                              f"({m0} then {m1})")
    return pairs


@register_policy
class SchedulePolicy(Policy):
    """Piecewise-constant bits over iterations; bits must lie in [min_bits, max_bits]."""

    policy_id = "schedule"

    def __init__(self, *, schedule: str = "0:2,500:4,2000:8", min_bits: int = 2, max_bits: int = 8,
                 n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        self.min_bits, self.max_bits = check_bits_range(self.policy_id, min_bits, max_bits)
        self.entries = parse_schedule(self.policy_id, schedule)
        for start, bits in self.entries:
            if not self.min_bits <= bits <= self.max_bits:
                raise PolicyError(f"policy {self.policy_id!r}: schedule gives {bits} bits at iteration "
                                  f"{start}, outside [min_bits, max_bits] = "
                                  f"[{self.min_bits}, {self.max_bits}]")
        self._starts = [start for start, _ in self.entries]

    def _config(self):
        text = ",".join(f"{start}:{bits}" for start, bits in self.entries)
        return {"schedule": text, "min_bits": self.min_bits, "max_bits": self.max_bits}

    def bits_range(self):
        used = [bits for _, bits in self.entries]
        return min(used), max(used)

    def bits_at(self, iteration: int) -> int:
        return self.entries[bisect.bisect_right(self._starts, iteration) - 1][1]

    def decide(self, obs: Observation) -> tuple[int, ...]:
        return (self.bits_at(obs.iteration),) * self.n_layers

    def bits_ahead(self, iteration: int) -> tuple[int, ...]:
        return (self.bits_at(iteration),) * self.n_layers
