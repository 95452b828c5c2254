"""The run's clocks and the charging of one iteration as it happens.

What each phase and an iteration cost is :mod:`mpigrad.clockmodel` (shared with
``mpigrad trace retime``); this module applies it to the running clocks.

Modes: ``virtual`` advances the simulated clock only; ``sleep`` also makes rank 0 really
wait for the modelled time of each communication phase; ``off`` models nothing: the
simulated clock then equals the wall clock and t_comm is the measured wait.
"""

from __future__ import annotations

import time

from ...clockmodel import IterationTraffic, LinkModel, PipelinedTraffic, comm_start, iteration_seconds
from ...costmodel import CostModel, LocalWork

__all__ = ["Clocks", "IterationClock", "IterationTraffic", "LinkModel", "PipelinedTraffic"]


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
    measured local work by a fixed figure, for deterministic traces; with it, ``cost_model``
    (a :class:`~mpigrad.costmodel.CostModel` or None) charges ``local_work``'s encode,
    decode and average at each iteration's bits.
    """

    def __init__(self, link: LinkModel, workers: int, servers: int, cpu_clock: bool,
                 compute_time: float | None, clocks: Clocks | None = None, *, colocated: bool = False,
                 cost_model: CostModel | None = None, local_work: LocalWork | None = None):
        self.link, self.workers, self.servers, self.colocated = link, workers, servers, colocated
        self.cpu_clock, self.compute_time = cpu_clock, compute_time
        charged = compute_time is not None and link.modelled and cost_model is not None
        #: (model, work) when the cost model charges local work, else None.
        self.local_costs = (cost_model, local_work) if charged else None
        self._local_memo: dict[tuple[int, ...], float] = {}
        self.clocks = clocks or Clocks()
        self.t_comm = 0.0
        self.wall_start = 0.0
        self.node_round = None
        self.pipelined_charged = None

    def start(self) -> None:
        self.t_comm = 0.0
        #: This iteration's charge per communication phase (the phase log's "sim").
        self.phases: dict[str, float] = {}
        self.comm_start = self.clocks.sim
        self.wall_start = self.clocks.now_wall()
        #: A pipelined iteration on nodes: its overlapped schedule's NICs and intra-node links
        #: (``LinkModel.pipelined_hierarchical_round``), the record's node columns; else None.
        self.node_round = None
        #: A pipelined iteration's (traffic, t_forward, t_backward) as charged; else None.
        self.pipelined_charged = None

    # Each phase charged as it ends, in the order of LinkModel.comm_seconds, each from where
    # the previous one ended on the simulated clock (which only a network schedule reads).
    def losses(self, nbytes: int, t_compute: float = 0.0, ahead: int | None = None) -> None:
        """``t_compute``: the iteration's compute so far (the slowest worker's), which the
        first message follows; ``compute_time`` replaces it when set. ``ahead``: the bytes
        of a Control sent ahead at the iteration's start (``control = "ahead"``): the losses
        travel beside the frames, and only what of the Control's way outlasts the compute is
        charged (``LinkModel.comm_seconds``)."""
        self.comm_start = comm_start(self.clocks.sim, self.compute_time, t_compute)
        if ahead is not None:
            self.phases["losses"] = 0.0
            self.t_comm = self.phases["control"] = self.link.charge(self.link.control_ahead(
                self.workers, self.servers, ahead, self.colocated, self.clocks.sim, self.comm_start))
            return
        self.t_comm = self.phases["losses"] = self.link.charge(
            self.link.losses(self.workers, nbytes, self.comm_start, self.servers, self.colocated))

    def control(self, nbytes: int) -> None:
        self._add("control", self.link.control(self.workers, self.servers, nbytes, self.colocated,
                                               start=self.comm_start + self.t_comm))

    def gradients(self, sizes_per_server: list[list[int]]) -> None:
        self._add("gradients", self.link.gradients(sizes_per_server, self.colocated,
                                                   start=self.comm_start + self.t_comm))

    def broadcasts(self, bytes_per_server: list[int], hierarchical: bool = False) -> None:
        """``hierarchical``: each shard's average goes to the workers of its local rank only."""
        self._add("broadcast", self.link.broadcasts(self.workers, bytes_per_server, self.colocated,
                                                    start=self.comm_start + self.t_comm, hierarchical=hierarchical))

    def intra(self, phase: str, slice_bytes) -> None:
        """A hierarchical exchange's reduce-scatter or all-gather inside the nodes."""
        self._add(phase, self.link.node_intra(slice_bytes, self.workers).seconds)

    def _add(self, phase: str, seconds: float) -> None:
        charged = self.link.charge(seconds)
        self.t_comm += charged
        self.phases[phase] = self.phases.get(phase, 0.0) + charged  # two-round codecs: both rounds

    def pipelined(self, traffic: PipelinedTraffic, t_forward: float, t_backward: float) -> None:
        """Charge a pipelined iteration's communication (``LinkModel.pipelined_iteration``)
        from the end of the slowest forward pass; what backward hides is not charged again.
        Kept as ``pipelined_charged`` (the traffic, ``t_forward``, ``t_backward``) for the
        trace's ``buckets`` row."""
        self.comm_start = comm_start(self.clocks.sim, self.compute_time, t_forward)
        self.t_comm, self.node_round = self.link.pipelined_iteration(traffic, self.clocks.sim, self.compute_time,
                                                                     t_forward, t_backward)
        self.phases["pipelined"] = self.t_comm
        self.pipelined_charged = (traffic, t_forward, t_backward)

    def compute_seconds(self, cpu: float, wall: float) -> float:
        return cpu if self.cpu_clock else wall

    def local_seconds(self, bits) -> float:
        """The cost model's charge for this iteration's local work at ``bits`` (0 without one)."""
        if self.local_costs is None:
            return 0.0
        key = tuple(int(b) for b in bits)
        seconds = self._local_memo.get(key)
        if seconds is None:  # a pure function of the bits: evaluated once per choice (~30 us)
            model, work = self.local_costs
            seconds = self._local_memo[key] = work.seconds(model, key)
        return seconds

    def finish(self, t_compute: float, compute_wall: float, t_encode: float, t_decode: float,
               t_policy: float, bits=()) -> tuple[float, float, float]:
        """Advance the clocks; return (wall now, simulated now, t_comm of this iteration).
        ``bits``: the iteration's bits per quantized layer, for the cost model."""
        wall_now = self.clocks.now_wall()
        t_comm = self.t_comm
        if not self.link.modelled:
            local = compute_wall + t_encode + t_decode + t_policy
            t_comm = max(0.0, (wall_now - self.wall_start) - local)
            self.clocks.sim = wall_now
        else:
            seconds = iteration_seconds(t_comm, self.compute_time, t_compute, t_encode, t_decode, t_policy,
                                        self.local_seconds(bits))
            self.clocks.sim += seconds
            self.phases["local"] = seconds - t_comm
        return wall_now, self.clocks.sim, t_comm
