"""Rank 0: the scheduler and MDP server. It gathers the losses, asks the policy for the bits,
decides when to stop and checkpoint, and returns an :class:`~.record.IterationRecord` per
iteration. What it does with the gradients (serving shard 0 and decoding every shard's
broadcast into its replica with separate servers; gathering the workers' reports with
colocated ones) is the run's way of aggregating, whose rank-0 side (``exchange``,
:mod:`..exchange.way`) this role drives, and which charges the clock for the iteration's
communication. Its evaluations and progress lines are :mod:`.evaluation`'s, its checkpoint
state :mod:`.rank0_state`'s. The phase order is in :mod:`.iteration`.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from ...config import RunConfig
from ...errors import TrainingError
from ...policies import Observation, PolicyError, SettingCosts, check_decision, get_policy
from ..measure import checkpoint
from ..exchange.build import (base_codec, build_replica, build_shards, load_data, local_work, shard_chunks, release_data,
                              script_replica)
from ..exchange.buffers import BufferSync, sync_due
from ..exchange.way import Rank0Parts
from ..exchange.ways import choose_exchange
from ..plan.checks import cost_model
from ..measure.clock import Clocks, IterationClock
from ..plan.environment import threads_per_rank
from ..plan.gpu import workers_device
from ..measure.phaselog import PhaseLog
from .evaluation import Evaluation
from .iteration import run_iteration
from .rank0_state import Rank0State
from ..measure.record import IterationRecord
from ..measure.tracing import close_seconds
from .stopping import StopFlag
from ..wire import CHECKPOINT_AFTER, CONTINUE, STOP_AFTER, TAG_LOSS, WORLD, Channel, Control, LossReport

__all__ = ["ParameterServer"]


class ParameterServer(Evaluation, Rank0State):
    """Rank 0: drives the iterations (losses in, bits out); its side of the way of
    aggregating (``exchange``) serves shard 0 where it has one."""

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
        self.buffer_sync = BufferSync(self.replica.model, channel)
        link = config.link_model()
        # Workers' compute in CPU seconds only where they compute on the CPU (rank 0's replica
        # stays on the CPU with colocated servers even when the workers train on GPUs).
        cpu_clock = threads_per_rank(config.threads) == 1 and workers_device(config) == "cpu"
        self.clock = IterationClock(link, self.workers, self.servers, cpu_clock, config.compute_time,
                                    colocated=self.colocated, cost_model=cost_model(config),
                                    local_work=local_work(config, self.codec, self.policy, self.shards,
                                                          self.workers))
        self.control_msg = Control(self.n_layers)
        #: Rank 0's side of the run's way of aggregating (:mod:`..exchange.ways`).
        self.exchange = choose_exchange(config).rank0(Rank0Parts(
            config, channel, self.replica, self.codec, self.shards, self.policy, self.clock, self.control_msg,
            self.script))
        self.compressor, self.average, self.mixed = self.exchange.compressor, self.exchange.average, self.exchange.mixed
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
        self.has_previous = False
        self.loss_rows = LossReport.buffer(self.workers)
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
        self.exchange.charge_losses(reports, self.control_msg.buf.nbytes if ahead else None)
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
        measure = self.exchange.select(m, bits)  # a two-round codec's factor plan
        self.control_msg.set(self.command, m, bits, measure)
        self.channel.broadcast([(self.control_msg.buf, WORLD)],
                               lambda: f"control broadcast of iteration {m} stalled")
        if not self.it["ahead"]:  # ahead: sent while the workers computed
            self.exchange.charge_control(self.control_msg.buf.nbytes)
        self.it["bits"] = bits

    def gradients(self, m: int) -> None:
        self.exchange.gradients(m)

    def broadcast(self, m: int) -> None:
        self.exchange.broadcast(m)

    def gradients2(self, m: int) -> None:
        self.exchange.gradients2(m)

    def broadcast2(self, m: int) -> None:
        self.exchange.broadcast2(m)

    def reports(self, m: int) -> None:
        self.exchange.reports(m)
        self.exchange.charge(m)

    def buffers(self, m: int) -> None:
        if sync_due(self.config, m, self.command):
            clocks = self.clock.clocks
            clocks.pause()  # like evaluation, on neither clock
            self.buffer_sync.run(m)
            clocks.resume()

    def end(self, m: int) -> IterationRecord:
        it, exchange = self.it, self.exchange
        exchange.end(m, self.lr, sync_due(self.config, m, self.command))
        self.has_previous = True
        reports, servers = it["reports"], exchange.server_reports
        compute = exchange.compute or [self.clock.compute_seconds(r.compute_cpu, r.compute_wall) for r in reports]
        t_encode = exchange.worker_encode + max(s.t_encode for s in servers)
        t_decode = max(s.t_decode for s in servers)
        sim_before = self.clock.clocks.sim
        wall_now, sim_now, t_comm = self.clock.finish(max(compute), max(r.compute_wall for r in reports),
                                                      t_encode, t_decode, it["t_policy"], it["bits"])
        self.last_iteration_ms = 1e3 * (sim_now - sim_before)
        traffic, frames_down = exchange.traffic(m, it["ahead"])
        bits, settings = exchange.record_bits(m, it["bits"])
        record = IterationRecord(
            iteration=m, loss=it["loss"], bits=bits, bytes_up=traffic.bytes_up, bytes_down=traffic.bytes_down,
            t_compute=max(compute), t_encode=t_encode, t_decode=t_decode, t_policy=it["t_policy"],
            t_comm=t_comm, wall_time=wall_now, sim_time=sim_now,
            worker_losses=[r.loss for r in reports], worker_compute=compute,
            worker_bytes=list(traffic.worker_bytes_sent), server_bytes_in=list(traffic.server_bytes_in),
            server_bytes_out=frames_down,
            server_frame_bytes=[list(s.sizes) for s in servers],
            server_t_decode=[s.t_decode for s in servers], server_t_encode=[s.t_encode for s in servers],
            norm_ratio=exchange.norm_ratio(servers) if self.config.norm_due(m) else [math.nan] * max(self.n_layers, 1),
            checksums=it["checksums"], policy_rows=self.policy.drain_records(), settings=settings,
            control_ahead=it["ahead"] if self.config.control == "ahead" else None,
            lr=None if self.replica.rate is None or self.replica.rate.constant else self.lr,
            nodes=self._node_record(traffic), buckets=exchange.bucket_row())
        self.bytes_total += record.bytes_up + record.bytes_down
        self.last_comm_ms, self.last_bytes = 1e3 * t_comm, record.bytes_up + record.bytes_down
        self.stop_after = it["stop_after"]
        return record

    def step(self, m: int) -> IterationRecord:
        """Run iteration m; ``self.stop_after`` then says whether the run stops after it."""
        return run_iteration(self, m)

    def trace_buckets(self) -> int | None:
        """The pipelined iteration's buckets, the trace's ``buckets`` table (None for rounds)."""
        shard = self.exchange.bucket_shard
        return None if shard is None else len(shard)

    # ---- helpers of the phases ----------------------------------------------------------------
    def _node_record(self, traffic) -> tuple[int, int, float, float] | None:
        """``IterationRecord.nodes`` of this iteration's traffic (None: a worker per node): the
        sequential rounds' (``LinkModel.node_breakdown``), or a pipelined iteration's
        overlapped schedule (``IterationClock.node_round``)."""
        link = self.clock.link
        if link.nodes is None:
            return None
        parts = self.clock.node_round if self.clock.node_round is not None else link.node_breakdown(traffic)
        return parts.nic_bytes, parts.intra_bytes, parts.nic_seconds, parts.intra_seconds



    def _check_replicas(self, m: int, reports: list[LossReport]) -> list[int] | None:
        every = self.config.checksum_every
        if not every or m % every:
            return None
        workers = [int(r.checksum) for r in reports]
        # Colocated, rank 0 holds the parameters only after a synchronisation, and in a
        # script's run it applies no update: the first worker's are the reference (and rank
        # 0's entry in the trace).
        own = workers[0] if not self.exchange.updates_replica or self.script else self.replica.checksum()
        sums = [own] + workers
        diverged = [rank for rank, value in zip([0, *self.worker_ranks], sums) if value != own]
        if diverged:
            raise TrainingError(f"replicas diverged before iteration {m}: parameter checksum of "
                                f"rank(s) {', '.join(map(str, diverged))} differs from rank 0's")
        return sums

    def _observation(self, m: int, loss: float) -> Observation:
        grads = ()
        if self.has_previous:
            average = self.average
            grads = tuple(average[s.offset:s.offset + s.size] for s in self.replica.layout.quantized)
        settings = None
        if self.mixed:  # PowerSGD with menus: the errors measured in iteration m - 1, if it measured
            grads = ()
            if self.setting_errors is not None:
                settings = SettingCosts(self.codec.menu, self.setting_errors, self.exchange.setting_sizes,
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


    @property
    def setting_errors(self) -> np.ndarray | None:
        """PowerSGD with menus: the workers' mean errors at each setting, measured in the last
        iteration that measured (message 11), for the policy's next decision; else None."""
        return self.exchange.setting_errors

    @setting_errors.setter
    def setting_errors(self, errors: np.ndarray | None) -> None:
        self.exchange.setting_errors = errors
