"""Servers: rank 0 (scheduler, MDP server and server of shard 0) and ranks 1..S-1 (one shard each).

Each server aggregates its shard (BytePS's layout): it receives that slice of every
worker's gradient, decodes and adds the frames in rank order, averages, re-encodes with the
iteration's bits and broadcasts the result to the workers and rank 0. Rank 0 alone gathers
the losses, asks the policy for the bits, decides when to stop, decodes every shard's
broadcast into its replica (for evaluation, checksums and checkpoints) and returns an
:class:`~.record.IterationRecord` per iteration. The phase order is in :mod:`.iteration`.
"""

from __future__ import annotations

import copy
import itertools
import math
import time

import numpy as np
import torch

from ...codecs import CodecError
from ...counters import copied, launched, synchronized
from ...config import RunConfig
from ...units import format_elapsed
from ...errors import TrainingError, UsageError
from ...costmodel import CostModel, LocalWork
from ...policies import Observation, PolicyError, SettingCosts, check_decision, get_policy, policy_class
from ..measure import checkpoint
from ..exchange.build import (SERVER_STREAM, base_codec, broadcast_codec, build_broadcast_compressor, build_compressor,
                              build_factor_shards, build_replica, build_shards, load_data, shard_chunks, release_data,
                              script_replica)
from ..exchange.buffers import BufferSync, ParameterSync, sync_due
from ..plan.checks import cost_model
from ..exchange.broadcast import broadcast_frames, broadcast_widths, frame_sizes
from ..measure.clock import Clocks, IterationClock, IterationTraffic, PipelinedTraffic
from ..plan.layout import pipeline_buckets
from ..plan.environment import threads_per_rank
from ..plan.gpu import workers_device
from .faults import Fault
from ..measure.phaselog import PhaseLog
from .iteration import FollowerRole, run_iteration
from ..measure.record import IterationRecord
from ..measure.tracing import close_seconds
from .stopping import StopFlag
from ..exchange.lowrank import LowRank
from ..wire import (CHECKPOINT_AFTER, CONTINUE, STOP_AFTER, TAG_AVERAGE, TAG_BACKWARD, TAG_FACTORS, TAG_GRAD, TAG_LOSS, TAG_REPORT, TAG_SETTINGS, WORLD,
                    BackwardReport, Channel, Control, FrameError, FrameLength, LossReport, ReceiveBuffers, ServerReport,
                    is_error_frame)


class ShardAggregator:
    """One server's shard: receive, decode-add in rank order, average, re-encode.

    ``decoder`` decodes the workers' frames, ``compressor`` re-encodes the average with the
    broadcast's codec (``--broadcast-codec``; the same object when it is the workers'), at
    ``broadcast_bits`` when fixed, else at the iteration's bits. After ``encode``,
    ``grad_sum`` holds the workers' average of this shard's pieces before the re-encode:
    what the policies observe and what ``norm_ratio`` compares the broadcast with.
    """

    def __init__(self, config: RunConfig, channel: Channel, shard, decoder, compressor, total: int,
                 broadcast_bits: int | None, device: torch.device | None = None):
        """``device``: the sum lives in that device's memory (the device path: ``decoder``
        and ``compressor`` are then device compressors, runtime/exchange/device.py)."""
        self.config, self.channel, self.shard = config, channel, shard
        self.decoder, self.compressor, self.broadcast_bits = decoder, compressor, broadcast_bits
        self.workers = channel.workers
        self.grad_sum = (np.zeros(total, np.float32) if device is None
                         else torch.zeros(total, dtype=torch.float32, device=device))
        self.quantized = [piece for piece in shard.pieces if piece.quantized]
        self.average = np.empty(sum(piece.size for piece in self.quantized), np.float32)
        #: The workers' frames: in pinned memory the device decode copies from, on the device path.
        self.recv_buffers = ReceiveBuffers(self.workers, decoder.frame_memory)
        self.frame_len = FrameLength.buffer()
        #: A server that broadcasts to its group (rank 0, ``ShardServer``; colocated workers
        #: send point to point): after a whole-shard ``encode``, the broadcast's message,
        #: ``FrameLength`` then the frame (``self.frame`` is its tail), one buffer reused.
        self.broadcasts = not channel.colocated
        self._message = np.empty(0, np.uint8)
        self.message = self._message
        self.frame: np.ndarray | None = None

    def aggregate(self, m: int, local: tuple[int, np.ndarray] | None = None,
                  tag: int = TAG_GRAD) -> tuple[list[int], float, float]:
        """Receive and sum every worker's frame of this shard; return (bytes per worker,
        slowest worker's encode s, decode CPU s). ``local``: (this rank, its own frame) for a
        worker that serves a shard (colocated): that frame is not received but taken as is.
        ``tag``: the round's (TAG_FACTORS for a two-round codec's second).

        Frames are decoded as they arrive but added in rank order (a frame that overtakes a
        lower rank's waits, still encoded, in its receive buffer), so the float sum, and with
        it the whole run, does not depend on arrival order. The first worker decodes straight
        into the sum, the others add to it as they decode (``accumulate=True``).
        """
        sizes = {}
        encode_max = decode_seconds = 0.0
        arrived: dict[int, np.ndarray] = dict([local]) if local is not None else {}
        remote = [rank for rank in self.workers if rank not in arrived]
        order = iter(self.workers)
        next_rank = next(order)
        first = next_rank
        describe = lambda pending: (f"worker rank(s) {', '.join(map(str, pending))} sent no gradient "  # noqa: E731
                                    f"for iteration {m}")
        received = self.channel.frames(remote, tag, self.recv_buffers, describe)
        for rank, frame in itertools.chain(list(arrived.items()), received):
            if is_error_frame(frame):
                raise TrainingError(f"worker rank {rank} computed a non-finite gradient at iteration {m}")
            sizes[rank] = frame.size
            arrived[rank] = frame
            while next_rank in arrived:
                start = time.process_time()
                try:
                    encode_seconds = self.decoder.decode(arrived.pop(next_rank), self.shard, self.grad_sum,
                                                            accumulate=next_rank != first)
                except (CodecError, FrameError) as exc:
                    raise TrainingError(f"bad gradient frame from worker rank {next_rank} at iteration "
                                        f"{m}: {exc}") from None
                decode_seconds += time.process_time() - start
                encode_max = max(encode_max, encode_seconds)
                next_rank = next(order, None)
        return [sizes[rank] for rank in self.workers], encode_max, decode_seconds

    def encode(self, bits: list[int], transform=None, shard=None) -> float:
        """Average the sum and re-encode it into ``self.frame``; return the CPU seconds.
        ``transform(average)``, when given, changes the average in place before the encode
        (PowerSGD's orthogonalisation of P). ``shard``: a part of this shard (a pipelined
        bucket's) to average and encode alone; by default the whole shard."""
        start = time.process_time()
        into_message = shard is None and self.broadcasts
        shard = self.shard if shard is None else shard
        scale = np.float32(1.0 / len(self.workers))
        for piece in shard.pieces:
            part = self.grad_sum[piece.offset:piece.offset + piece.size]
            if isinstance(part, torch.Tensor):
                launched("torch")
                part.mul_(scale.item())  # the same float32 product
            else:
                np.multiply(part, scale, out=part)
        if transform is not None:
            transform(self.grad_sum)
        widths = self.broadcast_widths(bits)
        if into_message:  # FrameLength, then the frame
            capacity = FrameLength.NBYTES + self.compressor.capacity(shard, widths)
            if self._message.size < capacity:
                self._message = np.empty(capacity, np.uint8)
            self.frame = self.compressor.encode(self.grad_sum, widths, shard, out=self._message[FrameLength.NBYTES:])
            self.message = self._message[:FrameLength.NBYTES + self.frame.size]
            self.message[:FrameLength.NBYTES].view(np.int64)[0] = self.frame.size
        else:  # in the compressor's buffer of this shard (or pipelined bucket)
            self.frame = self.compressor.encode(self.grad_sum, widths, shard)
        self.frame_len[0] = self.frame.size
        return time.process_time() - start

    def broadcast_widths(self, bits: list[int]) -> list[int]:
        """The widths the broadcast re-encodes at, the iteration's ``bits`` given."""
        return broadcast_widths(bits, self.broadcast_bits)

    def broadcast_capacity(self, bits: list[int], shard) -> int:
        """The largest frame ``encode`` can make of ``shard`` (or a part of it) at ``bits``."""
        return self.compressor.capacity(shard, self.broadcast_widths(bits))

    def broadcast_size(self, bits: list[int]) -> int | None:
        """The size of this shard's frame at ``bits`` where its codecs fix it, else None."""
        return self.compressor.exact_capacity(self.shard, self.broadcast_widths(bits))

    def energies(self, n_layers: int) -> list[float]:
        """||g||^2 of this shard's part of each quantized layer, g the average (after ``encode``)."""
        return self.update_energies(self.grad_sum, n_layers)

    def update_energies(self, update: np.ndarray, n_layers: int) -> list[float]:
        """||Q(g)||^2 of this shard's part of each quantized layer, Q(g) the decoded broadcast.
        On the device path each piece's dot product stays on the device and all are read
        with one synchronisation, however many pieces the shard has (the same floats)."""
        parts = [update[p.offset:p.offset + p.size] for p in self.quantized]
        if parts and isinstance(update, torch.Tensor):
            dots = [torch.dot(u, u) for u in parts]
            launched("torch", len(dots) + (len(dots) > 1))
            synchronized("energy read")  # one read of the device values
            return by_layer(self.quantized, (torch.stack(dots) if len(dots) > 1 else dots[0].reshape(1)).tolist(),
                            n_layers)
        return by_layer(self.quantized, [float(np.dot(u, u)) for u in parts], n_layers)

    def energy_pair(self, update, n_layers: int, wait) -> tuple[list[float], list[float]]:
        """(:meth:`energies`, :meth:`update_energies` of ``update``). On the device path the
        two dot products of every piece stay on the device, copied behind them into pinned
        memory, and ``wait()`` (the rank's one read of its device status,
        :meth:`~.device.DeviceStatus.wait`) ends the copy: no synchronisation of their own,
        the same floats."""
        if not (self.quantized and isinstance(update, torch.Tensor)):
            return self.energies(n_layers), self.update_energies(update, n_layers)
        dots = [torch.dot(u, u) for source in (self.grad_sum, update)
                for u in (source[p.offset:p.offset + p.size] for p in self.quantized)]
        launched("torch", len(dots) + 2)  # the dot products, their stack and its copy
        values = torch.empty(len(dots), dtype=torch.float32, pin_memory=update.is_cuda)
        values.copy_(torch.stack(dots), non_blocking=True)
        copied("to_host", values.nbytes)
        wait()
        values = values.tolist()
        n = len(self.quantized)
        return by_layer(self.quantized, values[:n], n_layers), by_layer(self.quantized, values[n:], n_layers)

    def pack_average(self) -> np.ndarray:
        """The average of this shard's quantized pieces, in piece order (message 6)."""
        pos = 0
        for piece in self.quantized:
            part = self.grad_sum[piece.offset:piece.offset + piece.size]
            if isinstance(part, torch.Tensor):
                copied("to_host", 4 * piece.size)
                synchronized("average to host")  # a blocking copy, for a policy that reads the average
                part = part.cpu().numpy()
            self.average[pos:pos + piece.size] = part
            pos += piece.size
        return self.average



def by_layer(pieces, values: list[float], n_layers: int) -> list[float]:
    """Each of ``pieces``' value (``values``, in piece order) added into its layer's."""
    energies = [0.0] * n_layers
    for piece, value in zip(pieces, values):
        energies[piece.layer] += value
    return energies


def unpack_average(shard, average: np.ndarray, out: np.ndarray) -> None:
    """Write a server's message 6 for ``shard`` into ``out`` (the whole average's buffer)."""
    pos = 0
    for piece in shard.pieces:
        if piece.quantized:
            out[piece.offset:piece.offset + piece.size] = average[pos:pos + piece.size]
            pos += piece.size


def factor_aggregators(config: RunConfig, channel: Channel, lowrank: LowRank, server: int) -> tuple:
    """Server ``server``'s aggregators of a two-round codec's factors under the running plan
    (``lowrank.current``): (round 1, round 2), built on the plan's first use and kept with it."""
    plan = lowrank.current
    if plan.aggregators is None:
        plan.aggregators = tuple(ShardAggregator(config, channel, shards[server], compressor, compressor, size, None)
                                 for shards, compressor, size in ((plan.rounds[0], plan.compressor1, plan.p_size),
                                                                  (plan.rounds[1], plan.compressor2, plan.q_size)))
    return plan.aggregators


def _stalled(m: int):
    return lambda: f"gradient broadcast of iteration {m} stalled"


class ShardServer(FollowerRole):
    """Rank s in 1..S-1: the server of shard s."""

    def __init__(self, config: RunConfig, channel: Channel, model: torch.nn.Module | None = None):
        """``model``: a script's (:class:`mpigrad.Session`), else the config's is built."""
        self.config, self.channel = config, channel
        self.rank = channel.rank
        if model is not None:
            replica = script_replica(config, model)
        else:
            replica = build_replica(config, load_data(config))
            release_data()  # only the model's shape was needed
        codec = base_codec(config)
        layout = replica.layout
        self.n_layers = len(layout.quantized)
        shard = build_shards(config, layout, codec, channel.servers)[self.rank]
        decoder = build_compressor(config, layout, codec, SERVER_STREAM, channel.servers)
        self.compressor = build_broadcast_compressor(config, codec, decoder)
        self.aggregator = ShardAggregator(config, channel, shard, decoder, self.compressor, layout.total,
                                          broadcast_codec(config)[1])
        #: PowerSGD (two-round codecs): this shard's factor aggregators, one per round.
        self.lowrank = None
        if codec.two_rounds:
            self.lowrank = LowRank(replica.model, layout, codec, config.seed, worker=False,
                                   shards=build_factor_shards(config, layout, codec, channel.servers))
            self.factor_aggregators = factor_aggregators(config, channel, self.lowrank, self.rank)
        #: Rank 0's policy observes the whole average: send it this shard's part (message 6)
        #: (PowerSGD's policies read the workers' setting errors instead, message 11).
        self.send_average = policy_class(config.policy).uses_gradients and not codec.two_rounds
        self.buffer_sync = BufferSync(replica.model, channel)
        self.control_msg = Control(self.n_layers)
        self.report = ServerReport.buffer(len(channel.workers), max(self.n_layers, 1))
        self.iteration = 0
        self.fault = Fault.from_environment(self.rank)
        self.phase_log = PhaseLog.from_environment(self.rank, replica.device)  # MPIGRAD_PHASE_LOG

    def begin(self, m: int) -> None:
        pass

    def losses(self, m: int) -> None:
        pass

    def control(self, m: int) -> None:
        self.channel.broadcast([(self.control_msg.buf, WORLD)],
                               lambda: f"rank 0 sent no bits for iteration {m}")
        self.bits = self.control_msg.bits
        if self._two_rounds(m):  # the iteration's factor plan (settings checked against the menu)
            self.lowrank.select(self.bits)
            self.factor_aggregators = factor_aggregators(self.config, self.channel, self.lowrank, self.rank)

    def _two_rounds(self, m: int) -> bool:
        return self.lowrank is not None and self.lowrank.active(m)

    def gradients(self, m: int) -> None:
        agg = self.factor_aggregators[0] if self._two_rounds(m) else self.aggregator
        self.sizes, self.worker_encode, self.t_decode = agg.aggregate(m)
        self.one_round = not self._two_rounds(m)  # two rounds: no ||g|| to report (norm_ratio NaN)
        self.bytes_out = 0

    def _broadcast(self, m: int, agg: ShardAggregator, transform=None) -> float:
        t_encode = agg.encode(self.bits, transform)
        sizes = {self.rank: agg.broadcast_size(self.bits)}
        broadcast_frames(self.channel, [self.rank], sizes, {self.rank: agg.frame_len}, ReceiveBuffers(),
                         (self.rank, agg.message), _stalled(m))
        self.bytes_out += agg.frame.size + FrameLength.NBYTES
        return t_encode

    def broadcast(self, m: int) -> None:
        if self._two_rounds(m):  # round 1: this shard's P^ (orthogonalised), and the other layers if it holds them
            lowrank = self.lowrank
            self.t_encode = self._broadcast(m, self.factor_aggregators[0],
                                            lowrank.orthogonalizer(lowrank.rounds[0][self.rank]))
            return
        self.t_encode = self._broadcast(m, self.aggregator)

    def gradients2(self, m: int) -> None:
        if self._two_rounds(m):  # round 2: this shard's Q_i
            sizes, encode, decode = self.factor_aggregators[1].aggregate(m, tag=TAG_FACTORS)
            self.sizes = [a + b for a, b in zip(self.sizes, sizes)]
            self.worker_encode += encode
            self.t_decode += decode

    def broadcast2(self, m: int) -> None:
        if self._two_rounds(m):
            self.t_encode += self._broadcast(m, self.factor_aggregators[1])

    def reports(self, m: int) -> None:
        if self.fault:
            self.fault.before_send(m, 0.0, None)
        agg = self.aggregator
        layers = max(self.n_layers, 1)
        energies = agg.energies(layers) if self.one_round and self.config.norm_due(m) else [0.0] * layers
        ServerReport(self.bytes_out, self.t_decode, self.t_encode, self.worker_encode,
                     self.sizes, energies, [0.0] * layers).pack(self.report)
        self.channel.send([(self.report, 0)], TAG_REPORT,
                          lambda pending: f"rank 0 took no report for iteration {m}")
        if self.send_average:
            self.channel.send([(agg.pack_average(), 0)], TAG_AVERAGE,
                              lambda pending: f"rank 0 took no average for iteration {m}")

    def end(self, m: int) -> bool:
        self.iteration = m + 1
        return self.control_msg.command == STOP_AFTER

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state["compressor"])


class ParameterServer:
    """Rank 0: drives the iterations (losses in, bits out) and serves shard 0."""

    def __init__(self, config: RunConfig, channel: Channel, stop: StopFlag, log=print,
                 model: torch.nn.Module | None = None):
        """``model``: a script's (:class:`mpigrad.Session`): its loop owns the data, the
        optimizer and the evaluation, so rank 0 applies no update and evaluates nothing (its
        replica gives the layout; colocated, it takes the workers' parameters when due)."""
        self.config, self.channel, self.stop, self.log = config, channel, stop, log
        self.servers = channel.servers
        self.worker_ranks = channel.workers
        self.workers = len(self.worker_ranks)
        #: Whether a script's loop trains (``model`` given): the workers' optimizer is not known here.
        self.script = model is not None
        if self.script:
            self.data_description = "the script's data"
            self.replica = script_replica(config, model)
            self.dataset = None
        else:
            dataset = load_data(config)
            self.data_description = dataset.describe()
            self.replica = build_replica(config, dataset, self.workers, self.servers)
            # Rank 0 evaluates on the test split only: let the training split go (in-process
            # ranks build their own parts before rank 0 does).
            self.dataset = copy.copy(dataset)
            self.dataset.train_x, self.dataset.train_y = dataset.train_x[:0], dataset.train_y[:0]
            release_data()
        self.codec = base_codec(config)
        layout = self.replica.layout
        self.n_layers = len(layout.quantized)
        self.policy = get_policy(config.policy_config(), n_layers=max(self.n_layers, 1), seed=config.seed)
        self.policy.setup_codec(self.codec)
        self.chunks = shard_chunks(config, layout, self.servers)
        self.shards = build_shards(config, layout, self.codec, self.servers)
        self.colocated = channel.colocated
        #: Shards other ranks serve, and the rank serving each: with colocated servers every
        #: shard (rank 0 serves none, holds parameters only after a synchronisation), else 1..S-1.
        self.remote_shards = list(range(0 if self.colocated else 1, self.servers))
        self.server_of = channel.server_ranks
        if self.colocated:
            self.compressor = self.aggregator = None
            self.average = np.zeros(layout.total, np.float32)
        else:
            decoder = build_compressor(config, layout, self.codec, SERVER_STREAM, self.servers)
            self.compressor = build_broadcast_compressor(config, self.codec, decoder)
            self.aggregator = ShardAggregator(config, channel, self.shards[0], decoder, self.compressor,
                                              layout.total, broadcast_codec(config)[1])
            self.average = self.aggregator.grad_sum
        #: PowerSGD (two-round codecs, --servers 1): its factor layouts and one aggregator per round.
        self.lowrank = None
        if self.codec.two_rounds:  # colocated: for the frames' sizes only (the workers serve every shard)
            self.lowrank = lowrank = LowRank(self.replica.model, layout, self.codec, config.seed, worker=False,
                                             shards=build_factor_shards(config, layout, self.codec, self.servers))
            if self.aggregator is not None:
                self.factor_aggregators = factor_aggregators(config, channel, lowrank, 0)
        # The other servers send their part of the average (message 6) when the policy
        # observes it: self.average is then the whole average, as with S = 1.
        self.receive_averages = bool(self.remote_shards) and self.policy.uses_gradients and not self.codec.two_rounds
        #: PowerSGD with menus: the workers' mean errors at each setting (message 11), the
        #: settings' bytes, for the policy's next decision (None until measured).
        self.mixed = self.lowrank is not None and self.codec.mixed
        self.setting_errors: np.ndarray | None = None
        self.setting_sizes = self.lowrank.setting_sizes() if self.mixed else None
        self.setting_rows = [np.zeros((self.n_layers, len(self.codec.menu))) for _ in self.worker_ranks] \
            if self.mixed else []
        self.averages = {s: np.empty(sum(p.size for p in self.shards[s].pieces if p.quantized), np.float32)
                         for s in self.remote_shards} if self.receive_averages else {}
        self.parameter_sync = ParameterSync(self.replica, channel) if self.colocated else None
        #: The pipelined iteration (--pipeline): its buckets, for the workers' backward reports.
        self.buckets = pipeline_buckets(self.shards) if config.pipeline else None
        if self.buckets is not None:
            self.backward_rows = BackwardReport.buffer(len(self.buckets), self.servers, rows=self.workers)
        self.buffer_sync = BufferSync(self.replica.model, channel)
        link = config.link_model()
        # Workers' compute in CPU seconds only where they compute on the CPU (rank 0's replica
        # stays on the CPU with colocated servers even when the workers train on GPUs).
        cpu_clock = threads_per_rank(config.threads) == 1 and workers_device(config) == "cpu"
        self.clock = IterationClock(link, self.workers, self.servers, cpu_clock, config.compute_time,
                                    colocated=self.colocated, cost_model=cost_model(config),
                                    local_work=self._local_work())
        self.saved_clocks = {"wall": 0.0, "sim": 0.0}
        self.phase_log = PhaseLog.from_environment(0, self.replica.device)  # MPIGRAD_PHASE_LOG
        self.iteration = 0
        # Time kept in hand for the stop itself: gathering worker state and writing it.
        memories = config.error_feedback != "none" or self.codec.two_rounds  # PowerSGD's error memories
        copies = 1 + self.policy.uses_gradients + (self.workers + 1) * memories
        state_bytes = 4 * layout.total * copies
        self.checkpoint_reserve = 2.0 + 2 * state_bytes / 200e6
        self.last_iteration_ms = 0.0
        self.last_comm_ms, self.last_bytes = 0.0, 0  # iteration m-1's, for Observation
        self.checkpoint_schedule = checkpoint.Schedule(config.checkpoint_interval)
        self.command = CONTINUE
        self.bytes_total = 0      # both directions, all sessions of the run (progress "sent")
        self.last_eval: tuple[int, float, float] | None = None  # (iteration, test loss, accuracy)
        self.warned_not_learning = False
        # Reused buffers: nothing gradient-sized is allocated per iteration.
        self.update = self.replica.update_host
        self.has_previous = False
        self.loss_rows = LossReport.buffer(self.workers)
        self.control_msg = Control(self.n_layers)
        self.report_rows = (ServerReport.buffer(self.workers, max(self.n_layers, 1), len(self.remote_shards))
                            if self.remote_shards else None)
        self.lengths = {s: FrameLength.buffer() for s in range(1, self.servers)}
        self.frames = ReceiveBuffers(range(1, self.servers))
        self.start_iteration = 0
        self.session_started = time.perf_counter()
        #: Rank 0's CPU time in its iterations this session (its own work: receiving, the
        #: policy, its shard with separate servers, tracing, waits' polls), evaluation excluded.
        self.iteration_cpu_seconds = 0.0
        #: Of which polling while waiting (grows with the time waited, not with the work).
        self.iteration_wait_cpu_seconds = 0.0

    # ---- the phases of one iteration (order: iteration.py) ----------------------------------
    def begin(self, m: int) -> None:
        self.clock.start()
        self.it: dict = {}
        self.lr = self.replica.lr(m, self.config.lr)

    def losses(self, m: int) -> None:
        # control = "ahead": a decision the policy knows before the losses goes out first, so
        # that no worker waits for this gather and the round trip (``control`` then has
        # nothing left to do); decide() still sees the whole observation, below. The broadcast
        # completes here before the loss receives are posted, while each worker's loss send
        # completes before it joins the broadcast: both messages are small (about 100 and 40
        # bytes) and go eagerly in MPICH and Open MPI, which MPI's progress rules allow but do
        # not promise.
        ahead = self.config.control == "ahead" and self.policy.bits_ahead(m)
        self.it["ahead"] = bool(ahead)
        if ahead:
            self._send_control(m, check_decision(self.policy, ahead, m))
        self.channel.recv([(row, rank) for row, rank in zip(self.loss_rows, self.worker_ranks)], TAG_LOSS,
                          lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no loss "
                                          f"for iteration {m}")
        reports = [LossReport.unpack(row) for row in self.loss_rows]
        for rank, report in zip(self.worker_ranks, reports):
            if not report.finite:
                raise TrainingError(f"worker rank {rank} computed a non-finite loss ({report.loss}) "
                                    f"at iteration {m}; lower --lr or check the data")
        if self.script and m == 0 and self.workers > 1 and len({r.loss for r in reports}) == 1:
            self.log(f"mpigrad: warning: the {self.workers} workers' losses at iteration 0 are equal to the last "
                     "bit: do they read the same batches? Give each its own part of the data, e.g. "
                     "DistributedSampler(dataset, num_replicas=session.workers, rank=session.worker_index)")
        self.it["reports"] = reports
        self.it["checksums"] = self._check_replicas(m, reports)
        self.it["loss"] = float(np.mean([r.loss for r in reports]))
        if self.buckets is None:  # pipelined: the whole iteration is charged in ``reports``
            self.clock.losses(LossReport.NBYTES, max(self.clock.compute_seconds(r.compute_cpu, r.compute_wall)
                                                     for r in reports),
                              ahead=self.control_msg.buf.nbytes if ahead else None)
        if ahead:
            bits = self._decide(m)
            if bits != self.it["bits"]:
                raise PolicyError(f"policy {self.policy.policy_id!r} decided {bits} for iteration {m} after "
                                  f"announcing {self.it['bits']} ahead of its losses (its bits_ahead is wrong)")

    def _decide(self, m: int) -> list[int]:
        """The policy's decision for iteration m from its whole observation (``t_policy``)."""
        start = time.process_time()
        bits = check_decision(self.policy, self.policy.decide(self._observation(m, self.it["loss"])), m)
        self.it["t_policy"] = time.process_time() - start
        return bits

    def control(self, m: int) -> None:
        if not self.it["ahead"]:
            self._send_control(m, self._decide(m))

    def _send_control(self, m: int, bits: list[int]) -> None:
        """The Control of iteration m: the command (stop, checkpoint), the factor plan
        (two-round codecs), broadcast to the world."""
        last = m + 1 == self.config.iterations
        reserve = self.checkpoint_reserve + close_seconds(m + 1)
        self.it["stop_after"] = not last and self.stop.requested(self._mean_iteration_seconds(m), reserve)
        checkpoint_after = not (last or self.it["stop_after"]) and self.checkpoint_schedule.due(m + 1)
        self.command = (STOP_AFTER if self.it["stop_after"] else CHECKPOINT_AFTER if checkpoint_after
                        else CONTINUE)
        measure = False
        if self.lowrank is not None and self.lowrank.active(m):  # the iteration's factor plan
            try:
                self.lowrank.select(bits)
            except CodecError as exc:
                raise PolicyError(f"policy {self.policy.policy_id!r} decided {bits} for iteration {m}: {exc}") from None
            if self.aggregator is not None:
                self.factor_aggregators = factor_aggregators(self.config, self.channel, self.lowrank, 0)
            measure = self.mixed and self.policy.observes(m + 1)
        self.control_msg.set(self.command, m, bits, measure)
        self.channel.broadcast([(self.control_msg.buf, WORLD)],
                               lambda: f"control broadcast of iteration {m} stalled")
        if self.buckets is None and not self.it["ahead"]:  # ahead: sent while the workers computed
            self.clock.control(self.control_msg.buf.nbytes)
        self.it["bits"] = bits

    def _two_rounds(self, m: int) -> bool:
        """True when iteration m is a two-round codec's and rank 0 serves shard 0 in it."""
        return self.lowrank is not None and self.aggregator is not None and self.lowrank.active(m)

    def gradients(self, m: int) -> None:
        if self.aggregator is None:
            return  # colocated: the workers serve every shard
        agg = self.factor_aggregators[0] if self._two_rounds(m) else self.aggregator
        self.it["sizes"], self.it["worker_encode"], self.it["t_decode"] = agg.aggregate(m)

    def broadcast(self, m: int) -> None:
        if self.aggregator is None:
            return
        if self._two_rounds(m):  # round 1: P^ (orthogonalised) and the other layers' average
            lowrank = self.lowrank
            t_encode, t_decode, frame_bytes = self._broadcast_round(
                m, self.factor_aggregators[0], lowrank.orthogonalizer(lowrank.rounds[0][0]),
                frame_sizes(lowrank.compressor1, lowrank.rounds[0], self.it["bits"]),
                lambda s, frame: lowrank.compressor1.decode(frame, lowrank.rounds[0][s], lowrank.p_buf))
        else:
            t_encode, t_decode, frame_bytes = self._broadcast_round(
                m, self.aggregator, None,
                frame_sizes(self.compressor, self.shards, self.aggregator.broadcast_widths(self.it["bits"])),
                lambda s, frame: self.compressor.decode(frame, self.shards[s], self.update))
        self.it["t_encode"] = t_encode
        self.it["t_decode"] += t_decode
        self.it["frame_bytes"] = frame_bytes

    def _broadcast_round(self, m: int, agg: ShardAggregator, transform, sizes: list[int | None],
                         decode) -> tuple[float, float, list[int]]:
        """Average and re-encode ``agg``'s shard, broadcast it with the other servers' shards
        (``sizes``: each frame's where every rank computes it, ``broadcast.broadcast_frames``),
        and ``decode(s, frame)`` every shard's; return (encode s, decode s, each frame's bytes)."""
        t_encode = agg.encode(self.it["bits"], transform)
        try:
            frames = broadcast_frames(self.channel, list(range(self.servers)), sizes, {0: agg.frame_len, **self.lengths},
                                      self.frames, (0, agg.message), lambda: self._broadcast_stalled(m))
        except FrameError as exc:
            raise TrainingError(f"bad broadcast at iteration {m}: {exc}") from None
        start = time.process_time()
        for s, frame in frames.items():
            try:
                decode(s, frame)
            except (CodecError, FrameError) as exc:
                raise TrainingError(f"bad broadcast frame from server rank {s} at iteration {m}: {exc}") from None
        return t_encode, time.process_time() - start, [frame.size for frame in frames.values()]

    def gradients2(self, m: int) -> None:
        if self._two_rounds(m):  # round 2: the workers' Q_i, summed in rank order
            self.it["sizes2"], self.it["worker_encode2"], self.it["t_decode2"] = \
                self.factor_aggregators[1].aggregate(m, tag=TAG_FACTORS)

    def broadcast2(self, m: int) -> None:
        if not self._two_rounds(m):
            return
        lowrank = self.lowrank
        t_encode, t_decode, frame_bytes = self._broadcast_round(
            m, self.factor_aggregators[1], None, frame_sizes(lowrank.compressor2, lowrank.rounds[1], self.it["bits"]),
            lambda s, frame: lowrank.compressor2.decode(frame, lowrank.rounds[1][s], lowrank.q_buf))
        start = time.process_time()
        lowrank.apply(self.update)  # P^ Q^T into rank 0's update, as every worker does
        it = self.it
        it["t_encode"] += t_encode
        it["t_decode"] += t_decode + it.pop("t_decode2") + time.process_time() - start
        it["worker_encode"] += it.pop("worker_encode2")
        it["frame_bytes2"] = frame_bytes

    def reports(self, m: int) -> None:
        layers = max(self.n_layers, 1)
        reports = []
        sizes2 = self.it.get("sizes2")
        two_rounds = self.lowrank is not None and self.lowrank.active(m)
        if sizes2 is not None:  # two rounds: the frame bytes of both; norm_ratio has no ||g|| (NaN)
            reports.append(ServerReport(0, self.it["t_decode"], self.it["t_encode"], self.it["worker_encode"],
                                        [a + b for a, b in zip(self.it["sizes"], sizes2)], [0.0] * layers,
                                        [0.0] * layers))
        elif self.aggregator is not None:
            energies = self.aggregator.energies(layers) if self.config.norm_due(m) else [0.0] * layers
            reports.append(ServerReport(0, self.it["t_decode"], self.it["t_encode"], self.it["worker_encode"],
                                        self.it["sizes"], energies, [0.0] * layers))
        if self.remote_shards:
            ranks = [self.server_of[s] for s in self.remote_shards]
            self.channel.recv(list(zip(self.report_rows, ranks)), TAG_REPORT,
                              lambda pending: f"server rank(s) {', '.join(map(str, pending))} sent no "
                                              f"report for iteration {m}")
            reports += [ServerReport.unpack(row, self.workers) for row in self.report_rows]
        if self.receive_averages:
            self.channel.recv([(self.averages[s], self.server_of[s]) for s in self.averages], TAG_AVERAGE,
                              lambda pending: f"server rank(s) {', '.join(map(str, pending))} sent no "
                                              f"average for iteration {m}")
            for s, average in self.averages.items():
                unpack_average(self.shards[s], average, self.average)
        if self.colocated:  # rank 0 took part in no broadcast: the frames' sizes come reported
            self.it["frame_bytes"] = [int(r.bytes_out) - FrameLength.NBYTES for r in reports]
            self.it["worker_encode"] = max(r.worker_encode for r in reports)
        self.it["servers"] = reports
        if self.control_msg.measure:  # message 11: the workers' errors at each setting, averaged in rank order
            self.channel.recv(list(zip(self.setting_rows, self.worker_ranks)), TAG_SETTINGS,
                              lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no "
                                              f"setting errors for iteration {m}")
            total = self.setting_rows[0].copy()
            for row in self.setting_rows[1:]:
                total += row
            self.setting_errors = total / self.workers
        if two_rounds:  # each round charged as it went: P up, P^ down, Q up, Q down
            if self.colocated:  # the factor frames' sizes are the layout's
                self.it["frame_bytes"], self.it["frame_bytes2"] = self.lowrank.frame_sizes(self.it["bits"])
            rounds = self._factor_frames_in(reports)
            self.clock.gradients(rounds[0])
            self.clock.broadcasts([FrameLength.NBYTES + n for n in self.it["frame_bytes"]])
            self.clock.gradients(rounds[1])
            self.clock.broadcasts([FrameLength.NBYTES + n for n in self.it["frame_bytes2"]])
            return
        if self.buckets is not None:
            self._charge_pipelined(m)
            return
        self.clock.gradients([r.sizes for r in reports])
        self.clock.broadcasts([FrameLength.NBYTES + n for n in self.it["frame_bytes"]])

    def _charge_pipelined(self, m: int) -> None:
        """Receive the workers' backward reports (message 10) and charge the pipelined
        iteration: its compute (forward + backward), and the communication not hidden
        behind backward (``IterationClock.pipelined``)."""
        self.channel.recv(list(zip(self.backward_rows, self.worker_ranks)), TAG_BACKWARD,
                          lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no backward "
                                          f"report for iteration {m}")
        B, S = len(self.buckets), self.servers
        backward = [BackwardReport.unpack(row, B, S) for row in self.backward_rows]
        seconds = self.clock.compute_seconds
        forward = [seconds(r.compute_cpu, r.compute_wall) for r in self.it["reports"]]
        self.it["compute"] = [f + seconds(b.cpu, b.wall) for f, b in zip(forward, backward)]
        traffic = PipelinedTraffic(
            LossReport.NBYTES, self.control_msg.buf.nbytes,
            tuple(tuple(seconds(c, w) for c, w in zip(b.ready_cpu, b.ready_wall)) for b in backward),
            tuple(tuple(tuple(backward[w].sent[b * S + s] if w != s else 0 for w in range(self.workers))
                        for b in range(B)) for s in range(S)),
            tuple(tuple(backward[s].bcast[b] for b in range(B)) for s in range(S)), self.it["ahead"])
        self.clock.pipelined(traffic, max(forward), max(seconds(b.cpu, b.wall) for b in backward))

    def buffers(self, m: int) -> None:
        if sync_due(self.config, m, self.command):
            clocks = self.clock.clocks
            clocks.pause()  # like evaluation, on neither clock
            self.buffer_sync.run(m)
            clocks.resume()

    def end(self, m: int) -> IterationRecord:
        it = self.it
        if not self.colocated:
            if not self.script:  # a script's optimizer is the workers' alone
                self.replica.apply_update(self.update, self.lr)
        elif sync_due(self.config, m, self.command):  # the parameters, where rank 0 reads them
            self.clock.clocks.pause()
            self.parameter_sync.run(m)
            self.clock.clocks.resume()
        self.has_previous = True
        reports, servers = it["reports"], it["servers"]
        compute = it.get("compute") or [self.clock.compute_seconds(r.compute_cpu, r.compute_wall) for r in reports]
        t_encode = it["worker_encode"] + max(s.t_encode for s in servers)
        t_decode = max(s.t_decode for s in servers)
        sim_before = self.clock.clocks.sim
        wall_now, sim_now, t_comm = self.clock.finish(max(compute), max(r.compute_wall for r in reports),
                                                      t_encode, t_decode, it["t_policy"], it["bits"])
        self.last_iteration_ms = 1e3 * (sim_now - sim_before)
        frames_down = [FrameLength.NBYTES + n for n in it["frame_bytes"]]
        if "frame_bytes2" in it:  # two rounds: the trace's frame and bytes columns count both
            second_down = tuple(FrameLength.NBYTES + n for n in it["frame_bytes2"])
            first_in, second_in = (tuple(tuple(sizes) for sizes in frames) for frames in self._factor_frames_in(servers))
            traffic = IterationTraffic(LossReport.NBYTES, self.control_msg.buf.nbytes, first_in,
                                       tuple(frames_down), self.colocated, second_in, second_down, it["ahead"])
            frames_down = [a + b for a, b in zip(frames_down, second_down)]
        else:
            traffic = IterationTraffic(LossReport.NBYTES, self.control_msg.buf.nbytes,
                                       tuple(tuple(s.sizes) for s in servers), tuple(frames_down), self.colocated,
                                       ahead=it["ahead"])
        bits = it["bits"] if self.codec.takes_policy_bits else [self.codec.fixed_bits] * len(it["bits"])
        settings = None
        if self.lowrank is not None and not self.lowrank.active(m):  # before ``start``: the codec's own float32
            bits = [self.codec.nominal_bits] * len(it["bits"])
        if self.mixed:  # each layer's setting, and the width its numbers travelled at
            settings = list(it["bits"])  # the Control's codes (before ``start``: float32 whatever they say)
            if self.lowrank.active(m):
                bits = [lay.width or self.codec.factor_bits for lay in self.lowrank.layers]
        record = IterationRecord(
            iteration=m, loss=it["loss"], bits=bits, bytes_up=traffic.bytes_up, bytes_down=traffic.bytes_down,
            t_compute=max(compute), t_encode=t_encode, t_decode=t_decode, t_policy=it["t_policy"],
            t_comm=t_comm, wall_time=wall_now, sim_time=sim_now,
            worker_losses=[r.loss for r in reports], worker_compute=compute,
            worker_bytes=list(traffic.worker_bytes_sent), server_bytes_in=list(traffic.server_bytes_in),
            server_bytes_out=frames_down,
            server_frame_bytes=[list(s.sizes) for s in servers],
            server_t_decode=[s.t_decode for s in servers], server_t_encode=[s.t_encode for s in servers],
            norm_ratio=self._norm_ratio(servers) if self.config.norm_due(m) else [math.nan] * max(self.n_layers, 1),
            checksums=it["checksums"], policy_rows=self.policy.drain_records(), settings=settings,
            control_ahead=it["ahead"] if self.config.control == "ahead" else None,
            lr=None if self.replica.rate is None or self.replica.rate.constant else self.lr)
        self.bytes_total += record.bytes_up + record.bytes_down
        self.last_comm_ms, self.last_bytes = 1e3 * t_comm, record.bytes_up + record.bytes_down
        self.stop_after = it["stop_after"]
        return record

    def step(self, m: int) -> IterationRecord:
        """Run iteration m; ``self.stop_after`` then says whether the run stops after it."""
        return run_iteration(self, m)

    # ---- helpers of the phases ----------------------------------------------------------------
    def _factor_frames_in(self, reports: list[ServerReport]) -> tuple[list[list[int]], list[list[int]]]:
        """Two rounds: the frames into each server per round and worker. Shard 0's come
        measured; another server reports the rounds' sum per worker, which its fixed factor
        frame sizes (float32, set by the layout) split; TrainingError when they do not add up.
        Colocated, every shard is a worker's (its own frame counted, not charged)."""
        own = self.aggregator is not None
        first, second = ([list(self.it["sizes"])], [list(self.it["sizes2"])]) if own else ([], [])
        sizes1, sizes2 = self.lowrank.frame_sizes(self.it["bits"])
        for s, report in zip(self.remote_shards, reports[1:] if own else reports):
            if any(n != sizes1[s] + sizes2[s] for n in report.sizes):
                raise TrainingError(f"server rank {self.server_of[s]} received factor frames of {report.sizes} "
                                    f"bytes, not {sizes1[s]} + {sizes2[s]}")
            first.append([sizes1[s]] * self.workers)
            second.append([sizes2[s]] * self.workers)
        return first, second

    def _local_work(self) -> LocalWork:
        """What the cost model charges per iteration: the pieces of every shard, the codecs."""
        down, down_bits = broadcast_codec(self.config)
        if down_bits is None and not down.takes_policy_bits:
            down_bits = down.fixed_bits
        elif down_bits is None and not self.codec.takes_policy_bits:
            # The trace then records the workers' fixed bits, not the policy's: name the
            # broadcast's width here (a policy that cannot move bits for such a codec).
            lowest, highest = self.policy.bits_range()
            down_bits = lowest if lowest == highest else None
        return LocalWork(self.workers, self.codec.codec_id,
                         None if self.codec.takes_policy_bits else self.codec.fixed_bits,
                         down.codec_id, down_bits, self.config.error_feedback,
                         tuple(tuple((p.layer, p.size) for p in shard.pieces) for shard in self.shards),
                         self.config.policy)

    def cost_attrs(self) -> dict:
        """The trace's record of the local-work charge: the model and what it charges (None, None
        when the clock charges none)."""
        if self.clock.local_costs is None:
            return {"cost_model": None, "local_work": None}
        model, work = self.clock.local_costs
        return {"cost_model": model.to_dict(), "local_work": work.to_dict()}

    def _broadcast_stalled(self, m: int) -> str:
        """Why rank 0's gradient broadcast of iteration m stalled. A collective does not say
        which member is missing, but a worker it reached goes on and sends its loss for
        m + 1: the workers whose loss has not come are named when some others' has."""
        went_on = [rank for rank in self.worker_ranks if self.channel.has_message(rank, TAG_LOSS)]
        silent = [rank for rank in self.worker_ranks if rank not in went_on]
        if not went_on or not silent:
            return _stalled(m)()
        return (f"worker rank(s) {', '.join(map(str, silent))} did not take the gradient broadcast of "
                f"iteration {m} (the other workers went on to iteration {m + 1})")


    def _check_replicas(self, m: int, reports: list[LossReport]) -> list[int] | None:
        every = self.config.checksum_every
        if not every or m % every:
            return None
        workers = [int(r.checksum) for r in reports]
        # Colocated, rank 0 holds the parameters only after a synchronisation, and in a
        # script's run it applies no update: the first worker's are the reference (and rank
        # 0's entry in the trace).
        own = workers[0] if self.colocated or self.script else self.replica.checksum()
        sums = [own] + workers
        diverged = [rank for rank, value in zip([0, *self.worker_ranks], sums) if value != own]
        if diverged:
            raise TrainingError(f"replicas diverged before iteration {m}: parameter checksum of "
                                f"rank(s) {', '.join(map(str, diverged))} differs from rank 0's")
        return sums

    def _norm_ratio(self, servers: list[ServerReport]) -> list[float]:
        """||Q(g)|| / ||g|| per quantized layer: g the average of the workers' decoded
        gradients (||g||^2 from each server's report), Q(g) the decoded broadcast every rank
        applies (rank 0's own; colocated, ||Q(g)||^2 from each server's report) (NaN where g = 0)."""
        ratios = []
        for layer, s in enumerate(self.replica.layout.quantized):
            if self.colocated:
                update_energy = sum(report.update_energies[layer] for report in servers)
            else:
                u = self.update[s.offset:s.offset + s.size]
                update_energy = float(np.dot(u, u))
            energy = sum(report.energies[layer] for report in servers)
            ratios.append(math.sqrt(update_energy / energy) if energy > 0 else math.nan)
        return ratios or [math.nan]

    def _observation(self, m: int, loss: float) -> Observation:
        grads = ()
        if self.has_previous:
            average = self.average
            grads = tuple(average[s.offset:s.offset + s.size] for s in self.replica.layout.quantized)
        settings = None
        if self.mixed:  # PowerSGD with menus: the errors measured in iteration m - 1, if it measured
            grads = ()
            if self.setting_errors is not None:
                settings = SettingCosts(self.codec.menu, self.setting_errors, self.setting_sizes,
                                        self.codec.reference_setting)
                self.setting_errors = None
        return Observation(iteration=m, loss=loss, last_iteration_ms=self.last_iteration_ms,
                           gradients=grads, codec=self.codec if self.codec.accepts_bits or self.mixed else None,
                           last_comm_ms=self.last_comm_ms, last_bytes=self.last_bytes, settings=settings,
                           lr=self.replica.lr(m, self.config.lr))

    def _mean_iteration_seconds(self, m: int) -> float:
        """Mean wall seconds per iteration in this session (0 before the first one ends)."""
        done = m - self.start_iteration
        return (time.perf_counter() - self.session_started) / done if done else 0.0

    # ---- the run ------------------------------------------------------------------------
    def run(self, trace, start_iteration: int = 0, on_checkpoint=None) -> bool:
        """Iterate to the end or to a stop request; return True when stopped for requeue.
        ``trace`` takes each record (``record``), evaluations (``eval``); ``on_checkpoint()``
        runs after each iteration that --checkpoint-every marks (CHECKPOINT_AFTER)."""
        self.start_iteration = start_iteration
        self.clock.clocks = Clocks(**self.saved_clocks)  # start-up time stays off both clocks
        self.session_started = time.perf_counter()
        self.checkpoint_schedule.written()
        config = self.config
        for m in range(start_iteration, config.iterations):
            self.iteration = m
            cpu, polled = time.process_time(), self.channel.wait_cpu_seconds
            record = self.step(m)
            trace.record(record)
            self.iteration_cpu_seconds += time.process_time() - cpu
            self.iteration_wait_cpu_seconds += self.channel.wait_cpu_seconds - polled
            self.iteration = m + 1
            last = m + 1 == config.iterations
            if config.eval_every and ((m + 1) % config.eval_every == 0 or last):
                trace.eval(self.evaluate(m))
            if config.progress_every and ((m + 1) % config.progress_every == 0 or last or self.stop_after):
                self.log(self.progress_line(record))
            if self.stop_after:
                return True
            if self.command == CHECKPOINT_AFTER and on_checkpoint is not None:
                on_checkpoint()
                self.checkpoint_schedule.written()
        return False

    # ---- evaluation and progress ----------------------------------------------------------
    def evaluate(self, m: int) -> dict:
        clocks = self.clock.clocks
        clocks.pause()
        test_loss, accuracy = evaluate(self.replica, self.dataset, self.config)
        clocks.resume()
        self.last_eval = (m, test_loss, accuracy)
        warning = not_learning_warning(m, accuracy, self.dataset.num_classes, self.config)
        if warning and not self.warned_not_learning:
            self.warned_not_learning = True
            self.log(warning)
        return dict(iteration=m, wall_time=clocks.now_wall(), sim_time=clocks.sim,
                    test_loss=test_loss, test_accuracy=accuracy)

    def progress_line(self, record: IterationRecord) -> str:
        config = self.config
        done = record.iteration + 1
        eta = (config.iterations - done) * self._mean_iteration_seconds(done)
        acc = f"  acc {self.last_eval[2]:.3f} @{self.last_eval[0] + 1}" if self.last_eval else ""
        # bits 0: a codec without a width (a plugin's top-k, mcgq's sampling): nothing to show
        bits = f"bits {record.bits[0]}  " if record.bits[0] else ""
        bits += f"lr {record.lr:.3g}  " if record.lr is not None else ""
        # the loss as the trace's loss column has it: with the paper's l2 term only where the
        # loss carried one (not with the optimizer's decay, nor for a script's own loss)
        loss = "loss+l2" if config.loss_weight_decay > 0 and not self.script else "loss"
        return (f"iter {done:>{len(str(config.iterations))}}/{config.iterations}  {loss} {record.loss:.4f}  "
                f"{bits}sent {self.bytes_total / 1e6:.1f} MB  sim {format_elapsed(record.sim_time)}  "
                f"wall {format_elapsed(self.clock.clocks.now_wall())}  ETA {format_elapsed(eta)}{acc}")

    # ---- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        # The previous average feeds only policies that read gradients (Observation.gradients):
        # for the others it would double the checkpoint for nothing.
        keep_update = self.has_previous and self.policy.uses_gradients and not self.mixed
        errors = self.setting_errors  # measured, for the next decision (PowerSGD with menus)
        return {"setting_errors": torch.from_numpy(errors.copy()) if errors is not None else None,
                "iteration": self.iteration,
                # a script's model is the script's to save (rank 0 applies no update to it)
                "replica": None if self.script else self.replica.state_dict(),
                "policy": self.policy.state_dict(),
                "compressor": self.compressor.state_dict() if self.compressor is not None else None,
                "clocks": self.clock.clocks.state_dict(), "last_iteration_ms": self.last_iteration_ms,
                "last_comm_ms": self.last_comm_ms, "last_bytes": self.last_bytes,
                "bytes_total": self.bytes_total, "last_eval": self.last_eval,
                "cost_model": self.cost_attrs()["cost_model"],
                "previous_average": torch.from_numpy(self.average.copy()) if keep_update else None,
                "shard_plan": self.shard_plan(), "update": self.replica.update_state_dict()}

    def shard_record(self) -> dict:
        """The trace's record of the layout's cut and shards: the ``--shard-chunk`` setting,
        the chunk sizes it resolved to, and each shard's pieces as (offset, size)."""
        return {"setting": self.config.shard_chunk, **self.chunks.to_dict(), "pieces": self.shard_plan()}

    def shard_plan(self) -> list[list[tuple[int, int]]]:
        """Each shard's pieces as (offset, size): which server holds which piece's codec
        counters and error memory, so that a checkpoint is resumed onto the same plan."""
        return [[(piece.offset, piece.size) for piece in shard.pieces] for shard in self.shards]

    def check_shard_plan(self, state: dict) -> None:
        """UsageError (one line) where the checkpoint's shards are not this run's. A checkpoint
        from before the plan was saved was written while --shard-chunk cut only the quantized
        layers: refused where the small layers are cut now and servers hold state apart."""
        saved = state.get("shard_plan")
        if saved is None:
            chunk, rest = shard_chunks(self.config, self.replica.layout, self.servers).rest, self.replica.layout.rest.size
            if chunk and rest > chunk and self.servers > 1:
                raise UsageError(f"--resume: this checkpoint was written by an mpigrad whose --shard-chunk {chunk} "
                                 f"kept the small layers ({rest} elements) whole, and this one cuts them, so the "
                                 "servers' shards differ: resume it with the mpigrad that wrote it")
            return
        if [[tuple(piece) for piece in shard] for shard in saved] != self.shard_plan():
            raise UsageError("--resume: the checkpoint's shards are not this run's (another mpigrad's layout "
                             "rule): resume it with the mpigrad that wrote it")

    def load_state_dict(self, state: dict) -> None:
        self.check_shard_plan(state)
        self.iteration = int(state["iteration"])
        if not self.script:  # a script's model is the script's to load, on every rank
            self.replica.load_state_dict(state["replica"])
        if not self.colocated:  # colocated, the workers keep the optimizer (rank 0 applies no update)
            self.replica.load_update_state_dict(state.get("update"))
        self.policy.load_state_dict(state["policy"])
        errors = state.get("setting_errors")
        self.setting_errors = errors.numpy().astype(np.float64) if errors is not None else None
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        self.saved_clocks = dict(state["clocks"])
        self.last_iteration_ms = float(state["last_iteration_ms"])
        self.last_comm_ms, self.last_bytes = float(state.get("last_comm_ms", 0.0)), int(state.get("last_bytes", 0))
        self.bytes_total = int(state["bytes_total"])
        self.last_eval = state["last_eval"]
        recorded = state.get("cost_model")
        if recorded is not None and self.clock.local_costs is not None:
            # The run goes on with the model it began with (the file may have changed since).
            model, work = self.clock.local_costs
            if recorded != model.to_dict():
                self.clock.local_costs = (CostModel.from_dict(recorded, source="of the checkpoint"), work)
                self.clock._local_memo.clear()
                self.log(f"mpigrad: the cost model {model.source} has changed since the run began; "
                         "going on with the one it began with (from the checkpoint)")
        if state["previous_average"] is not None:
            self.average[:] = state["previous_average"].numpy()
            self.has_previous = True


#: The evaluations that may say a run is not learning: from this many iterations on, and
#: from this share of the run on (a slow start is not a divergence).
NOT_LEARNING_AFTER = (100, 0.25)


def not_learning_warning(m: int, accuracy: float, classes: int, config: RunConfig) -> str | None:
    """A warning line where the test accuracy measured after iteration ``m`` is at chance
    (below 1.5 / ``classes``) once the run is past ``NOT_LEARNING_AFTER``: a rate too high
    for the codec and the data (the paper's lr 0.2 with 2-bit gradients on the 8x8 digits)
    diverges to chance with a loss that looks merely slow; None otherwise."""
    done = m + 1
    iterations, share = NOT_LEARNING_AFTER
    if done < iterations or done < share * config.iterations or accuracy >= 1.5 / classes:
        return None
    return (f"mpigrad: warning: test accuracy {accuracy:.3f} after iteration {done} is chance level "
            f"({classes} classes): the run is not learning; a lower --lr may help (lr {config.lr:g})")


@torch.no_grad()
def evaluate(replica, dataset, config: RunConfig, batch: int = 256) -> tuple[float, float]:
    """Test loss (cross-entropy, no l2 term) and accuracy of the replica on the test split."""
    model = replica.model
    model.eval()
    n = len(dataset.test_y) if config.eval_samples is None else min(config.eval_samples, len(dataset.test_y))
    total_loss, correct = 0.0, 0
    for start in range(0, n, batch):
        x = torch.from_numpy(dataset.test_x[start:min(start + batch, n)]).to(replica.device)
        y = torch.from_numpy(dataset.test_y[start:min(start + batch, n)]).to(replica.device)
        logits = model(x)
        total_loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    model.train()
    return total_loss / n, correct / n
