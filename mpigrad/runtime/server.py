"""Rank 0: scheduler, parameter server and MDP server (MQGrad Alg. 1, server side)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from mpi4py import MPI

from ..codecs import CodecError
from ..config import RunConfig
from ..policies import Observation, get_policy
from . import comm as mpi
from .buffers import BufferSync, sync_due
from .common import base_codec, build_encoder, build_replica, load_data
from .environment import threads_per_rank
from .network import Clocks, LinkModel
from .protocol import (CONTINUE, CONTROL_FIXED, LOSS_FIELDS, STATUS_NONFINITE_LOSS, STOP_AFTER,
                       TAG_LOSS, FrameError, LossMessage, is_error_frame)
from .replica import FrameDecoder
from .stopping import StopFlag
from .tracing import RunTrace


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite values, diverged replicas, a bad frame)."""


class Server:
    """Drives the iterations: losses in, bits out, gradients in, averaged gradient out."""

    def __init__(self, config: RunConfig, comm: MPI.Comm, stop: StopFlag, log=print):
        self.config = config
        self.comm = comm
        self.workers = comm.Get_size() - 1
        self.stop = stop
        self.log = log
        self.dataset = load_data(config)
        self.data_description = self.dataset.describe()
        self.replica = build_replica(config, self.dataset)
        # Rank 0 evaluates on the test split only: let the training split go.
        self.dataset.train_x = self.dataset.train_x[:0]
        self.dataset.train_y = self.dataset.train_y[:0]
        self.codec = base_codec(config)
        layout = self.replica.layout
        self.n_layers = len(layout.quantized)
        self.policy = get_policy(config.policy_config(), n_layers=max(self.n_layers, 1),
                                 seed=config.seed)
        self.encoder = build_encoder(config, self.replica, self.codec, rank=0)
        self.decoder = FrameDecoder(layout, self.codec)
        self.buffer_sync = BufferSync(self.replica.model, comm, config.timeout)
        # What the trace's bits column says when the codec ignores the policy's bits.
        self.fixed_bits = int(getattr(self.codec, "bits", None) or self.codec.nominal_bits)
        self.link = LinkModel(config.bandwidth, config.latency, config.net_mode, config.broadcast)
        self.clocks = Clocks()
        self.saved_clocks = {"wall": 0.0, "sim": 0.0}
        self.iteration = 0
        # Compute time on the simulated clock is CPU time when a rank computes on one CPU
        # thread (oversubscribed ranks then do not inflate it), wall time otherwise (CPU time
        # adds up threads, and misses GPU kernels).
        self.cpu_clock = threads_per_rank(config.threads) == 1 and self.replica.device.type == "cpu"
        # Time kept in hand for the stop itself: gathering worker state and writing it.
        state_bytes = 4 * self.replica.layout.total * (2 + self.workers * (config.error_feedback != "none"))
        self.checkpoint_reserve = 2.0 + 2 * state_bytes / 200e6
        self.last_iteration_ms = 0.0
        # Reused buffers: nothing gradient-sized is allocated per iteration.
        total = layout.total
        self.grad_sum = np.zeros(total, np.float32)
        self.update = self.replica.update_host
        self.has_previous = False
        self.loss_rows = np.zeros((self.workers, LOSS_FIELDS), np.float64)
        self.control = np.zeros(CONTROL_FIXED + max(self.n_layers, 1), np.int64)
        self.frame_len = np.zeros(1, np.int64)
        self.recv_buffers = [np.empty(0, np.uint8) for _ in range(self.workers)]
        self.trace: RunTrace | None = None

    # ---- one iteration ------------------------------------------------------------------
    def _gather_losses(self, m: int) -> list[LossMessage]:
        requests = [self.comm.Irecv(self.loss_rows[w], source=w + 1, tag=TAG_LOSS)
                    for w in range(self.workers)]
        mpi.wait_all(requests, self.config.timeout, lambda pending: (
            f"worker rank(s) {', '.join(str(i + 1) for i in pending)} sent no loss for iteration {m}"))
        messages = [LossMessage.unpack(row) for row in self.loss_rows]
        for rank, msg in enumerate(messages, start=1):
            if msg.status == STATUS_NONFINITE_LOSS or not math.isfinite(msg.loss):
                raise TrainingError(f"worker rank {rank} computed a non-finite loss ({msg.loss}) "
                                    f"at iteration {m}; lower --lr or check the data")
        return messages

    def _check_replicas(self, m: int, messages: list[LossMessage]) -> list[int] | None:
        every = self.config.checksum_every
        if not every or m % every:
            return None
        own = self.replica.checksum()
        sums = [own] + [int(msg.checksum) for msg in messages]
        diverged = [rank for rank, value in enumerate(sums) if value != own]
        if diverged:
            raise TrainingError(f"replicas diverged before iteration {m}: parameter checksum of "
                                f"rank(s) {', '.join(map(str, diverged))} differs from rank 0's")
        return sums

    def _observation(self, m: int, loss: float) -> Observation:
        grads = ()
        if self.has_previous:
            grads = tuple(self.update[s.offset:s.offset + s.size] for s in self.replica.layout.quantized)
        return Observation(iteration=m, loss=loss, last_iteration_ms=self.last_iteration_ms,
                           gradients=grads, codec=self.codec if self.codec.accepts_bits else None)

    def _aggregate(self, m: int) -> tuple[list[int], float, float]:
        """Receive, decode and sum every worker's frame; return (bytes per worker, worker encode max, decode s).

        Frames are decoded as they arrive but added in rank order (a frame that overtakes
        a lower rank's waits, still encoded, in its receive buffer), so the float sum, and
        with it the whole run, does not depend on arrival order. Rank 1 decodes straight
        into the sum, the others add to it as they decode (``accumulate=True``: the same
        float32 sum as decoding into scratch and adding, in one pass).
        """
        sizes = [0] * self.workers
        encode_max = 0.0
        decode_seconds = 0.0
        arrived: dict[int, np.ndarray] = {}
        next_rank = 1
        for rank, frame in mpi.iter_gradient_frames(self.comm, self.workers, self.config.timeout,
                                                     self.recv_buffers, m):
            if is_error_frame(frame):
                raise TrainingError(f"worker rank {rank} computed a non-finite gradient at iteration {m}")
            sizes[rank - 1] = frame.size
            arrived[rank] = frame
            while next_rank in arrived:
                start = time.process_time()
                try:
                    encode_seconds = self.decoder.decode(arrived.pop(next_rank), self.grad_sum,
                                                         accumulate=next_rank > 1)
                except (CodecError, FrameError) as exc:
                    raise TrainingError(f"bad gradient frame from worker rank {next_rank} at iteration "
                                        f"{m}: {exc}") from None
                decode_seconds += time.process_time() - start
                encode_max = max(encode_max, encode_seconds)
                next_rank += 1
        return sizes, encode_max, decode_seconds

    def step(self, m: int) -> bool:
        """Run iteration m; return True when the run must stop after it (checkpoint)."""
        config, link, P = self.config, self.link, self.workers
        wall_start = self.clocks.now_wall()
        messages = self._gather_losses(m)
        checksums = self._check_replicas(m, messages)
        loss = float(np.mean([msg.loss for msg in messages]))
        t_comm = link.charge(link.gather([8 * LOSS_FIELDS] * P))

        policy_start = time.process_time()
        bits = list(self.policy.decide(self._observation(m, loss)))
        t_policy = time.process_time() - policy_start
        traced_bits = bits if self.encoder.accepts_bits else [self.fixed_bits] * len(bits)
        last = m + 1 == config.iterations
        stop_after = not last and self.stop.requested(self._mean_iteration_seconds(m), self.checkpoint_reserve)
        self.control[0] = STOP_AFTER if stop_after else CONTINUE
        self.control[1] = m
        self.control[CONTROL_FIXED:CONTROL_FIXED + len(bits)] = bits
        mpi.bcast(self.comm, self.control, config.timeout, lambda: f"control broadcast of iteration {m} stalled")
        t_comm += link.charge(link.bcast(self.control.nbytes, P))

        sizes, worker_encode, t_decode = self._aggregate(m)
        t_comm += link.charge(link.gather(sizes))
        start = time.process_time()
        np.multiply(self.grad_sum, np.float32(1.0 / P), out=self.grad_sum)
        frame = self.encoder.encode(self.grad_sum, bits)
        server_encode = time.process_time() - start
        self.frame_len[0] = frame.size
        mpi.bcast(self.comm, self.frame_len, config.timeout, lambda: f"gradient broadcast of iteration {m} stalled")
        mpi.bcast(self.comm, frame, config.timeout, lambda: f"gradient broadcast of iteration {m} stalled")
        t_comm += link.charge(link.bcast(self.frame_len.nbytes + frame.size, P))
        start = time.process_time()
        self.decoder.decode(frame, self.update)
        t_decode += time.process_time() - start
        self.replica.apply_update(self.update, config.lr)
        self.has_previous = True

        t_compute = max(msg.compute_cpu if self.cpu_clock else msg.compute_wall for msg in messages)
        t_encode = worker_encode + server_encode
        wall_now = self.clocks.now_wall()
        sim_before = self.clocks.sim
        if not link.modelled:
            local = max(msg.compute_wall for msg in messages) + t_encode + t_decode + t_policy
            t_comm = max(0.0, (wall_now - wall_start) - local)
            self.clocks.sim = wall_now
        elif config.compute_time is not None:
            self.clocks.sim += config.compute_time + t_comm
        else:
            self.clocks.sim += t_compute + t_encode + t_decode + t_policy + t_comm
        self.last_iteration_ms = 1e3 * (self.clocks.sim - sim_before)

        bytes_up = sum(sizes) + P * 8 * LOSS_FIELDS
        bytes_down = P * (self.control.nbytes + self.frame_len.nbytes + frame.size)
        self.trace.step(dict(
            iteration=m, wall_time=wall_now, sim_time=self.clocks.sim, loss=loss,
            bits=traced_bits[0], bits_layers=traced_bits, bytes_up=bytes_up, bytes_down=bytes_down,
            t_compute=t_compute, t_encode=t_encode, t_decode=t_decode, t_comm=t_comm,
            t_policy=t_policy),
            workers=dict(iteration=m, loss=[msg.loss for msg in messages],
                         t_compute=[msg.compute_cpu if self.cpu_clock else msg.compute_wall
                                    for msg in messages], bytes_sent=sizes),
            checksums=checksums, policy_rows=self.policy.drain_records())
        self.bytes_total += bytes_up + bytes_down
        return stop_after

    def _mean_iteration_seconds(self, m: int) -> float:
        """Mean wall seconds per iteration in this session (0 before the first one ends)."""
        done = m - self.start_iteration
        return (time.perf_counter() - self.session_started) / done if done else 0.0

    # ---- evaluation and progress ----------------------------------------------------------
    def evaluate(self, m: int) -> None:
        self.clocks.pause()
        test_loss, accuracy = evaluate(self.replica, self.dataset, self.config)
        self.clocks.resume()
        self.trace.eval(dict(iteration=m, wall_time=self.clocks.now_wall(), sim_time=self.clocks.sim,
                             test_loss=test_loss, test_accuracy=accuracy))
        self.last_eval = (test_loss, accuracy)

    def progress(self, m: int) -> None:
        config = self.config
        done = m + 1
        wall = self.clocks.now_wall()
        eta = (config.iterations - done) * self._mean_iteration_seconds(done)
        row = self.trace.last_step
        acc = f"  acc {self.last_eval[1]:.3f}" if self.last_eval else ""
        self.log(f"iter {done:>{len(str(config.iterations))}}/{config.iterations}  loss {row['loss']:.4f}  "
                 f"bits {row['bits']}  sent {self.bytes_total / 1e6:.1f} MB  sim {format_seconds(self.clocks.sim)}  "
                 f"wall {format_seconds(wall)}  ETA {format_seconds(eta)}{acc}")

    # ---- the run ------------------------------------------------------------------------
    def run(self, trace: RunTrace, start_iteration: int = 0) -> bool:
        """Iterate to the end or to a stop request; return True when stopped for requeue."""
        self.trace = trace
        self.start_iteration = start_iteration
        self.clocks = Clocks(**self.saved_clocks)  # start-up time stays off both clocks
        self.session_started = time.perf_counter()
        self.bytes_total = 0
        self.last_eval = None
        config = self.config
        for m in range(start_iteration, config.iterations):
            self.iteration = m
            stop_after = self.step(m)
            self.iteration = m + 1
            last = m + 1 == config.iterations
            if sync_due(config, m, stop_after):
                self.clocks.pause()  # like evaluation, on neither clock
                self.buffer_sync.run(m)
                self.clocks.resume()
            if config.eval_every and ((m + 1) % config.eval_every == 0 or last):
                self.evaluate(m)
            if config.progress_every and ((m + 1) % config.progress_every == 0 or last or stop_after):
                self.progress(m)
            if stop_after:
                return True
        return False

    # ---- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "replica": self.replica.state_dict(),
                "policy": self.policy.state_dict(), "encoder": self.encoder.state_dict(),
                "clocks": self.clocks.state_dict(), "last_iteration_ms": self.last_iteration_ms,
                "previous_update": torch.from_numpy(self.update.copy()) if self.has_previous else None}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.replica.load_state_dict(state["replica"])
        self.policy.load_state_dict(state["policy"])
        self.encoder.load_state_dict(state["encoder"])
        self.saved_clocks = dict(state["clocks"])
        self.last_iteration_ms = float(state["last_iteration_ms"])
        if state["previous_update"] is not None:
            self.update[:] = state["previous_update"].numpy()
            self.has_previous = True


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


def format_seconds(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
