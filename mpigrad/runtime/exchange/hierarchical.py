"""The hierarchical exchange (``--exchange hierarchical``): only what crosses a node's NIC
goes through the codecs.

Colocated servers on nodes of L workers (``--ranks-per-node L``, :mod:`..plan.topology`):
worker w serves shard w, as with the flat exchange, and the shards of local rank j's workers
across the N nodes make *slice* j of the gradient. One iteration:

1. inside each node, a reduce-scatter at ``--intra-codec`` precision (message 12): each
   worker sends slice i of its gradient to the node's local rank i, which adds the node's L
   slices in local-rank order (float32) and takes their mean;
2. across nodes, each local rank j runs the flat colocated exchange of its slice with local
   rank j of the other nodes: it encodes its node's mean of the N shards of slice j at the
   Control's bits (error feedback, DGC's velocity and the policies as with the flat one),
   sends shard k to node k's local rank j, averages the N node means of its own shard,
   re-encodes it and sends it to the N - 1 others (messages 3 and 4 within the local rank);
3. inside each node, an all-gather (message 12): local rank j sends its slice of the
   decoded average to the node's other workers.

Every worker then holds the same decoded average, bit for bit: a slice sent at fp16 or bf16
is rounded on its owner too before it is applied. Rank 0 takes part in neither, as with the
flat colocated exchange: it gathers the P ServerReports, whose frame bytes count one frame
per node (0 for the workers of other local ranks, which send it nothing), and charges the
clock with the nodes' model (:mod:`mpigrad.clockmodel`, ``Nodes``).

PowerSGD (``--codec powersgd``, :mod:`.tworounds` around this way): the shards are whole
layers (``build.shard_chunks``), so slice j is whole matrices; local rank j computes the
factors of its slice's layers from its node's mean M_k = (node mean of g) + e_k (the error
memory its own, over those layers), the two rounds run within local rank j as above, it
writes P^ Q^T for its layers, and the all-gather brings the node's other slices. With a
lossy ``--intra-codec`` the memory is M_k - P^ Q^T before the all-gather's rounding. With
PowerSGD's menus (``ranks``/``widths``, ``--policy lgreco``) local rank j measures the
setting errors of its slice's layers on M_k, and rank 0 averages each layer over the nodes.

The pipelined iteration (``--pipeline``) of this exchange is :mod:`.hierarchical_pipeline`'s
(bucket by bucket, the same float operations). Workers on GPUs run it with their codecs on
the host (``device.exchange_host_reason``: the gradient copied out and the update back, as
the host path does); ``auto`` takes the flat exchange for them (the device path where the
codecs have kernels). Not built yet: the pipelined iteration on GPUs (refused by
:func:`..plan.topology.resolve_topology`, and by the worker for an in-process run). The
cost model charges each worker its slice's local work (``costmodel.LocalWork``'s ``slices``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...config import RunConfig
from ...errors import TrainingError, UsageError
from ..plan.topology import Topology
from ..wire import TAG_GATHER, TAG_GRAD, TAG_INTRA, FrameLength, is_error_frame
from .build import hierarchical_exchange
from .colocated import Colocated, ColocatedRank0, ColocatedWorker
from .device import finite
from .intra import IntraCodec
from .way import Rank0Parts, WorkerParts

__all__ = ["Hierarchical", "HierarchicalWorker", "HierarchicalRank0", "run_topology", "slice_bytes", "slice_shards",
           "silence"]


def run_topology(config: RunConfig, workers: int) -> Topology:
    """The run's nodes as the launch resolved them (``config.topology``), else (an in-process
    run) from ``config.ranks_per_node``."""
    topology = config.topology
    if topology is None:
        if not isinstance(config.ranks_per_node, int):
            raise UsageError("--ranks-per-node auto is resolved at launch: give a number for an in-process run")
        topology = Topology(workers, config.ranks_per_node, "declared")
    return topology


def slice_shards(topology: Topology, local: int) -> list[int]:
    """The shards of slice ``local``: those its workers (local rank ``local`` of each node) serve."""
    return topology.cross_group(local)


def slice_bytes(topology: Topology, shards, intra_codec: str) -> tuple[int, ...]:
    """The bytes of each slice (local rank 0, 1, ...) as a node's workers send it each other at
    ``intra_codec``: one message of the reduce-scatter or the all-gather."""
    codec = IntraCodec(intra_codec)
    return tuple(codec.nbytes(sum(piece.size for s in slice_shards(topology, i) for piece in shards[s].pieces))
                 for i in range(topology.ranks_per_node))


def silence(ranks, verb: str, what: str, m: int, node: bool = True) -> str:
    """The line for the workers ``ranks`` (``node``: of this worker's node) that did not send
    (``verb`` "sent") or take ("took") a ``what`` of iteration m ("slice", "average slice"
    inside the node; "gradient", "shard" across): a timeout names them so, on the sequential
    and the pipelined hierarchical exchange alike."""
    return f"{'node worker' if node else 'worker'} rank(s) {', '.join(map(str, ranks))} {verb} no {what} for iteration {m}"


class Hierarchical(Colocated):
    """Colocated servers in nodes of several workers: reduce-scatter, slices across, all-gather."""

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return hierarchical_exchange(config) and not config.pipeline

    def worker(self, parts: WorkerParts) -> "HierarchicalWorker":
        return HierarchicalWorker(parts)

    def rank0(self, parts: Rank0Parts) -> "HierarchicalRank0":
        return HierarchicalRank0(parts)


class HierarchicalWorker(ColocatedWorker):
    """A worker of local rank j on node k: it serves its shard among the workers of local
    rank j, and the node's slice j inside the node."""

    def __init__(self, parts: WorkerParts):
        if parts.config.pipeline and parts.replica.device.type != "cpu":  # an in-process run, which no launch checked
            raise UsageError(f"--exchange hierarchical with --pipeline and --device {parts.replica.device.type} is not "
                             "built yet: drop --pipeline, or use --device cpu")
        channel = parts.channel
        workers = list(channel.workers)
        topology = run_topology(parts.config, len(workers))
        index = workers.index(channel.rank)
        self.topology, self.local = topology, topology.local_rank(index)
        #: The node's workers' ranks in local-rank order, and this worker's slice of every shard.
        self.node_ranks = [workers[w] for w in topology.node_workers(topology.node_of(index))]
        super().__init__(parts)
        self.codec_slices = [[self.shards[s] for s in slice_shards(topology, i)] for i in range(topology.ranks_per_node)]
        self.slice_pieces = [[piece for shard in shards for piece in shard.pieces] for shards in self.codec_slices]
        self.slice_sizes = [sum(piece.size for piece in pieces) for pieces in self.slice_pieces]
        self.intra = IntraCodec(parts.config.intra_codec)
        L = topology.ranks_per_node
        self.peers = [i for i in range(L) if i != self.local]
        self.send_slices = {i: self.intra.buffer(self.slice_sizes[i]) for i in self.peers}
        self.recv_slices = {i: self.intra.buffer(self.slice_sizes[self.local]) for i in self.peers}
        self.own_slice = self.intra.buffer(self.slice_sizes[self.local])
        self.gathered = {i: self.intra.buffer(self.slice_sizes[i]) for i in self.peers}
        self.node_mean = np.zeros(parts.replica.layout.total, np.float32)
        self._scratch = np.empty(self.slice_sizes[self.local], np.float32)
        #: float32 staging of a slice sent at fp16 or bf16, one per slice size (no allocation per iteration)
        self._staging = {n: np.empty(n, np.float32) for n in set(self.slice_sizes)}

    # ---- the reduce-scatter inside the node ------------------------------------------------
    def gradients(self, m: int) -> None:
        """The reduce-scatter, then the frames of this node's mean of the slice: the codec's
        encode seconds are the encode's alone (the reduce-scatter's wait is communication,
        which the clock charges as such)."""
        node_mean = self.frame_gradient(m)
        frames = self.encode_gradient(lambda: node_mean, self.codec_slices[self.local])
        if frames and is_error_frame(frames[0]):
            self.refuse_non_finite(m)
        self.post(m, frames, TAG_GRAD, "gradient", self.aggregator)

    frame_gradient_communicates = True

    def refuse_non_finite(self, m: int) -> None:
        """The node's mean is not finite: TrainingError naming whose slice made it so."""
        raise TrainingError(self._non_finite(m))

    def _non_finite(self, m: int) -> str:
        """The line for a node mean that is not finite: the first node worker whose slice
        (this worker's own, or one received) holds a value that is not (the servers would
        name this worker, whose frames carry the node's mean)."""
        for i in range(self.topology.ranks_per_node):
            part = self._scratch if i == self.local else self.intra.decode(self.recv_slices[i])
            if not finite(part):
                return f"worker rank {self.node_ranks[i]} computed a non-finite gradient at iteration {m}"
        return f"worker rank {self.rank} computed a non-finite gradient at iteration {m}"

    def frame_gradient(self, m: int) -> np.ndarray:
        """Reduce-scatter this iteration's gradient inside the node; return ``node_mean``,
        whose slice ``local`` holds the node's mean (the rest is not read)."""
        grad = self.parts.gradient()
        for i in self.peers:
            self._pack(grad, self.slice_pieces[i], self.send_slices[i])
            if self.intra.name == "fp16" and not finite(self.send_slices[i]):
                self._check_half_range(m, self.send_slices[i].size)
        pending = self.channel.start_send([(self.send_slices[i], self.node_ranks[i]) for i in self.peers],
                                          TAG_INTRA)
        self.channel.recv([(self.recv_slices[i], self.node_ranks[i]) for i in self.peers], TAG_INTRA,
                          lambda pending: silence(pending, "sent", "slice", m))
        own = self._scratch
        self._pack(grad, self.slice_pieces[self.local], own)
        total = None
        for i in range(self.topology.ranks_per_node):  # local-rank order: the same float sum on any run
            part = own if i == self.local else self.intra.decode(self.recv_slices[i])
            total = part.copy() if total is None else np.add(total, part, out=total)
        np.multiply(total, np.float32(1.0 / self.topology.ranks_per_node), out=total)
        self._unpack(total, self.slice_pieces[self.local], self.node_mean)
        self.channel.finish_send(pending, lambda pending: silence(pending, "took", "slice", m))
        return self.node_mean

    # ---- the all-gather inside the node ----------------------------------------------------
    def broadcast(self, m: int) -> None:
        super().broadcast(m)
        self.gather_update(m)

    def gather_update(self, m: int) -> None:
        """The all-gather inside the node of the decoded update: this worker's slice to the
        node's others (rounded to ``--intra-codec`` on the owner too), theirs into its update."""
        update = self.replica.codec_update
        own = self._scratch
        self._pack(update, self.slice_pieces[self.local], own)
        self.intra.encode(own, self.own_slice)
        if self.intra.name == "fp16" and not finite(self.own_slice) and finite(own):
            raise TrainingError(f"worker rank {self.rank}: the average update reaches {float(np.abs(own).max()):.3g} "
                                f"at iteration {m}, beyond fp16's range (65504) inside its node: use --intra-codec "
                                "bf16 or fp32")
        if self.intra.name != "fp32":  # the owner applies what its node receives
            self._unpack(self.intra.decode(self.own_slice), self.slice_pieces[self.local], update)
        pending = self.channel.start_send([(self.own_slice, self.node_ranks[i]) for i in self.peers], TAG_GATHER)
        self.channel.recv([(self.gathered[i], self.node_ranks[i]) for i in self.peers], TAG_GATHER,
                          lambda pending: silence(pending, "sent", "average slice", m))
        for i in self.peers:
            self._unpack(self.intra.decode(self.gathered[i]), self.slice_pieces[i], update)
        self.channel.finish_send(pending, lambda pending: silence(pending, "took", "average slice", m))

    def exchange_groups(self, channel) -> tuple[list[int], list[int], list[int]]:
        """Slice ``local``'s shards, the workers of local rank ``local`` (who send this worker
        their nodes' frames of its shard), and those of them but this one (its average's)."""
        shards = slice_shards(self.topology, self.local)
        ranks = [channel.workers[w] for w in shards]
        return shards, ranks, [rank for rank in ranks if rank != channel.rank]

    def sizes_by_worker(self, sizes: list[int]) -> list[int]:
        """One entry per worker: the frame of each node's worker of this local rank, 0 for the rest."""
        by_rank = dict(zip(self.contributors, sizes))
        return [by_rank.get(rank, 0) for rank in self.channel.workers]

    def _check_half_range(self, m: int, n: int) -> None:
        """A slice that fp16 made infinite (its float32 values were finite, beyond 65504):
        TrainingError naming this worker and the way out; a slice already not finite goes on
        (the node's owner names it)."""
        values = self._staging[n]
        if finite(values):
            raise TrainingError(f"worker rank {self.rank}: its gradient reaches {float(np.abs(values).max()):.3g} at "
                                f"iteration {m}, beyond fp16's range (65504) inside its node: use --intra-codec "
                                "bf16 or fp32")

    def _pack(self, source: np.ndarray, pieces, out: np.ndarray) -> None:
        """``source``'s elements of ``pieces``, one after another, into ``out`` (at its precision)."""
        pos = 0
        if out.dtype == np.float32:
            for piece in pieces:
                out[pos:pos + piece.size] = source[piece.offset:piece.offset + piece.size]
                pos += piece.size
            return
        values = self._staging[sum(piece.size for piece in pieces)]
        self._pack(source, pieces, values)
        self.intra.encode(values, out)

    @staticmethod
    def _unpack(values: np.ndarray, pieces, out: np.ndarray) -> None:
        pos = 0
        for piece in pieces:
            out[piece.offset:piece.offset + piece.size] = values[pos:pos + piece.size]
            pos += piece.size


class HierarchicalRank0(ColocatedRank0):
    """Rank 0 of the hierarchical exchange: as the flat colocated one's, with the slices'
    bytes for the clock (the same every iteration: the layout's and ``--intra-codec``'s)."""

    def __init__(self, parts: Rank0Parts):
        super().__init__(parts)
        topology = run_topology(parts.config, self.workers)
        self.slice_bytes = slice_bytes(topology, self.shards, parts.config.intra_codec)

    def charge(self, m: int) -> None:
        """The reduce-scatter, the gradient round, the broadcast within each local rank, the
        all-gather: in the order ``LinkModel.comm_seconds`` charges a hierarchical traffic."""
        self.clock.intra("intra_reduce", self.slice_bytes)
        self.clock.gradients([r.sizes for r in self.server_reports])
        self.clock.broadcasts([FrameLength.NBYTES + n for n in self.frame_bytes], hierarchical=True)
        self.clock.intra("intra_gather", self.slice_bytes)

    def traffic(self, m: int, ahead: bool):
        traffic, frames_down = super().traffic(m, ahead)
        return dataclasses.replace(traffic, hierarchical=True, slice_bytes=self.slice_bytes), frames_down
