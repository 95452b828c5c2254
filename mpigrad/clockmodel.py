"""The clock model, in one place: what an iteration's messages and local work cost.

Network: every message costs ``latency + bytes / bandwidth``. A server's link is the
bottleneck of a parameter server: the P messages it receives in a round are serialised on
it, and a star broadcast sends one copy per receiver over it one after another. A
binomial-tree broadcast (``--broadcast tree``) takes ceil(log2(receivers + 1)) rounds of one
message each, the copies being forwarded by workers. With S servers each has its own link:
the gradient round takes as long as the slowest server's (its P frames of its shard), and so
does the broadcast round (server s > 0 also sends its shard to rank 0). Rank 0's loss
gather and its control broadcast (to the P workers and S - 1 other servers) are as with one
server; the servers' small reports to rank 0 are not charged.

Colocated servers (``--servers colocated``): worker w also serves shard w, and each node has
one link. A worker's frame to its own shard crosses no link; in the gradient round a node
receives the P - 1 other workers' frames of its shard and sends its P - 1 frames of the
others, each direction serialised on its link (full duplex: the round takes the slowest
direction of the slowest node); in the broadcast round a node sends its shard to the P - 1
others (star: one copy after another; tree: ceil(log2 P) rounds) while it receives the
P - 1 other shards, again the slower of the two. Rank 0 takes part in neither round; its
loss gather and Control broadcast (to the P workers) are as before.

Local work runs in parallel across ranks, so a modelled iteration charges the slowest
worker's compute and encode, then the slowest server's decode/average/encode and rank 0's
policy time, or a fixed ``compute_time`` in place of the compute plus the cost model's
charge for the policy, encoding, decoding and averaging (:mod:`mpigrad.costmodel`) in place of the
rest (``iteration_seconds``).

The runtime (:mod:`mpigrad.runtime.clock`) charges each phase as it happens and
``mpigrad trace retime`` re-charges a trace's recorded bytes: both through this module,
which imports neither MPI, torch nor Numba.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

__all__ = ["LinkModel", "IterationTraffic", "iteration_seconds"]


@dataclass(frozen=True)
class LinkModel:
    bandwidth: float           # bytes per second
    latency: float             # seconds per message
    mode: str = "virtual"      # virtual | sleep | off
    broadcast: str = "star"    # star | tree

    def message(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def gather(self, sizes: Sequence[int]) -> float:
        """Messages into one rank, serialised on its link."""
        return sum(self.message(n) for n in sizes)

    def bcast(self, nbytes: int, workers: int) -> float:
        """One message to ``workers`` receivers (any ranks, despite the name)."""
        if self.broadcast == "tree":
            return math.ceil(math.log2(workers + 1)) * self.message(nbytes)
        return workers * self.message(nbytes)

    # ---- the phases of an iteration (mpigrad.runtime.iteration) ------------------------
    def losses(self, workers: int, loss_bytes: int) -> float:
        """Rank 0 gathers one loss report from each worker."""
        return self.gather([loss_bytes] * workers)

    def control(self, workers: int, servers: int, control_bytes: int, colocated: bool = False) -> float:
        """Rank 0 broadcasts the Control to the workers and the other servers."""
        return self.bcast(control_bytes, workers if colocated else workers + servers - 1)

    def gradients(self, frames_in: Sequence[Sequence[int]], colocated: bool = False) -> float:
        """Each server gathers its shard's frames (``frames_in[s]``, in worker order); the
        slowest server ends the round. Colocated: the slowest link direction of any node."""
        if not colocated:
            return max(self.gather(sizes) for sizes in frames_in)
        nodes = range(len(frames_in))
        inbound = max(self.gather([frames_in[s][w] for w in nodes if w != s]) for s in nodes)
        outbound = max(self.gather([frames_in[s][w] for s in nodes if s != w]) for w in nodes)
        return max(inbound, outbound)

    def broadcasts(self, workers: int, frames_out: Sequence[int], colocated: bool = False) -> float:
        """Server s broadcasts ``frames_out[s]`` bytes to the workers (and rank 0 when s > 0).
        Colocated: node s sends its shard to the P - 1 other workers while it receives theirs."""
        if not colocated:
            return max(self.bcast(n, workers + (s > 0)) for s, n in enumerate(frames_out))
        if workers < 2:
            return 0.0
        outbound = max(self.bcast(n, workers - 1) for n in frames_out)
        inbound = max(self.gather([n for t, n in enumerate(frames_out) if t != s]) for s in range(workers))
        return max(outbound, inbound)

    def comm_seconds(self, traffic: "IterationTraffic") -> float:
        """One iteration's modelled communication: its phases, summed in the order the
        runtime charges them (so that the float is the runtime's to the last bit)."""
        colocated = traffic.colocated
        t_comm = self.losses(traffic.workers, traffic.loss_bytes)
        t_comm += self.control(traffic.workers, traffic.servers, traffic.control_bytes, colocated)
        t_comm += self.gradients(traffic.frames_in, colocated)
        t_comm += self.broadcasts(traffic.workers, traffic.frames_out, colocated)
        return t_comm

    # ---- how the runtime applies a phase ---------------------------------------------
    def charge(self, seconds: float) -> float:
        """Apply a modelled communication phase: sleep in ``sleep`` mode; return the charge."""
        if self.mode == "sleep" and seconds > 0:
            time.sleep(seconds)
        return seconds if self.mode != "off" else 0.0

    @property
    def modelled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class IterationTraffic:
    """The messages of one iteration that the clock charges.

    ``loss_bytes``: one worker's loss report; ``control_bytes``: one copy of the Control;
    ``frames_in[s][w]``: worker w's gradient frame to server s; ``frames_out[s]``: one copy
    of server s's broadcast, its length message included; ``colocated``: worker w serves
    shard w (its frame to it and its broadcast to itself cross no link, rank 0 gets none).
    """

    loss_bytes: int
    control_bytes: int
    frames_in: tuple[tuple[int, ...], ...]
    frames_out: tuple[int, ...]
    colocated: bool = False

    @property
    def servers(self) -> int:
        return len(self.frames_in)

    @property
    def workers(self) -> int:
        return len(self.frames_in[0])

    @property
    def server_bytes_in(self) -> tuple[int, ...]:
        """Bytes of workers' frames that reach each server over a link."""
        return tuple(sum(n for w, n in enumerate(sizes) if not (self.colocated and w == s))
                     for s, sizes in enumerate(self.frames_in))

    @property
    def worker_bytes_sent(self) -> tuple[int, ...]:
        """Bytes of gradient frames each worker sends over its link."""
        return tuple(sum(sizes[w] for s, sizes in enumerate(self.frames_in) if not (self.colocated and w == s))
                     for w in range(self.workers))

    @property
    def copies_out(self) -> tuple[int, ...]:
        """How many copies of each server's broadcast cross a link."""
        P = self.workers
        return tuple(P - 1 if self.colocated else P + (s > 0) for s in range(self.servers))

    @property
    def bytes_up(self) -> int:
        """Bytes into servers: every worker's frames and loss reports."""
        return sum(self.server_bytes_in) + self.workers * self.loss_bytes

    @property
    def bytes_down(self) -> int:
        """Bytes out of servers: every copy of the Control and of each broadcast."""
        P, S = self.workers, self.servers
        controls = P if self.colocated else P + S - 1
        return controls * self.control_bytes + sum(c * n for c, n in zip(self.copies_out, self.frames_out))

    @classmethod
    def from_totals(cls, bytes_up: int, bytes_down: int, frames_in: Sequence[Sequence[int]],
                    frames_out: Sequence[int], colocated: bool = False) -> "IterationTraffic":
        """The traffic whose ``bytes_up`` and ``bytes_down`` these are: the loss report's and
        the Control's sizes solved from them (a trace records the totals and the frames).
        ValueError when no whole sizes give those totals."""
        frames_in = tuple(tuple(int(n) for n in sizes) for sizes in frames_in)
        frames_out = tuple(int(n) for n in frames_out)
        probe = cls(0, 0, frames_in, frames_out, colocated)
        P, S = probe.workers, probe.servers
        loss, loss_left = divmod(int(bytes_up) - probe.bytes_up, P)
        control, control_left = divmod(int(bytes_down) - probe.bytes_down, P if colocated else P + S - 1)
        if loss < 0 or control < 0 or loss_left or control_left:
            raise ValueError(f"bytes up {bytes_up} and down {bytes_down} do not add up from the frames "
                             f"({frames_in} in, {frames_out} out)")
        return cls(loss, control, frames_in, frames_out, colocated)


def iteration_seconds(t_comm: float, compute_time: float | None, t_compute: float, t_encode: float,
                      t_decode: float, t_policy: float, t_local: float = 0.0) -> float:
    """Simulated seconds of one modelled iteration: a fixed ``compute_time`` (deterministic
    runs) plus ``t_local``, the cost model's policy, encode, decode and average
    (:mod:`mpigrad.costmodel`; 0 with ``--cost-model none``), or the measured local work,
    plus its communication."""
    if compute_time is not None:
        return compute_time + t_local + t_comm
    return t_compute + t_encode + t_decode + t_policy + t_comm
