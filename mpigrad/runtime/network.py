"""Network model: what the parameter server's traffic would cost on a slower network.

Every message costs ``latency + bytes / bandwidth``. Rank 0's link is the bottleneck of a
parameter server: the P messages it receives in a round are serialised on it, and a star
broadcast sends P copies over it one after another. A binomial-tree broadcast (``--broadcast
tree``) takes ceil(log2(P + 1)) rounds of one message each, the copies being forwarded by
workers. Local work runs in parallel across workers, so the simulated clock charges the
slowest worker's compute and encode, then rank 0's own decode/average/encode/policy work.

Modes: ``virtual`` advances the simulated clock only; ``sleep`` also makes rank 0 really
wait for the modelled time of each communication phase; ``off`` models nothing: the
simulated clock then equals the wall clock and t_comm is the measured wait.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    bandwidth: float           # bytes per second
    latency: float             # seconds per message
    mode: str = "virtual"      # virtual | sleep | off
    broadcast: str = "star"    # star | tree

    def message(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def gather(self, sizes: list[int]) -> float:
        """P messages into rank 0, serialised on its link."""
        return sum(self.message(n) for n in sizes)

    def bcast(self, nbytes: int, workers: int) -> float:
        if self.broadcast == "tree":
            return math.ceil(math.log2(workers + 1)) * self.message(nbytes)
        return workers * self.message(nbytes)

    def charge(self, seconds: float) -> float:
        """Apply a modelled communication phase: sleep in ``sleep`` mode; return the charge."""
        if self.mode == "sleep" and seconds > 0:
            time.sleep(seconds)
        return seconds if self.mode != "off" else 0.0

    @property
    def modelled(self) -> bool:
        return self.mode != "off"


class Clocks:
    """The run's two clocks: wall (real training time, evaluation excluded) and simulated."""

    def __init__(self, wall: float = 0.0, sim: float = 0.0):
        self.wall = wall
        self.sim = sim
        self._paused_at: float | None = None
        self._origin = time.perf_counter() - wall

    def now_wall(self) -> float:
        return time.perf_counter() - self._origin

    def pause(self) -> None:
        """Stop the wall clock (for evaluation and checkpoints)."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._origin += time.perf_counter() - self._paused_at
            self._paused_at = None

    def state_dict(self) -> dict[str, float]:
        return {"wall": self.now_wall(), "sim": self.sim}
