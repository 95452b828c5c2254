"""The clock model, in one place: what an iteration costs on the run's two clocks.

Network: every message costs ``latency + bytes / bandwidth``. A server's link is the
bottleneck of a parameter server: the P messages it receives in a round are serialised on
it, and a star broadcast sends one copy per receiver over it one after another. A
binomial-tree broadcast (``--broadcast tree``) takes ceil(log2(receivers + 1)) rounds of one
message each, the copies being forwarded by workers. With S servers each has its own link:
the gradient round takes as long as the slowest server's (its P frames of its shard), and so
does the broadcast round (server s > 0 also sends its shard to rank 0). Rank 0's loss
gather and its control broadcast (to the P workers and S - 1 other servers) are as with one
server; the servers' small reports to rank 0 are not charged.

Local work runs in parallel across ranks, so the simulated clock charges the slowest
worker's compute and encode, then the slowest server's decode/average/encode and rank 0's
policy time (see :class:`IterationClock`).

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


class IterationClock:
    """Charges one iteration's phases and advances the simulated clock.

    ``cpu_clock``: compute time on the simulated clock is CPU time when ranks compute on one
    CPU thread (oversubscribed ranks then do not inflate it), wall time otherwise (CPU time
    adds up threads and misses GPU kernels). ``compute_time`` (seconds or None) replaces
    measured local work by a fixed figure, for deterministic traces.
    """

    def __init__(self, link: LinkModel, workers: int, servers: int, cpu_clock: bool,
                 compute_time: float | None, clocks: Clocks | None = None):
        self.link, self.workers, self.servers = link, workers, servers
        self.cpu_clock, self.compute_time = cpu_clock, compute_time
        self.clocks = clocks or Clocks()
        self.t_comm = 0.0
        self.wall_start = 0.0

    def start(self) -> None:
        self.t_comm = 0.0
        self.wall_start = self.clocks.now_wall()

    def losses(self, nbytes: int) -> None:
        self.t_comm = self.link.charge(self.link.gather([nbytes] * self.workers))

    def control(self, nbytes: int) -> None:
        self.t_comm += self.link.charge(self.link.bcast(nbytes, self.workers + self.servers - 1))

    def gradients(self, sizes_per_server: list[list[int]]) -> None:
        self.t_comm += self.link.charge(max(self.link.gather(sizes) for sizes in sizes_per_server))

    def broadcasts(self, bytes_per_server: list[int]) -> None:
        self.t_comm += self.link.charge(max(
            self.link.bcast(n, self.workers + (s > 0)) for s, n in enumerate(bytes_per_server)))

    def compute_seconds(self, cpu: float, wall: float) -> float:
        return cpu if self.cpu_clock else wall

    def finish(self, t_compute: float, compute_wall: float, t_encode: float, t_decode: float,
               t_policy: float) -> tuple[float, float, float]:
        """Advance the clocks; return (wall now, simulated now, t_comm of this iteration)."""
        wall_now = self.clocks.now_wall()
        t_comm = self.t_comm
        if not self.link.modelled:
            local = compute_wall + t_encode + t_decode + t_policy
            t_comm = max(0.0, (wall_now - self.wall_start) - local)
            self.clocks.sim = wall_now
        elif self.compute_time is not None:
            self.clocks.sim += self.compute_time + t_comm
        else:
            self.clocks.sim += t_compute + t_encode + t_decode + t_policy + t_comm
        return wall_now, self.clocks.sim, t_comm
