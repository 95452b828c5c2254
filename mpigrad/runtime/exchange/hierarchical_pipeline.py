"""The pipelined hierarchical iteration (``--pipeline`` with ``--exchange hierarchical``):
the hierarchical exchange (:mod:`.hierarchical`) bucket by bucket, as backward produces the
gradient (:mod:`.pipeline`).

The buckets are the flat pipeline's (:func:`~.layout.pipeline_buckets`): each is one shard's
part, so it belongs to one slice, that of the local rank j whose workers serve its shard.
Bucket b of shard s, on node k:

1. *reduce-scatter*, from backward's hooks: when backward has produced bucket b (and every
   earlier one), each worker of node k but its local rank j packs the bucket's values at
   ``--intra-codec`` precision and sends them to local rank j (message 12, ``TAG_INTRA``);
2. *node mean and frame*, from the hooks as soon as the L - 1 parts are in (and after
   backward for those still out): local rank j adds the node's L parts in local-rank order
   (float32; its own exact), takes their mean, encodes the bucket's frame at the Control's
   bits (error feedback as with the sequential run) and sends it to the worker serving
   shard s (message 3 within local rank j);
3. after backward, *serve*: the worker of shard s adds the N nodes' frames of bucket b in
   rank order, averages, re-encodes and sends the average to the other workers of local
   rank j (message 4), each of which decodes it into its update;
4. *all-gather*: each worker of local rank j, once bucket b's average is decoded (and its
   earlier slice buckets have gone), rounds it to ``--intra-codec`` on itself too and sends
   it to its node's other workers (message 12, ``TAG_GATHER``), who decode it into their
   update; each worker applies a bucket's update once its values are in.

Every float operation is the sequential hierarchical run's on the same elements in the same
order (the node's sum is elementwise, the codecs encode piece by piece, the update rule
steps piece by piece), so the losses are the same bit for bit. What overlaps: steps 1 and 2
run during backward (the node's intra links and the frames across NICs of bucket b while
backward makes bucket b + 1); 3 and 4 follow backward, bucket by bucket, each as soon as its
messages are in. ``--intra-codec int8`` is the exception: a bucket's message is cut into its
own blocks of 256 values from its first one (a message cannot hold the scale of a block that
runs on into the next bucket), where the sequential run's blocks run across the whole slice,
so the two runs' roundings inside the node differ (both at most half a block's step from
the value) and so do their losses after the first update, unless every bucket starts at a
multiple of 256 values of its slice; the bytes inside the node are each bucket's
(``bucket_intra_bytes``: a few scales more than the slice's).

Rank 0 charges the whole iteration in ``reports`` (``LinkModel.pipelined`` with the
traffic's ``intra``: the reduce-scatter's and all-gather's messages on the nodes' intra-node
links, the frames and averages on their NICs, :class:`~mpigrad.clockmodel.Nodes`); the
record's node columns are that overlapped schedule's (``pipelined_hierarchical_round``). A
timeout names the silent peers as the sequential run does (:func:`.hierarchical.silence`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ...codecs import CodecError
from ...config import RunConfig
from ...errors import TrainingError
from ..wire import TAG_BCAST, TAG_GATHER, TAG_GRAD, TAG_INTRA, FrameError
from ..plan.layout import bucket_shards
from ..wire.channel import Backoff
from .build import hierarchical_exchange
from .device import finite
from .hierarchical import HierarchicalWorker, run_topology, silence, slice_bytes
from .intra import IntraCodec
from .pipeline import PipelinedRank0, PipelinedWorker
from .way import Rank0Parts, Way, WorkerParts

__all__ = ["HierarchicalPipelined", "HierarchicalPipelinedWorker", "HierarchicalPipelinedRank0",
           "bucket_intra_bytes"]


def bucket_intra_bytes(buckets, intra_codec: str) -> tuple[int, ...]:
    """The bytes of each bucket's message inside a node (a reduce-scatter's part, an
    all-gather's average) at ``intra_codec``."""
    codec = IntraCodec(intra_codec)
    return tuple(codec.nbytes(sum(p.size for p in parts[s].pieces))
                 for parts, s in zip(buckets, bucket_shards(buckets)))


class HierarchicalPipelined(Way):
    """The hierarchical exchange, pipelined bucket by bucket in backward."""

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return hierarchical_exchange(config) and config.pipeline

    def worker(self, parts: WorkerParts) -> "HierarchicalPipelinedWorker":
        return HierarchicalPipelinedWorker(parts)

    def rank0(self, parts: Rank0Parts) -> "HierarchicalPipelinedRank0":
        return HierarchicalPipelinedRank0(parts)


class HierarchicalPipelinedWorker(PipelinedWorker, HierarchicalWorker):
    """A worker of local rank j on node k, pipelined: its buckets' parts to their slices'
    owners in its node from backward's hooks; its slice's node means encoded and sent across
    as their parts come in; after backward its shard served, its slice's averages gathered
    to its node, bucket by bucket. State per iteration: the pointers of its slice's buckets
    (``next_mean``: the next node mean to make; ``next_gather``: the next average to send
    its node) and the receives."""

    def __init__(self, parts: WorkerParts):
        super().__init__(parts)
        topology = self.topology
        self.bucket_shard = bucket_shards(self.buckets)
        self.bucket_part = [parts_[s] for parts_, s in zip(self.buckets, self.bucket_shard)]
        self.bucket_size = [sum(p.size for p in part.pieces) for part in self.bucket_part]
        #: Each bucket's slice (the local rank serving its shard), and the buckets of each slice in order.
        self.bucket_slice = [topology.local_rank(s) for s in self.bucket_shard]
        self.slice_buckets = [[b for b, i in enumerate(self.bucket_slice) if i == j]
                              for j in range(topology.ranks_per_node)]
        mine = self.slice_buckets[self.local]
        intra, sizes = self.intra, self.bucket_size
        self.reduce_out = {b: intra.buffer(sizes[b]) for b, i in enumerate(self.bucket_slice) if i != self.local}
        self.reduce_in = {(b, i): intra.buffer(sizes[b]) for b in mine for i in self.peers}
        self.gather_out = {b: intra.buffer(sizes[b]) for b in mine}
        self.gather_in = {(b, i): intra.buffer(sizes[b]) for i in self.peers for b in self.slice_buckets[i]}
        self._values = {n: np.empty(n, np.float32) for n in set(sizes)}
        self._staging.update({n: np.empty(n, np.float32) for n in set(sizes) if n not in self._staging})

    # ---- in backward: the reduce-scatter, the node means and their frames -----------------
    def _start_receiving(self) -> None:
        """Take the Control, then post every receive of this iteration: the node's parts of
        this worker's slice, the frames of its shard from the other nodes, the averages of its
        slice's other shards, and the node's averages of the other slices, each in bucket order."""
        self.parts.take_control(self.m)
        bits, channel, node = self.control_msg.bits, self.channel, self.node_ranks
        mine = self.slice_buckets[self.local]
        self.reduce_index = {}
        items = []
        for b in mine:
            for i in self.peers:
                self.reduce_index[(b, i)] = len(items)
                items.append((self.reduce_in[(b, i)].view(np.uint8), node[i]))  # start_recv counts bytes
        self.reduce_recv = channel.start_recv(items, TAG_INTRA)
        others = [rank for rank in self.contributors if rank != self.rank]
        self.own = [b for b in mine if self.bucket_shard[b] == self.served]
        self.frames_in, items = {}, []
        for b in self.own:
            capacity = self.parts.compressor.capacity(self.bucket_part[b], bits)
            for rank in others:
                self.frames_in[(b, rank)] = len(items)
                items.append((self._buffer(("grad", b, rank), capacity), rank))
        self.grad_recv = channel.start_recv(items, TAG_GRAD)
        self.averages_in, items = {}, []
        for b in mine:
            s = self.bucket_shard[b]
            if s != self.served:
                self.averages_in[(b, s)] = len(items)
                capacity = self.aggregator.broadcast_capacity(bits, self.bucket_part[b])
                items.append((self._buffer(("avg", b, s), capacity), self.server_ranks[s]))
        self.avg_recv = channel.start_recv(items, TAG_BCAST)
        self.gather_index, items = {}, []
        for i in self.peers:
            for b in self.slice_buckets[i]:
                self.gather_index[(b, i)] = len(items)
                items.append((self.gather_in[(b, i)].view(np.uint8), node[i]))
        self.gather_recv = channel.start_recv(items, TAG_GATHER)
        self.next_mean = 0

    def _send(self, b: int) -> None:
        """Bucket b is produced: its values to its slice's owner in this node (at
        ``--intra-codec``), or, for this worker's own slice, kept for the node mean."""
        i = self.bucket_slice[b]
        if i == self.local:
            return
        grad = self.replica.codec_gradient(self.bucket_part[b].pieces)
        out = self.reduce_out[b]
        self._pack(grad, self.bucket_part[b].pieces, out)
        if self.intra.name == "fp16" and not finite(out):
            self._check_half_range(self.m, self.bucket_size[b])
        self.sends.append(self.channel.start_send([(out.view(np.uint8), self.node_ranks[i])], TAG_INTRA))

    def _post_done(self) -> bool:
        """Make the node means of this worker's slice whose parts are all in, in bucket
        order, and send their frames; whether one was made."""
        made = False
        if self.next_bucket == 0:  # nothing produced yet: the receives are not posted
            return made
        mine = self.slice_buckets[self.local]
        while self.next_mean < len(mine):
            b = mine[self.next_mean]
            if b >= self.next_bucket or not all(self.channel.received(self.reduce_recv, self.reduce_index[(b, i)])
                                                is not None for i in self.peers):
                break
            self._frame_of_node_mean(b)
            self.next_mean += 1
            made = True
        return made

    def _frame_of_node_mean(self, b: int) -> None:
        """Bucket b's node mean (the node's L parts added in local-rank order, times 1 / L,
        as the sequential reduce-scatter does), encoded and sent to its shard's server. The
        encode's seconds are the codec's alone, as the sequential run's: the parts' decodes
        and sum are the reduce-scatter's."""
        part, n = self.bucket_part[b], self.bucket_size[b]
        own = self._values[n]
        self._pack(self.replica.codec_gradient(part.pieces), part.pieces, own)
        total = None
        for i in range(self.topology.ranks_per_node):  # local-rank order: the same float sum on any run
            value = own if i == self.local else self.intra.decode(self.reduce_in[(b, i)])
            total = value.copy() if total is None else np.add(total, value, out=total)
        np.multiply(total, np.float32(1.0 / self.topology.ranks_per_node), out=total)
        self._unpack(total, part.pieces, self.node_mean)
        start = time.process_time()
        try:
            frame = self.parts.compressor.encode(self.node_mean, self.control_msg.bits, part)
            self.encode_seconds += time.process_time() - start
        except CodecError:
            if finite(total):
                raise
            raise TrainingError(self._bucket_non_finite(b, own)) from None
        self._post(b, [(self.bucket_shard[b], frame)])

    def _bucket_non_finite(self, b: int, own: np.ndarray) -> str:
        """The line for a node mean of bucket b that is not finite: the first node worker
        whose part holds a value that is not."""
        for i in range(self.topology.ranks_per_node):
            value = own if i == self.local else self.intra.decode(self.reduce_in[(b, i)])
            if not finite(value):
                return f"worker rank {self.node_ranks[i]} computed a non-finite gradient at iteration {self.m}"
        return f"worker rank {self.rank} computed a non-finite gradient at iteration {self.m}"

    # ---- after backward: serve, take the averages, gather them in the node -------------
    def exchange(self) -> None:
        """Make the node means still to make, serve this worker's shard, decode its slice's
        averages, gather them in the node and take the node's others, bucket by bucket as the
        messages arrive; apply each bucket's update once its values are in."""
        m, channel = self.m, self.channel
        bits = self.control_msg.bits
        update = self.replica.codec_update
        decoder = self.parts.broadcast_decoder
        others = self.broadcast_peers
        self.sizes_by_rank = {rank: 0 for rank in channel.workers}
        self.t_decode = self.t_encode = 0.0
        self.bucket_bytes = 0
        self.bcast = [0] * len(self.buckets)
        mine = self.slice_buckets[self.local]
        decoded = set()  # this worker's slice buckets whose average is in its update
        own, averages, gathered = list(self.own), dict(self.averages_in), dict(self.gather_index)
        self.next_gather = 0
        stalled = lambda: self._silent_peers(mine, own, averages, gathered)  # noqa: E731
        backoff = Backoff(channel.timeout, stalled)
        while self.next_mean < len(mine) or own or averages or self.next_gather < len(mine) or gathered:
            progressed = self._post_done()
            if own and own[0] in self.own_frames:
                b = own[0]
                counts = {rank: channel.received(self.grad_recv, self.frames_in[(b, rank)])
                          for rank in self.contributors if rank != self.rank}
                if all(n is not None for n in counts.values()):
                    frames = [(rank, self.own_frames[b] if rank == self.rank else
                               self.pipeline_buffers[("grad", b, rank)][:counts[rank]]) for rank in self.contributors]
                    self._average(b, frames, bits, others)
                    decoded.add(b)
                    own.pop(0)
                    progressed = True
            waiting_on = set()  # a source's averages come in bucket order: test only its oldest
            for (b, s), index in list(averages.items()):
                if s in waiting_on:
                    continue
                count = channel.received(self.avg_recv, index)
                if count is None:
                    waiting_on.add(s)
                    continue
                start = time.process_time()
                try:
                    decoder.decode(self.pipeline_buffers[("avg", b, s)][:count], self.bucket_part[b], update)
                except (CodecError, FrameError) as exc:
                    raise RuntimeError(f"bad shard frame from worker rank {self.server_ranks[s]} at iteration "
                                       f"{m}: {exc}") from None
                self.t_decode += time.process_time() - start
                del averages[(b, s)]
                decoded.add(b)
                progressed = True
            while self.next_gather < len(mine) and mine[self.next_gather] in decoded:
                self._gather(mine[self.next_gather], update)
                self.next_gather += 1
                progressed = True
            waiting_on = set()
            for (b, i), index in list(gathered.items()):
                if i in waiting_on:
                    continue
                if channel.received(self.gather_recv, index) is None:
                    waiting_on.add(i)
                    continue
                # the all-gather's decode: not the codecs' (t_decode), as the sequential run's
                self._unpack(self.intra.decode(self.gather_in[(b, i)]), self.bucket_part[b].pieces, update)
                del gathered[(b, i)]
                self._apply(b)
                progressed = True
            if progressed:
                backoff = Backoff(channel.timeout, stalled)
            else:
                for pending in self.sends:
                    channel.test_send(pending)
                backoff.sleep()
        for pending in self.sends:
            channel.finish_send(pending, lambda pending: self._by_node(pending, "took", "message"))

    def _silent_peers(self, mine, own, averages, gathered) -> str:
        """A timeout's line: the peers whose messages of this iteration are not in, as the
        sequential run names them (:func:`.hierarchical.silence`): the node's workers whose
        parts of this worker's slice or averages of theirs, and the other nodes' workers whose
        frames of its shard or averages of its slice, did not come."""
        m, received, node = self.m, self.channel.received, self.node_ranks
        parts = sorted({node[i] for b in mine[self.next_mean:] for i in self.peers
                        if received(self.reduce_recv, self.reduce_index[(b, i)]) is None})
        frames = sorted({rank for b in own for rank in self.contributors if rank != self.rank
                         and received(self.grad_recv, self.frames_in[(b, rank)]) is None})
        shards = sorted({self.server_ranks[s] for (b, s), index in averages.items()
                         if received(self.avg_recv, index) is None})
        slices = sorted({node[i] for (b, i), index in gathered.items() if received(self.gather_recv, index) is None})
        lines = [silence(ranks, "sent", what, m, inside) for ranks, what, inside in [
            (parts, "slice", True), (frames, "gradient", False), (shards, "shard", False),
            (slices, "average slice", True)] if ranks]
        return "; ".join(lines) or f"worker rank {self.rank}: the messages of iteration {m} did not all arrive"

    def _by_node(self, ranks, verb: str, what: str) -> str:
        """``silence``'s line for ``ranks``, those of this worker's node and the others apart."""
        node = [rank for rank in ranks if rank in self.node_ranks]
        other = [rank for rank in ranks if rank not in self.node_ranks]
        return "; ".join([*([silence(node, verb, what, self.m)] if node else []),
                          *([silence(other, verb, what, self.m, node=False)] if other else [])])

    def _gather(self, b: int, update: np.ndarray) -> None:
        """Bucket b's average of this worker's slice to its node's other workers, rounded to
        ``--intra-codec`` here too (every worker applies the same values); then applied."""
        part, n = self.bucket_part[b], self.bucket_size[b]
        values, out = self._values[n], self.gather_out[b]
        self._pack(update, part.pieces, values)
        self.intra.encode(values, out)
        if self.intra.name == "fp16" and not finite(out) and finite(values):
            raise TrainingError(f"worker rank {self.rank}: the average update reaches "
                                f"{float(np.abs(values).max()):.3g} at iteration {self.m}, beyond fp16's range "
                                "(65504) inside its node: use --intra-codec bf16 or fp32")
        if self.intra.name != "fp32":  # the owner applies what its node receives
            self._unpack(self.intra.decode(out), part.pieces, update)
        self.sends.append(self.channel.start_send([(out.view(np.uint8), self.node_ranks[i]) for i in self.peers],
                                                  TAG_GATHER))
        self._apply(b)

    def _apply(self, b: int) -> None:
        """Bucket b's values are in the update: apply it there (a script's optimizer applies
        the whole update after backward)."""
        if self.parts.applies_update:
            for piece in self.bucket_part[b].pieces:
                self.replica.step(self.lr, piece.offset, piece.size)


class HierarchicalPipelinedRank0(PipelinedRank0):
    """Rank 0 of the pipelined hierarchical iteration: the pipelined one's, whose charge adds
    each bucket's messages inside the nodes (``PipelinedTraffic.intra``), and whose record's
    traffic is the hierarchical exchange's (its slices' bytes)."""

    def __init__(self, parts: Rank0Parts):
        super().__init__(parts)
        self.slice_bytes = slice_bytes(run_topology(parts.config, self.workers), self.shards, parts.config.intra_codec)
        self.intra_bytes = bucket_intra_bytes(self.buckets, parts.config.intra_codec)

    def traffic(self, m: int, ahead: bool):
        traffic, frames_down = super().traffic(m, ahead)
        return dataclasses.replace(traffic, hierarchical=True, slice_bytes=self.slice_bytes), frames_down
