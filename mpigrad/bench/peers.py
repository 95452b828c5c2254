"""``mpigrad bench peers``: torch DDP with its communication hooks beside mpigrad, on one task.

From one mpigrad config (``--config FILE`` plus ``mpigrad train`` options after ``--``), DDP
trains the same model (``build_config_model``: same init from the seed), on the same data
shards (``ShardSampler``: worker k's batches are DDP rank k's), with the same batch per
worker, learning rate (plain SGD, as mpigrad's update), weight decay (``model.loss``), worker
count and threads per rank, for each variant:

- ``fp32``: DDP's built-in all-reduce, no hook, default buckets (25 MiB);
- ``fp16``: ``default_hooks.fp16_compress_hook``, default buckets;
- ``powersgd1/2/4``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=r,
  start_powerSGD_iter=K)`` and torch's defaults otherwise (error feedback and warm start on,
  ``min_compression_rate=2``); K is 10 % of the iterations (at least 2), the start the
  hook's documentation recommends. One bucket (``bucket_cap_mb`` above the model's size):
  over gloo with several buckets the hook fails with a collective size mismatch.

Ranks are processes on this machine talking over 127.0.0.1 (gloo; nccl with ``--device
cuda``). mpigrad's own method runs beside them under mpiexec, with ``net_mode = "off"`` so
that both are timed on the real wire. Evaluation is off in both. With ``--lab RATE`` (root)
every run gets a network lab of its own (``mpigrad lab``: one node per rank, each link
rate-limited both ways): DDP's P ranks with ``--launch each``, mpigrad's ranks (rank 0 on a
node of its own) under its mpiexec.

Bytes per node per iteration are those of a ring all-reduce of n elements of s bytes,
2 (P - 1) / P * s * n sent (and as many received) by each node, counted for what each hook
all-reduces: fp32 every gradient (s = 4), fp16 every gradient at s = 2, PowerSGD before its
start the whole bucket at s = 4, then three all-reduces at s = 4: the tensors it leaves
uncompressed (vectors, and matrices for which (n + m) r * min_compression_rate >= n m), the
P factors (sum of n r) and the Q factors (sum of m r), for each gradient viewed as an n x m
matrix and r = min(n, m, rank). A DDP trace splits them as bytes_up = P x the reduce-scatter
half and bytes_down = P x the all-gather half, so bytes_up + bytes_down is every byte on the
wire, as in an mpigrad trace.

Nodes (``--ranks-per-node L``, default the config's ``ranks_per_node``; docs/peers.rst,
"Nodes"): both sides on the same N = P / L nodes of L workers. DDP's ranks in node order
(node k holds ranks kL..kL+L-1; in the lab ``--launch each --ranks-per-node L``), so that
gloo's ring crosses each node's NIC once each way; mpigrad with colocated servers (the one
layout train builds for nodes of several workers; ``--servers colocated`` is added, an
explicit ``--servers S`` after ``--`` refused) and ``--ranks-per-node L``, its exchange
hierarchical by ``auto`` for L > 1, rank 0 beside node 0's workers. Each method's row then
has the bytes out of each node's NIC per iteration: in the lab, measured (frames, headers
included) with the lab's counters (``lab.netns.traffic``): DDP's first rank of each node reads
its node's counters when the steady iterations begin and after the loop (each after a
barrier of every rank), mpigrad's are the lab's counts over the whole command
(:func:`lab_traffic`) over its iterations; and always by the model
(``analysis.peers.nic_bytes_per_node``: a ring in node order puts 2 (P - 1) / P x G out of each
NIC, mpigrad's trace its ``bytes_nic`` / N).

Progress on stdout: a line as each run (a variant or mpigrad on one seed) starts and ends,
and one every ``--progress-interval`` seconds while processes run (DDP's rank 0 reports its
variants through a file, ``_ChildReport``).

With ``--breakdown``, one iteration of each method is split into compute, codec work, bytes on
the wire at the lab's rate and the rest (waiting and protocol), and mpigrad's into its phases
(:mod:`mpigrad.bench.breakdown`): the DDP ranks also time the synchronous part of their hook
and their forward + backward in each iteration, up to the last gradient, less the hook's
seconds in it (on a GPU: a bare forward + backward under ``no_sync()`` after the run), written
to the DDP trace's ``t_encode`` and ``t_compute``, and mpigrad's ranks log their phases (``MPIGRAD_PHASE_LOG`` in
``DIR/phases-seedS``).

Output in ``--out DIR`` (refused, before any run, where an earlier run's files are, unless ``--force``): one mpigrad-format trace per run (``ddp-VARIANT-seedS.h5``, ``mpigrad-seedS.h5``;
a DDP trace's config is the mpigrad config without its codec and policy keys, plus ``label``
and ``peer``), so ``mpigrad trace compare DIR/*.h5 --target-loss X`` reads them as groups
side by side (its simulated clock equals the wall clock here); and ``peers.json``, the
printed table as data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import UsageError
from ..mpiexec import MPIEXEC_HELP
from ..options import check_overwrite


@dataclass(frozen=True)
class PeerVariant:
    """One DDP configuration: ``hook`` is "allreduce" (DDP's own), "fp16" or "powersgd"."""

    name: str
    label: str
    hook: str
    rank: int | None = None


VARIANTS = {v.name: v for v in (
    PeerVariant("fp32", "DDP fp32", "allreduce"),
    PeerVariant("fp16", "DDP fp16 hook", "fp16"),
    PeerVariant("powersgd1", "DDP PowerSGD r1", "powersgd", 1),
    PeerVariant("powersgd2", "DDP PowerSGD r2", "powersgd", 2),
    PeerVariant("powersgd4", "DDP PowerSGD r4", "powersgd", 4),
)}

#: torch's default ``min_compression_rate`` of PowerSGDState, kept.
POWERSGD_MIN_COMPRESSION_RATE = 2
#: Keys of an mpigrad config that describe mpigrad's method, absent from a DDP trace's config.
_METHOD_KEYS = ("codec", "codec_opts", "bits", "policy", "policy_opts")
#: The name of the labs the bench builds (``mpigrad lab --name``), one at a time.
LAB_NAME = "mgbp"


# ---- bytes on the wire ----------------------------------------------------------------------
def ring_allreduce_bytes(workers: int, elements: int, itemsize: int = 4) -> float:
    """Bytes each of ``workers`` nodes sends (and receives) in a ring all-reduce of
    ``elements`` values of ``itemsize`` bytes: 2 (P - 1) / P * itemsize * elements."""
    return 2 * (workers - 1) / workers * itemsize * elements


def powersgd_elements(shapes: Sequence[Sequence[int]], rank: int,
                      min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> tuple[int, int, int]:
    """(uncompressed, P, Q) element counts that ``powerSGD_hook`` all-reduces for gradients of
    ``shapes`` in one bucket: each viewed as n x m (n = shape[0]), r = min(n, m, rank),
    compressed when (n + m) r * min_compression_rate < n m (torch's ``_should_compress``)."""
    uncompressed = p = q = 0
    for shape in shapes:
        n = int(shape[0]) if len(shape) else 1
        m = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p += n * r
            q += m * r
        else:
            uncompressed += n * m
    return uncompressed, p, q


def powersgd_bytes(workers: int, shapes: Sequence[Sequence[int]], rank: int,
                   min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> float:
    """Bytes per node of one compressed PowerSGD iteration: three float32 all-reduces."""
    return sum(ring_allreduce_bytes(workers, n) for n in powersgd_elements(shapes, rank, min_compression_rate))


class HookTally:
    """Wraps a comm hook and counts, per iteration, the hook's calls (DDP buckets) and the
    bytes per node its all-reduces move (see the module docstring)."""

    def __init__(self, variant: PeerVariant, workers: int):
        self.variant, self.workers = variant, workers
        self.calls = 0
        self.bytes = 0.0
        self.seconds = 0.0   # in the hook, until it returns its future

    def wrap(self, hook):
        def counted(state, bucket):
            if self.variant.hook == "fp16":
                self.bytes += ring_allreduce_bytes(self.workers, bucket.buffer().numel(), 2)
            elif state.iter < state.start_powerSGD_iter:  # read before the hook advances it
                self.bytes += ring_allreduce_bytes(self.workers, bucket.buffer().numel())
            else:
                shapes = [tuple(g.shape) for g in bucket.gradients()]
                self.bytes += powersgd_bytes(self.workers, shapes, state.matrix_approximation_rank,
                                             state.min_compression_rate)
            self.calls += 1
            start = time.perf_counter()
            future = hook(state, bucket)
            self.seconds += time.perf_counter() - start
            return future
        return counted

    def take(self) -> tuple[int, float, float]:
        """(calls, bytes per node, seconds in the hook) since the last take."""
        calls, sent, seconds = self.calls, self.bytes, self.seconds
        self.calls, self.bytes, self.seconds = 0, 0.0, 0.0
        return calls, sent, seconds


# ---- one DDP rank (a child process) --------------------------------------------------------
@dataclass
class RankRecord:
    """What one DDP rank measured for one variant, per iteration (after merging: ``losses``
    the mean over ranks, ``rank_losses`` each rank's)."""

    variant: str
    losses: list[float]
    wall_times: list[float]       # s since the loop started, at each iteration's end
    bytes_per_node: list[float]
    hook_calls: list[int]         # DDP buckets per iteration (hooked variants; 0 for fp32)
    hook_seconds: list[float] = dataclasses.field(default_factory=list)  # in the hook, until its future
    compute: list[float] = dataclasses.field(default_factory=list)  # forward + backward (--breakdown)
    rank_losses: list[list[float]] | None = None
    network: dict[str, Any] | None = None  # the rank's network (trace/network.current: a lab's, or the host's)
    #: A node's first rank in a lab of nodes: its node's NIC over the steady iterations
    #: (``_NodeCounter``: node, sent, received, iterations); after merging ``node_nic``, every node's.
    nic: dict[str, int] | None = None
    node_nic: list[dict[str, int]] | None = None


def _ddp_rank(spec: dict[str, Any], rank: int) -> list[RankRecord]:
    """Train every variant of ``spec`` as DDP rank ``rank``; the process group comes from
    ``spec`` (address, port, world size)."""
    import datetime

    from ..config import RunConfig
    from ..runtime.exchange.build import load_data
    from ..runtime.plan.gpu import resolve_device
    from ..runtime.plan.environment import apply_thread_settings

    apply_thread_settings(spec["threads"])
    import torch
    import torch.distributed as dist

    config = RunConfig(**spec["config"])
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(spec.get("backend", "gloo"),
                            init_method=f"tcp://{spec['address']}:{spec['port']}", rank=rank,
                            world_size=spec["workers"], timeout=datetime.timedelta(seconds=config.timeout))
    try:
        dataset = load_data(config)
        return [_train_variant(VARIANTS[name], config, dataset, rank, spec, device) for name in spec["variants"]]
    finally:
        dist.destroy_process_group()


def _train_variant(variant: PeerVariant, config, dataset, rank: int, spec: dict, device) -> RankRecord:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from ..data import ShardSampler
    from ..data.augment import build_augmentation
    from ..optim import LearningRate, build_torch_optimizer
    from ..runtime.exchange.build import build_config_model, forward_context
    from ..trace import network

    workers = spec["workers"]
    model = build_config_model(config, dataset).to(device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    one_bucket_mb = None
    if variant.hook == "powersgd":
        one_bucket_mb = math.ceil(4 * n_params / 2**20) + 1
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=one_bucket_mb)
    tally = HookTally(variant, workers)
    if variant.hook == "fp16":
        ddp.register_comm_hook(None, tally.wrap(default_hooks.fp16_compress_hook))
    elif variant.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=variant.rank,
                                            start_powerSGD_iter=spec["powersgd_start"],
                                            min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
                                            use_error_feedback=True, warm_start=True, random_seed=config.seed)
        ddp.register_comm_hook(state, tally.wrap(powerSGD_hook.powerSGD_hook))
    sampler = ShardSampler(len(dataset.train_y), rank, workers, config.batch_size, config.seed)
    augmentation = build_augmentation(config.augment, config.augment_opts, dataset)
    # The run's optimizer and schedule, as mpigrad's replicas apply them (plain SGD by default:
    # w <- w - lr * mean gradient); the rate is set before each step, as on mpigrad's ranks.
    optimizer = build_torch_optimizer(config.optimizer, ddp.parameters(), config.lr, config.update_options)
    rate = LearningRate(config.lr, config.lr_schedule, config.lr_schedule_opts, config.lr_warmup, config.lr_scaling,
                        workers)
    record = RankRecord(variant.name, [], [], [], [], network=network.current())
    fp32_bytes = ring_allreduce_bytes(workers, n_params)
    report = _ChildReport(spec, variant.name) if rank == 0 else None
    clock = _GradientClock(model, tally) if spec.get("breakdown") and device.type == "cpu" else None
    counter = _NodeCounter(spec["count_nic"]) if spec.get("count_nic") else None
    first = first_steady(spec.get("warmup", 0), spec["powersgd_start"] if variant.hook == "powersgd" else None)
    dist.barrier()
    start = time.perf_counter()
    for m in range(spec["iterations"]):
        if counter is not None and m == first:
            counter.begin()
        for group in optimizer.param_groups:
            group["lr"] = rate.at(m)
        idx = sampler.next_batch()
        batch = dataset.train_x[idx]
        if augmentation is not None:  # the draws of mpigrad's worker rank + 1 at this iteration
            batch = augmentation(batch, config.seed, rank, m)
        x = torch.from_numpy(batch).to(device)
        y = torch.from_numpy(dataset.train_y[idx]).to(device)
        optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        with forward_context(config, device):
            loss = model.loss(ddp(x), y, config.loss_weight_decay)
        loss.backward()
        if clock is not None:
            record.compute.append(clock.compute(began))
        optimizer.step()
        record.losses.append(loss.item())
        record.wall_times.append(time.perf_counter() - start)
        calls, sent, seconds = tally.take()
        record.hook_calls.append(calls)
        record.hook_seconds.append(seconds)
        record.bytes_per_node.append(sent if variant.hook != "allreduce" else fp32_bytes)
        if report:
            report.iteration(len(record.losses))
    if counter is not None and first < spec["iterations"]:
        record.nic = counter.end(spec["iterations"] - first)
    if report:
        report.done(len(record.losses), record.wall_times[-1] if record.wall_times else 0.0)
    if variant.hook == "powersgd" and any(c != 1 for c in record.hook_calls[2:]):
        raise RuntimeError(f"{variant.label}: DDP used {max(record.hook_calls)} buckets, not one")
    if spec.get("breakdown") and clock is None:  # on a GPU: the host's clock does not see the kernels
        record.compute = [_bare_compute(ddp, model, dataset, config, device)] * len(record.losses)
    return record


class _NodeCounter:
    """A DDP rank's view of its node's NIC in a lab of nodes (``lab`` its name; the node from
    the lab's MPIGRAD_LAB_NODE): at :meth:`begin` and :meth:`end` every rank waits at a
    barrier, so that no earlier iteration's bytes are still in flight, and the node's first
    rank (LOCAL_RANK 0) reads the frames its link counted (``lab.netns.traffic``, headers
    included); the other ranks read nothing (their node's count is the first rank's)."""

    def __init__(self, lab: str):
        from ..lab.netns import Topology

        self.node = Topology(lab, int(os.environ["MPIGRAD_LAB_NODES"])).node(int(os.environ["MPIGRAD_LAB_NODE"]))
        self.reads = os.environ.get("LOCAL_RANK", "0") == "0"
        self.before = None

    def _read(self):
        import torch.distributed as dist

        from ..lab.netns import traffic

        dist.barrier()
        return traffic(self.node) if self.reads else None

    def begin(self) -> None:
        self.before = self._read()

    def end(self, iterations: int) -> dict[str, int] | None:
        """{node, sent, received, iterations} since :meth:`begin` (None on the other ranks)."""
        after = self._read()
        if after is None or self.before is None:
            return None
        spent = after - self.before
        return {"node": self.node.index, "sent": spent.sent, "received": spent.received, "iterations": iterations}


class _GradientClock:
    """A DDP rank's compute in its own iteration: from the forward's start to the moment
    backward accumulates its last parameter gradient (a post-accumulate-grad hook on every
    parameter), less the seconds DDP's comm hook ran in between (``HookTally``)."""

    def __init__(self, model, tally: HookTally):
        self.tally = tally
        self.last = (0.0, 0.0)
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param) -> None:
        self.last = (time.perf_counter(), self.tally.seconds)

    def compute(self, began: float) -> float:
        at, in_hook = self.last
        return at - began - in_hook


def _bare_compute(ddp, model, dataset, config, device, repeats: int = 7) -> float:
    """The median seconds of forward + backward on one batch under ``no_sync()`` (DDP's
    all-reduce off; on a GPU, synchronized), after the run so that the training is untouched;
    the first pass is not counted."""
    import torch

    from ..runtime.exchange.build import forward_context

    x = torch.from_numpy(dataset.train_x[:config.batch_size]).to(device)
    y = torch.from_numpy(dataset.train_y[:config.batch_size]).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with ddp.no_sync():
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            with forward_context(config, device):
                loss = model.loss(ddp(x), y, config.loss_weight_decay)
            loss.backward()
            sync()
            times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


class _ChildReport:
    """DDP rank 0's word to the parent on one variant (``spec["progress"]``, a file it appends
    to; the parent's ``_Progress`` reads it): ``start NAME``, ``iteration NAME I`` at most once
    a second, ``done NAME I SECONDS``."""

    def __init__(self, spec: dict, name: str):
        self.path, self.name, self.last = Path(spec["progress"]), name, time.monotonic()
        self._write(f"start {name}")

    def iteration(self, done: int) -> None:
        if time.monotonic() - self.last >= 1.0:
            self.last = time.monotonic()
            self._write(f"iteration {self.name} {done}")

    def done(self, iterations: int, seconds: float) -> None:
        self._write(f"done {self.name} {iterations} {seconds:.3f}")

    def _write(self, line: str) -> None:
        with open(self.path, "a") as handle:
            handle.write(line + "\n")


def _child_main(spec_path: str, rank: str) -> None:
    """Run rank ``rank`` of the spec, write its records, and exit without the interpreter's
    teardown, as ``mpigrad train`` does: the work is written by then, and a DDP rank was seen
    to abort here ("terminate called without an active exception", exit -6; the moment and
    cause were not established). ``rank`` "lab": this node's (RANK), meeting at MASTER_ADDR."""
    spec = json.loads(Path(spec_path).read_text())
    if rank == "lab":
        rank, spec["address"] = os.environ["RANK"], os.environ["MASTER_ADDR"]
    rank = int(rank)
    records = _ddp_rank(spec, rank)
    out = Path(spec["out"]) / f"rank{rank}.json"
    out.write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the parent: runs, traces, table --------------------------------------------------------
@dataclass
class PeerRow:
    """One row of the table: a DDP variant or mpigrad's method, over its runs (one per seed)."""

    method: str
    traces: list[str]
    iterations: int
    s_per_iteration: float | None        # median over the steady iterations of every run
    s_p10: float | None
    s_p90: float | None
    sent_mb_per_node: float | None       # per iteration, median over the steady iterations
    received_mb_per_node: float | None
    reached: int | None                  # runs whose smoothed loss reached the target
    iterations_to_target: float | None   # mean over the runs that reached it
    seconds_to_target: float | None      # mean over the runs that reached it
    final_loss: float                    # smoothed, mean over the runs
    iteration_vs_mpigrad: float | None = None
    target_vs_mpigrad: float | None = None
    #: On nodes (``--ranks-per-node``): bytes out of each node's NIC per iteration (as many
    #: come in), in the lab measured (the mean over nodes and runs of ``nic_measured``; None
    #: where the counts could not be read), on loopback the model's; the model's
    #: (``analysis.peers.nic_bytes_per_node``, median over the steady iterations); each
    #: node's measured, mean over the runs. None off nodes.
    nic_bytes_per_node: float | None = None
    nic_bytes_per_node_model: float | None = None
    nic_measured: list[float] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", required=True,
                        help="the mpigrad config (TOML) whose task the peers train, e.g. examples/compare/fix2.toml")
    parser.add_argument("--workers", type=int, default=None,
                        help="workers P (default: the config's '# ranks: N' line minus its servers, else 2)")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per run (default: the config's)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated DDP variants (default {','.join(VARIANTS)})")
    parser.add_argument("--powersgd-start", type=int, default=None, metavar="K",
                        help="PowerSGD's start_powerSGD_iter (default: 10%% of the iterations, at least 2, "
                             "as torch's documentation recommends)")
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...",
                        help="seeds, one run of every method each (default: the config's seed)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="training loss to reach (trailing mean of --smooth losses), as trace compare")
    parser.add_argument("--smooth", type=int, default=20, help="losses in the trailing mean (default 20)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="iterations left out of the time statistics (default 5)")
    parser.add_argument("--out", default="bench-peers", metavar="DIR",
                        help="directory for the traces and peers.json (default bench-peers)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the traces and peers.json of an earlier run in DIR")
    parser.add_argument("--progress-interval", type=float, default=30.0, metavar="SECONDS",
                        help="while a run goes, a progress line every SECONDS (default 30; 0: only each run's "
                             "start and end)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split one iteration of each method into compute, codec, wire (at the --lab "
                             "rate) and the rest, and mpigrad's into its phases (host and GPU ms)")
    parser.add_argument("--no-mpigrad", dest="mpigrad", action="store_false",
                        help="run the DDP variants only")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address of DDP's rendezvous (default 127.0.0.1: loopback)")
    parser.add_argument("--lab", default=None, metavar="RATE",
                        help="run every method in a network lab at this link rate, e.g. 10MB/s (root; one node "
                             "per rank, or per L workers with --ranks-per-node; docs/lab.rst); default: loopback")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="L",
                        help="both sides on nodes of L workers (L must divide P; default: the config's "
                             "ranks_per_node, 1: a node per rank as before): DDP's ranks in node order (node k holds "
                             "ranks kL..kL+L-1), so that its ring crosses each NIC once each way; mpigrad with "
                             "colocated servers (added: the one layout train builds for nodes; --servers S after -- "
                             "is refused) and --ranks-per-node L, its exchange hierarchical by auto for L > 1, "
                             "rank 0 beside node 0's workers. Each row gets the bytes out of each node's NIC per "
                             "iteration: with --lab measured by the lab's counters (P/L >= 2 nodes), else the "
                             "model's (docs/peers.rst, Nodes)")
    parser.add_argument("--mpiexec", default=None, help=MPIEXEC_HELP)
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="'mpigrad train' options after --, applied to both, e.g. -- --model-opt fc_sizes=[64,64]")


def _variants(text: str) -> list[str]:
    """``--variants``: DDP variant names, or ``none`` (mpigrad alone)."""
    if text.strip() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise UsageError(f"unknown DDP variant {', '.join(map(repr, unknown)) or repr(text)}; "
                         f"choose from {', '.join(VARIANTS)}")
    return names


def _seeds(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds expects comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) < len(seeds):
        raise UsageError(f"--seeds expects distinct non-negative integers, got {text!r}")
    return seeds


def _config(args: argparse.Namespace):
    """The task's RunConfig, read as ``mpigrad train`` reads it, evaluation and network model off."""
    from ..runtime.run.launch import add_arguments as train_arguments
    from ..runtime.run.launch import config_from_args

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UsageError(f"train options after --: {message}")

    parser = _Parser(prog="mpigrad train", add_help=False)
    train_arguments(parser)
    train = parser.parse_args(["--config", args.config, *[a for a in args.train_args if a != "--"]])
    config = config_from_args(train)
    changes = {"eval_every": 0, "net_mode": "off", "progress_every": 0}
    if args.iterations is not None:
        changes["iterations"] = args.iterations
    config = dataclasses.replace(config, **changes)
    config.validate()
    return config


def align_powersgd_start(config, variants: Sequence[str], start: int) -> tuple[list[str], str | None]:
    """(train options to add, the line saying so) that give mpigrad's PowerSGD (``--codec
    powersgd``) the float32 iterations the hooks get (``start_powerSGD_iter``), so that both
    sides pay the same warm-up, unless the config or options set its ``start`` (then the line
    says where the two differ). Nothing where no hook variant or no low-rank codec runs."""
    if config.codec != "powersgd" or not any(VARIANTS[v].hook == "powersgd" for v in variants):
        return [], None
    given = config.codec_opts.get("start")
    if given is None:
        return (["--codec-opt", f"start={start}"],
                f"mpigrad's PowerSGD from iteration {start} too, as the hooks (an equal warm-up in float32; "
                "--codec-opt start=N after -- gives it another)")
    if int(given) != start:
        return [], (f"mpigrad's PowerSGD from iteration {given} (its start option), the hooks from {start}: "
                    "not an equal warm-up")
    return [], None


def bench_ranks_per_node(args: argparse.Namespace, config) -> int | None:
    """The bench's nodes: ``--ranks-per-node L``, else the config's (or the options after
    ``--``) ``ranks_per_node`` where it is more than 1; None: a node per rank, as before.
    UsageError (one line) for L < 1, ``auto`` (the bench places DDP's ranks itself), or two
    different Ls."""
    declared = config.ranks_per_node
    if args.ranks_per_node is None:
        if declared == "auto":
            raise UsageError("ranks_per_node auto (the config or the options after --): bench peers places DDP's "
                             "ranks on the nodes itself: give bench peers --ranks-per-node L")
        return declared if isinstance(declared, int) and declared > 1 else None
    if args.ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if isinstance(declared, int) and declared not in (1, args.ranks_per_node):
        raise UsageError(f"--ranks-per-node {args.ranks_per_node}, and the config (or the options after --) declare "
                         f"ranks_per_node {declared}: give one L, to bench peers")
    return args.ranks_per_node


def node_train_options(train_args: Sequence[str], config, ranks_per_node: int) -> list[str]:
    """The train options that put mpigrad's run on the bench's nodes: ``--ranks-per-node L``
    and, unless the config is colocated already, ``--servers colocated`` (the one layout
    train builds for nodes of several workers; at L = 1 too, so that the nodes are DDP's:
    each worker's, rank 0 beside node 0's). UsageError (one line) where the options after
    ``--`` give separate servers."""
    options = ["--ranks-per-node", str(ranks_per_node)]
    if config.colocated:
        return options
    if any(a == "--servers" or a.startswith("--servers=") for a in train_args):
        raise UsageError(f"--ranks-per-node {ranks_per_node}: mpigrad runs with colocated servers on the bench's "
                         f"nodes (train builds nodes of several workers for that layout only), not --servers "
                         f"{config.servers}: drop --servers after --")
    return [*options, "--servers", "colocated"]


def check_nodes(ranks_per_node: int, workers: int, lab: bool) -> None:
    """UsageError (one line) where nodes of ``ranks_per_node`` cannot hold ``workers``: L must
    divide P, and a lab (``lab``) needs at least two nodes."""
    if workers % ranks_per_node:
        raise UsageError(f"--ranks-per-node {ranks_per_node} does not divide the {workers} workers: give P = N x L "
                         "workers (--workers), or an L among P's divisors")
    if lab and workers // ranks_per_node < 2:
        raise UsageError(f"--lab with --ranks-per-node {ranks_per_node}: {workers} workers make one node, and a lab "
                         "needs at least 2: give more workers (--workers) or a smaller L")


def node_exchange(config, workers: int) -> str:
    """The exchange mpigrad's run of ``workers`` takes on the config's nodes (``auto``
    resolved as the launch resolves it: runtime/plan/topology.py); UsageError (one line) for
    one it refuses."""
    from ..runtime.plan.topology import resolve_topology

    return resolve_topology(config, workers + config.non_worker_ranks(), None)[1]


def nodes_line(config, workers: int, ranks_per_node: int, lab: bool) -> str:
    """The header's line on the nodes: N x L, how each side sits on them, where the NIC bytes come from."""
    exchange = node_exchange(config, workers)
    nodes = workers // ranks_per_node
    source = ("the lab's counters (frames, headers included)" if lab else
              "the model (a ring in node order: 2 (P - 1) / P x G out of each NIC; mpigrad: its trace's bytes_nic / N)")
    return (f"nodes: {nodes} of {ranks_per_node} worker(s); DDP's ranks in node order (its ring crosses each NIC "
            f"once each way); mpigrad colocated, rank 0 beside node 0's workers, {exchange} exchange; NIC bytes per "
            f"node per iteration from {source}")


def _check_task(config, workers: int) -> None:
    """UsageError now for data or model options that would fail inside every rank."""
    from ..data import DataError, ShardSampler
    from ..data.augment import build_augmentation
    from ..models import ModelError
    from ..runtime.exchange.build import build_config_model, load_data

    try:
        dataset = load_data(config)
        ShardSampler(len(dataset.train_y), workers - 1, workers, config.batch_size, config.seed)
        build_augmentation(config.augment, config.augment_opts, dataset)
        build_config_model(config, dataset)
    except (DataError, ModelError) as exc:
        raise UsageError(str(exc)) from None


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    from ..config import declared_ranks
    from ..optim import recipe_description
    from ..runtime.plan.environment import THREAD_VARIABLES, threads_per_rank

    variants = _variants(args.variants)
    if not Path(args.config).is_file():
        raise UsageError(f"config file {args.config} does not exist")
    config = _config(args)
    if config.momentum_correction:
        raise UsageError("bench peers gives DDP the config's optimizer, and momentum correction has no DDP twin: "
                         "compare with --optimizer-opt momentum=M instead (the same update in float32)")
    ranks_per_node = bench_ranks_per_node(args, config)
    if ranks_per_node is not None:
        args.train_args = [*args.train_args, *node_train_options(args.train_args, config, ranks_per_node)]
        config = _config(args)
    ranks = declared_ranks(args.config)
    workers = args.workers if args.workers is not None else (ranks - config.non_worker_ranks() if ranks else 2)
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if ranks_per_node is not None:
        check_nodes(ranks_per_node, workers, args.lab is not None)
    if args.mpigrad and ranks and ranks != workers + config.non_worker_ranks():
        raise UsageError(f"{args.config} is written for {ranks} ranks (its '# ranks: {ranks}' line), but "
                         f"{workers} workers with --servers {config.servers} need "
                         f"{workers + config.non_worker_ranks()}: use a copy without that line, or --no-mpigrad")
    if args.warmup < 0 or args.smooth < 1:
        raise UsageError("--warmup must be >= 0 and --smooth >= 1")
    if not args.progress_interval >= 0:
        raise UsageError(f"--progress-interval must be >= 0 seconds, got {args.progress_interval:g}")
    seeds = _seeds(args.seeds, config.seed)
    start = args.powersgd_start if args.powersgd_start is not None else max(2, config.iterations // 10)
    if start < 2:
        raise UsageError("--powersgd-start must be at least 2 (torch's minimum with error feedback)")
    if not variants and not args.mpigrad:
        raise UsageError("--variants none with --no-mpigrad leaves nothing to run")
    out = Path(args.out)
    methods = [*variants, *(["mpigrad"] if args.mpigrad else [])]
    check_overwrite(_outputs(out, methods, seeds), args.force, error=UsageError)
    phase_dirs = [_phase_dir(out, seed) for seed in seeds] if args.breakdown and args.mpigrad else []
    for folder in phase_dirs if not args.force else ():  # a run empties its own (they append)
        if folder.exists():
            raise UsageError(f"{folder} exists; pass --force to overwrite it")
    _check_task(config, workers)
    if args.lab is not None:
        _check_lab(args)
    out.mkdir(parents=True, exist_ok=True)
    powersgd = f"PowerSGD from iteration {start}; " if any(VARIANTS[v].hook == "powersgd" for v in variants) else ""
    extra, start_line = align_powersgd_start(config, variants, start) if args.mpigrad else ([], None)
    if extra:
        args.train_args = [*args.train_args, *extra]
        config = _config(args)
    backend, sharing = _backend(config, workers)
    mpigrad_sharing = _mpigrad_shares(config, workers)
    if mpigrad_sharing and args.mpigrad and "--share-gpu" not in args.train_args:
        args.train_args = [*args.train_args, "--share-gpu"]
        sharing = sharing or mpigrad_sharing
    threads = threads_per_rank(config.threads)
    env = dict(os.environ, **{name: str(threads) for name in THREAD_VARIABLES})
    if args.address == "127.0.0.1":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"mpigrad bench peers: {config.model} on {config.data}, P = {workers} workers, batch {config.batch_size}"
          f"/worker, {recipe_description(config)}, l2 in the loss {config.loss_weight_decay:g}, {config.iterations} "
          "iterations, "
          f"seed(s) {', '.join(map(str, seeds))}, {threads} thread(s)/rank; "
          f"{'a network lab at ' + args.lab + ' per link' if args.lab else 'DDP over ' + args.address}; "
          f"{powersgd}{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    if ranks_per_node is not None:
        print(nodes_line(config, workers, ranks_per_node, args.lab is not None), flush=True)
    if start_line:
        print(start_line, flush=True)
    if sharing:
        print(sharing, flush=True)
    progress = _Progress(len(methods) * len(seeds), args.progress_interval)
    print(f"{progress.total} run(s): {', '.join(_method_name(m, config) for m in methods)} on each seed; "
          f"a line as each starts and ends" + (f", and every {args.progress_interval:g} s while one goes"
                                              if args.progress_interval else ""), flush=True)

    runs: dict[str, list[Path]] = {name: [] for name in methods}
    measured: dict[str, list[list[float] | None]] = {name: [] for name in methods}  # NIC bytes per node, per run
    counting = args.lab is not None and ranks_per_node is not None
    try:
        for seed in seeds:
            seeded = dataclasses.replace(config, seed=seed)
            spec = {"config": seeded.to_dict(), "variants": variants, "workers": workers, "threads": threads,
                    "backend": backend,
                    "iterations": config.iterations, "powersgd_start": start, "address": args.address,
                    "port": _free_port(args.address), "out": str(out), "progress": str(out / "ddp-progress.txt"),
                    "breakdown": args.breakdown, "warmup": args.warmup, "ranks_per_node": ranks_per_node,
                    "count_nic": LAB_NAME if counting else None,
                    "exchange": node_exchange(config, workers) if ranks_per_node else None}
            records = _run_ddp(spec, env, progress, args.lab) if variants else {}
            for name in variants:
                runs[name].append(_write_peer_trace(_trace_path(out, name, seed), seeded, VARIANTS[name],
                                                    records[name], spec))
                counts = records[name].node_nic
                measured[name].append([c["sent"] / c["iterations"] for c in counts] if counts else None)
            if args.mpigrad:
                trace, nic = _run_mpigrad(args, seeded, workers, out, env, progress, ranks_per_node)
                runs["mpigrad"].append(trace)
                measured["mpigrad"].append(nic)
    except RuntimeError as exc:
        print(f"mpigrad bench peers: error: {exc}", file=sys.stderr)
        return 1
    rows = [_row(paths, workers, args, ranks_per_node is not None, measured[name]) for name, paths in runs.items()]
    if args.mpigrad:
        _ratios(rows, rows[-1])
    _print_table(rows, args.target_loss, args.smooth, ranks_per_node is not None, args.lab is not None)
    breakdown = _breakdown(runs, workers, args, out, seeds, config) if args.breakdown else None
    report = {"bench": "peers", "workers": workers, "seeds": seeds, "address": args.address, "lab": args.lab,
              "powersgd_start": start, "ranks_per_node": ranks_per_node,
              "nodes": workers // ranks_per_node if ranks_per_node else None,
              "nic_source": None if ranks_per_node is None else "lab" if counting else "model",
              "target_loss": args.target_loss, "smooth": args.smooth, "warmup": args.warmup,
              "cpus": os.cpu_count(), "config": config.to_dict(), "rows": [dataclasses.asdict(r) for r in rows],
              "breakdown": breakdown}
    (out / "peers.json").write_text(json.dumps(report, indent=1))
    target = "LOSS" if args.target_loss is None else f"{args.target_loss:g}"
    print(f"wrote {out / 'peers.json'} and the traces; compare them with: mpigrad trace compare {out}/*.h5 "
          f"--target-loss {target} --smooth {args.smooth}")
    return 0


def _trace_path(out: Path, method: str, seed: int) -> Path:
    """The trace of one run: ``method`` a DDP variant's name, or "mpigrad"."""
    return out / (f"mpigrad-seed{seed}.h5" if method == "mpigrad" else f"ddp-{method}-seed{seed}.h5")


def _phase_dir(out: Path, seed: int) -> Path:
    """Where mpigrad's ranks log their phases (``--breakdown``)."""
    return out / f"phases-seed{seed}"


def _outputs(out: Path, methods: Sequence[str], seeds: Sequence[int]) -> list[Path]:
    """Every result file a run writes in ``out``: its traces and peers.json (the phase logs'
    folders, ``--breakdown``'s, are checked apart: a folder is never a result file)."""
    return [*(_trace_path(out, method, seed) for seed in seeds for method in methods), out / "peers.json"]


def first_steady(warmup: int, powersgd_start: int | None = None) -> int:
    """The first iteration a row counts: max(warmup, PowerSGD's start + 1) (its first
    compressed iteration allocates its factors)."""
    return max(warmup, powersgd_start + 1 if powersgd_start is not None else 0)


def _first_steady(trace, warmup: int) -> int:
    """:func:`first_steady` of a trace (a DDP trace's PowerSGD start is in its ``peer``)."""
    return first_steady(warmup, (trace.config.get("peer") or {}).get("start_powerSGD_iter"))


def _breakdown(runs: dict[str, list[Path]], workers: int, args, out: Path, seeds, config) -> dict:
    """Print and return the ``--breakdown`` tables (:mod:`.breakdown`)."""
    from ..units import parse_rate
    from ..trace import load
    from .breakdown import as_data, breakdown_row, phase_rows, print_breakdown, worker_compute

    rate = parse_rate(args.lab) if args.lab else None
    worker_ranks = list(range(config.non_worker_ranks(), config.non_worker_ranks() + workers))
    directories = [_phase_dir(out, seed) for seed in seeds]
    rows = []
    for name, paths in runs.items():
        traces = [load(path) for path in paths]
        first = [_first_steady(trace, args.warmup) for trace in traces]
        override = None
        if name == "mpigrad" and not traces[0].config.get("pipeline"):  # wall seconds, as DDP's
            override = [worker_compute(d, len(t.steps), worker_ranks) for d, t in zip(directories, traces)]
            for seed, spans in zip(seeds, override):
                if spans is None:
                    print(f"mpigrad bench peers: the phase log of seed {seed} lacks iterations: its compute is "
                          "the trace's t_compute (CPU seconds where each rank has one thread)", flush=True)
        rows.append(breakdown_row(traces[0].label, traces, first, workers, rate, override))
    phases = []
    if "mpigrad" in runs:
        phases = phase_rows(directories, [args.warmup] * len(seeds), worker_ranks)
    reference = next((VARIANTS[name].label for name in ("fp32", *VARIANTS) if name in runs), None)
    print_breakdown(rows, phases, reference)
    return as_data(rows, phases)


def _check_lab(args: argparse.Namespace) -> None:
    """UsageError (one line) now when ``--lab`` cannot run: a bad rate, no lab on this host."""
    from ..units import parse_rate
    from ..lab.host import unavailable_reason

    parse_rate(args.lab)
    reason = unavailable_reason()
    if reason:
        raise UsageError(f"--lab: {reason}")
    if args.address != "127.0.0.1":
        raise UsageError("--lab and --address exclude each other: in a lab DDP meets at node 0's address")


def _lab_command(ranks: int, rate: str, launch: str, command: list[str], ranks_per_node: int | None = None) -> list[str]:
    """The lab command for ``ranks`` ranks: a node each, or (``ranks_per_node`` L) ``ranks``
    workers on ``ranks`` / L nodes of L (the lab adds rank 0 in node 0 under ``--launch mpi``)."""
    nodes = ["--nodes", str(ranks)] if not ranks_per_node else ["--nodes", str(ranks // ranks_per_node),
                                                                "--ranks-per-node", str(ranks_per_node)]
    return [sys.executable, "-m", "mpigrad", "lab", *nodes, "--rate", rate, "--launch", launch,
            "--name", LAB_NAME, "--", *command]


def _method_name(method: str, config) -> str:
    """How the progress lines name a method: a DDP variant's label, or "mpigrad" and its method."""
    from ..trace import method_label

    return VARIANTS[method].label if method in VARIANTS else f"mpigrad {method_label(config.to_dict())}"


class _Progress:
    """The bench's progress lines, each stamped with the seconds since the bench began: every
    run (a DDP variant or mpigrad's method, on one seed) started and finished, and while
    processes run, a line every ``interval`` seconds (0: none)."""

    def __init__(self, total: int, interval: float):
        self.total, self.interval = total, interval
        self.begin = self.last = time.monotonic()
        self.count = 0
        self.run = ""        # the run under way ("" between runs)
        self.since = 0.0     # when it started
        self.detail = ""     # how far it is, e.g. "iteration 80/400"

    def say(self, text: str) -> None:
        self.last = time.monotonic()
        print(f"[{self.last - self.begin:7.1f} s] {text}", flush=True)

    def started(self, what: str) -> None:
        self.count += 1
        self.run, self.since, self.detail = f"run {self.count}/{self.total}: {what}", time.monotonic(), ""
        self.say(f"{self.run}: started")

    def finished(self, how: str) -> None:
        self.say(f"{self.run}: finished, {how}")
        self.run = ""

    def wait(self, procs: Sequence[subprocess.Popen], between: str, poll=lambda: None) -> None:
        """Until every process has exited, or one has failed (the others are then killed):
        ``poll`` (reads the processes' word) every half second, and a line every interval,
        naming the run under way, else ``between`` (what the processes do between runs)."""
        waiting = time.monotonic()
        while True:
            poll()
            codes = [proc.poll() for proc in procs]
            if None not in codes or any(code not in (None, 0) for code in codes):
                break
            if self.interval and time.monotonic() - self.last >= self.interval:
                what = f"{self.run}: running" if self.run else between
                elapsed = time.monotonic() - (self.since if self.run else waiting)
                self.say(f"{what}, {elapsed:.0f} s so far{', ' + self.detail if self.detail else ''}")
            time.sleep(0.5)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        poll()


class _ChildLines:
    """Reads DDP rank 0's ``_ChildReport`` lines as they come and turns them into ``_Progress``
    lines."""

    def __init__(self, path: Path, progress: _Progress, seed: int, iterations: int):
        self.path, self.progress, self.seed, self.iterations = path, progress, seed, iterations
        self.seen = 0

    def __call__(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().split("\n")[:-1]   # whole lines only
        for line in lines[self.seen:]:
            kind, name, *numbers = line.split()
            if kind == "start":
                self.progress.started(f"{VARIANTS[name].label}, seed {self.seed}")
            elif kind == "iteration":
                self.progress.detail = f"iteration {numbers[0]}/{self.iterations}"
            elif kind == "done":
                iterations, seconds = int(numbers[0]), float(numbers[1])
                self.progress.finished(f"{iterations} iterations in {seconds:.1f} s "
                                       f"({seconds / max(iterations, 1):.3f} s/it)")
        self.seen = len(lines)


def _run_ddp(spec: dict, env: dict, progress: _Progress, lab: str | None = None) -> dict[str, RankRecord]:
    """Start the P DDP ranks (with ``lab``, a link rate: each in a lab node of its own, or
    with ``spec["ranks_per_node"]`` L to a node in rank order), wait (``progress``: rank 0's
    word on each variant), and merge their records: losses averaged over ranks (mpigrad's
    global loss), times and bytes from rank 0, every node's NIC count (``node_nic``) from
    the ranks that read one."""
    out = Path(spec["out"])
    spec_path = out / "ddp-spec.json"
    spec_path.write_text(json.dumps(spec))
    for old in [*out.glob("rank*.json"), Path(spec["progress"])]:
        old.unlink(missing_ok=True)
    child = [sys.executable, "-m", "mpigrad.bench.peers", str(spec_path)]
    if lab is not None:  # one process, the lab, starts every rank (rank and address from its variables)
        logs = [out / "ddp-lab.log"]
        commands = [_lab_command(spec["workers"], lab, "each", [*child, "lab"], spec.get("ranks_per_node"))]
    else:
        logs = [out / f"ddp-rank{rank}.log" for rank in range(spec["workers"])]
        commands = [[*child, str(rank)] for rank in range(spec["workers"])]
    procs = []
    for command, log in zip(commands, logs):
        with open(log, "w") as handle:
            procs.append(subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT))
    seed = spec["config"]["seed"]
    progress.wait(procs, f"seed {seed}: starting DDP's {spec['workers']} ranks",
                  _ChildLines(Path(spec["progress"]), progress, seed, spec["iterations"]))
    failed = [f"rank {rank} (exit {proc.returncode}): {_cause(logs[rank].read_text())}"
              for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"DDP failed: {'; '.join(failed)} (logs: {out}/ddp-rank*.log)")
    per_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(spec["workers"])]
    merged = {}
    for k, name in enumerate(spec["variants"]):
        first = RankRecord(**per_rank[0][k])
        first.rank_losses = [r[k]["losses"] for r in per_rank]
        first.losses = np.mean(first.rank_losses, axis=0).tolist()
        # the slowest rank's local work
        first.hook_seconds = np.max([r[k]["hook_seconds"] for r in per_rank], axis=0).tolist()
        if first.compute:
            first.compute = np.max([r[k]["compute"] for r in per_rank], axis=0).tolist()
        counted = sorted((r[k]["nic"] for r in per_rank if r[k].get("nic")), key=lambda count: count["node"])
        first.nic, first.node_nic = None, counted or None
        merged[name] = first
    for rank in range(spec["workers"]):
        (out / f"rank{rank}.json").unlink()
    for path in [*logs, spec_path, Path(spec["progress"])]:
        path.unlink(missing_ok=True)
    return merged


def _cause(stderr: str) -> str:
    """The line of a child's stderr that says why it failed: its last error line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no message"])[-1]


def _write_peer_trace(path: Path, config, variant: PeerVariant, record: RankRecord, spec: dict) -> Path:
    """An mpigrad-format trace of one DDP run (see the module docstring for its config and bytes)."""
    from ..trace import TraceWriter, collect_versions, default_tables, network

    workers, n = spec["workers"], len(record.losses)
    peer_config = {k: v for k, v in config.to_dict().items() if k not in _METHOD_KEYS}
    peer_config["label"] = variant.label
    peer_config["peer"] = {"system": "torch DDP", "hook": variant.hook, "rank": variant.rank,
                           "start_powerSGD_iter": spec["powersgd_start"] if variant.hook == "powersgd" else None,
                           "buckets": "one" if variant.hook == "powersgd" else "default"}
    if spec.get("ranks_per_node"):  # nodes of L ranks, in rank order: the ring crosses each NIC once each way
        peer_config["peer"]["ranks_per_node"] = spec["ranks_per_node"]
        # the nodes of the mpigrad run it ran beside, exchange resolved, as mpigrad's trace
        # records them: trace compare puts the two on the same nodes (its ratios need that)
        peer_config["exchange"] = spec["exchange"]
    attrs = {network.ATTR: record.network or dict(network.HOST),  # as mpigrad's own runs record it
             "argv": " ".join(sys.argv), "workers": workers, "servers": 0, "seed": config.seed,
             "peer": json.dumps(peer_config["peer"]), **collect_versions()}
    fp32_node = record.bytes_per_node[0] if variant.hook == "allreduce" else None
    with TraceWriter(path, config=peer_config, attrs=attrs, tables=default_tables(workers), force=True) as writer:
        for m in range(n):
            half = int(round(workers * record.bytes_per_node[m] / 2))
            writer.append("steps", {
                "iteration": m, "wall_time": record.wall_times[m], "sim_time": record.wall_times[m],
                "loss": record.losses[m], "bits": 16 if variant.hook == "fp16" else 32,
                "bytes_up": half, "bytes_down": half,
                "t_compute": record.compute[m] if record.compute else math.nan,
                "t_encode": record.hook_seconds[m] if record.compute else math.nan,
                "t_decode": math.nan, "t_comm": math.nan, "t_policy": 0.0})
            writer.append("workers", {"iteration": m, "loss": [losses[m] for losses in record.rank_losses],
                                      "t_compute": [math.nan] * workers,
                                      "bytes_sent": [int(round(record.bytes_per_node[m]))] * workers})
        if fp32_node is not None:
            writer.set_attr("float32_bytes_per_iteration", int(round(workers * fp32_node)))
    return path


def ddp_backend(device_type: str, workers: int, devices: int) -> tuple[str, str | None]:
    """(DDP's backend, a line saying why when its ranks share GPUs): NCCL where each rank has
    a GPU of its own, gloo on CUDA tensors where they share one (NCCL refuses two ranks on a
    device: "Duplicate GPU detected"), gloo on the CPU."""
    if device_type != "cuda":
        return "gloo", None
    if workers <= devices:
        return "nccl", None
    return "gloo", (f"{workers} DDP ranks share {devices} GPU{'s' * (devices != 1)}: DDP runs over gloo on CUDA "
                    "tensors (NCCL refuses two ranks on one device)")


def mpigrad_gpu_ranks(workers: int, servers, colocated: bool) -> int:
    """The ranks of mpigrad's run that train or serve on a GPU: the workers, and the S
    server ranks unless they are colocated (runtime/plan/gpu.gpu_rank)."""
    return workers if colocated else workers + int(servers)


def _mpigrad_shares(config, workers: int) -> str | None:
    """The line saying mpigrad's run gets --share-gpu, when its GPU ranks outnumber the GPUs."""
    from ..runtime.plan.gpu import workers_device

    if workers_device(config) != "cuda":
        return None
    import torch

    ranks, devices = mpigrad_gpu_ranks(workers, config.servers, config.colocated), torch.cuda.device_count()
    if ranks <= devices:
        return None
    return f"mpigrad's {ranks} GPU ranks share {devices} GPU{'s' * (devices != 1)}: its run gets --share-gpu"


def _backend(config, workers: int) -> tuple[str, str | None]:
    from ..runtime.plan.gpu import resolve_device

    device = resolve_device(config.device)
    if device.type != "cuda":
        return "gloo", None
    import torch

    return ddp_backend("cuda", workers, torch.cuda.device_count())


def _run_mpigrad(args, config, workers: int, out: Path, env: dict, progress: _Progress,
                 ranks_per_node: int | None = None) -> tuple[Path, list[float] | None]:
    """Run mpigrad's method on one seed: (its trace, and in a lab of nodes of
    ``ranks_per_node`` workers the bytes out of each node's link per iteration, the lab's
    counts over the whole command (:func:`lab_traffic`) over the iterations, else None)."""
    import shutil

    from ..mpiexec import mpiexec_command
    from ..runtime.measure.phaselog import ENV as PHASE_ENV

    trace = _trace_path(out, "mpigrad", config.seed)
    ranks = workers + config.non_worker_ranks()
    train = ["train", "--config", args.config, *[a for a in args.train_args if a != "--"],
             "--iterations", str(config.iterations), "--seed", str(config.seed), "--net-mode", "off",
             "--eval-every", "0", "--progress-every", str(max(1, config.iterations // 50)), "--trace", str(trace),
             "--force"]
    if args.lab is not None:
        command = _lab_command(workers if ranks_per_node else ranks, args.lab, "mpi", train, ranks_per_node)
    else:
        command = mpiexec_command(ranks, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", *train], args.mpiexec)
    log = out / f"mpigrad-seed{config.seed}.log"
    if args.breakdown:
        phases = _phase_dir(out, config.seed)
        shutil.rmtree(phases, ignore_errors=True)  # a phase log appends: start it empty
        env = {**env, PHASE_ENV: str(phases)}
    progress.started(f"{_method_name('mpigrad', config)}, seed {config.seed}")
    def poll() -> None:  # how far the run is, from its progress lines (for the periodic lines)
        progress.detail = run_progress(log.read_text(errors="replace")) or progress.detail

    with open(log, "w") as handle:
        proc = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
        progress.wait([proc], "mpigrad", poll)
    if proc.returncode != 0:
        print(log.read_text(), file=sys.stderr)
        raise RuntimeError(f"the mpigrad run failed (exit {proc.returncode}; log: {log})")
    progress.finished(f"{config.iterations} iterations in {time.monotonic() - progress.since:.1f} s "
                      "(start-up included)")
    counted = lab_traffic(log.read_text(errors="replace")) if args.lab is not None and ranks_per_node else {}
    log.unlink()
    nic = [counted[node]["out"] / config.iterations for node in sorted(counted)] if counted else None
    return trace, nic


#: The lab's line on a node's counters after its command (``mpigrad lab --ranks-per-node``,
#: lab/cli.py), e.g. ``lab: node 0 during the command: link 0.552 MB out, 0.555 MB in; loopback 0.000 MB``.
_LAB_TRAFFIC = re.compile(r"lab: node (\d+) during the command: link ([\d.]+) MB out, ([\d.]+) MB in; "
                          r"loopback ([\d.]+) MB\s*$")


def lab_traffic(log: str) -> dict[int, dict[str, float]]:
    """Each node's bytes ``out``, ``in`` (its link) and ``loopback`` during a lab's command,
    from the lines ``mpigrad lab`` prints after it (to 1 kB: they are in MB to 3 decimals);
    empty where it printed none (one rank per node, or counters it could not read)."""
    found = {}
    for line in log.splitlines():
        match = _LAB_TRAFFIC.search(line)
        if match:
            found[int(match.group(1))] = {key: float(value) * 1e6 for key, value in
                                          zip(("out", "in", "loopback"), match.group(2, 3, 4))}
    return found


def run_progress(log: str) -> str | None:
    """"iteration K/N" from the last whole progress line (``iter K/N ...``) of an mpigrad run's
    output, else None."""
    for line in reversed(log.split("\n")[:-1]):
        match = re.match(r"iter\s+(\d+)/(\d+)\s", line)
        if match:
            return f"iteration {match.group(1)}/{match.group(2)}"
    return None


def _row(paths: list[Path], workers: int, args, nodes: bool = False,
         measured: Sequence[list[float] | None] = ()) -> PeerRow:
    """The row of one method's traces: time and byte statistics over the iterations from
    max(warmup, PowerSGD's start + 1) on (its first compressed iteration allocates its
    factors), pooled over the runs; the target as ``trace compare`` reads it. ``nodes``: on
    nodes of several ranks, also the NIC's bytes per node (``measured``: each run's per node
    per iteration from the lab, None where not measured)."""
    from ..analysis.peers import nic_bytes_per_node
    from ..analysis.summary import iterations_to_target, smoothed_loss, time_to_target
    from ..trace import load

    steady, sent, received, its, seconds, final, nic = [], [], [], [], [], [], []
    for path in paths:
        trace = load(path)
        steps = trace.steps
        peer = trace.config.get("peer")
        first = _first_steady(trace, args.warmup)
        steady.append(np.diff(np.concatenate([[0.0], steps["wall_time"].to_numpy(float)]))[first:])
        up = steps["bytes_up"].to_numpy(float)[first:]
        down = steps["bytes_down"].to_numpy(float)[first:]
        # DDP and colocated servers: each node sends and receives (bytes_up + bytes_down) / P;
        # a worker of separate servers sends its frame (bytes_up / P), receives the broadcast
        # (bytes_down / P).
        symmetric = peer or trace.config.get("servers") == "colocated"
        sent.append((up + down) / workers if symmetric else up / workers)
        received.append(sent[-1] if symmetric else down / workers)
        final.append(float(smoothed_loss(trace, args.smooth)[-1]))
        modelled = nic_bytes_per_node(trace) if nodes else None
        if modelled is not None:
            nic.append(modelled[first:])
        if args.target_loss is not None:
            its.append(iterations_to_target(trace, args.target_loss, args.smooth))
            seconds.append(time_to_target(trace, args.target_loss, "wall", args.smooth))
    times, sent_all, received_all = (np.concatenate(x) for x in (steady, sent, received))
    reached_its = [x for x in its if x is not None]
    reached_seconds = [x for x in seconds if x is not None]
    model = float(np.median(np.concatenate(nic))) if nic and np.concatenate(nic).size else None
    counts = [run for run in measured if run]
    each = np.mean(counts, axis=0).tolist() if counts and len({len(run) for run in counts}) == 1 else None
    return PeerRow(
        method=trace.label, traces=[p.name for p in paths], iterations=len(steps),
        s_per_iteration=float(np.median(times)) if times.size else None,
        s_p10=float(np.percentile(times, 10)) if times.size else None,
        s_p90=float(np.percentile(times, 90)) if times.size else None,
        sent_mb_per_node=float(np.median(sent_all)) / 1e6 if sent_all.size else None,
        received_mb_per_node=float(np.median(received_all)) / 1e6 if received_all.size else None,
        reached=len(reached_its) if args.target_loss is not None else None,
        iterations_to_target=float(np.mean(reached_its)) if reached_its else None,
        seconds_to_target=float(np.mean(reached_seconds)) if reached_seconds else None,
        final_loss=float(np.mean(final)),
        nic_bytes_per_node=(float(np.mean(each)) if each else None) if args.lab is not None else model,
        nic_bytes_per_node_model=model,
        nic_measured=each)


def _ratios(rows: list[PeerRow], mpigrad: PeerRow) -> None:
    for row in rows:
        if row.s_per_iteration and mpigrad.s_per_iteration:
            row.iteration_vs_mpigrad = row.s_per_iteration / mpigrad.s_per_iteration
        if row.seconds_to_target is not None and mpigrad.seconds_to_target:
            row.target_vs_mpigrad = row.seconds_to_target / mpigrad.seconds_to_target


def _print_table(rows: list[PeerRow], target: float | None, smooth: int, nodes: bool = False,
                 lab: bool = False) -> None:
    """The table; on ``nodes``, after s/it the MB out of each node's NIC per iteration
    (measured in the ``lab``, with the model's beside it; else the model's)."""
    def f(value, spec):
        return "-" if value is None else format(value, spec)

    def mb(value):
        return None if value is None else value / 1e6

    goal = f"{target:g}" if target is not None else "-"
    nic_head = (f" {'NIC MB/node/it':>15}" + (f" {'model':>8}" if lab else "")) if nodes else ""
    print(f"{'method':<22} {'s/it':>7} {'p10-p90 s':>13}{nic_head} {'MB sent/node/it':>16} {'MB recv/node/it':>16} "
          f"{'reached':>8} {'its to ' + goal:>10} {'s to ' + goal:>9} {'loss(' + str(smooth) + ')':>9} "
          f"{'x mpigrad s/it':>15} {'x mpigrad to target':>20}")
    for r in rows:
        spread = f"{f(r.s_p10, '.3f')}-{f(r.s_p90, '.3f')}"
        reached = f"{r.reached}/{len(r.traces)}" if r.reached is not None else "-"
        nic = ""
        if nodes:
            nic = f" {f(mb(r.nic_bytes_per_node), '.3f'):>15}"
            nic += f" {f(mb(r.nic_bytes_per_node_model), '.3f'):>8}" if lab else ""
        print(f"{r.method:<22} {f(r.s_per_iteration, '.3f'):>7} {spread:>13}{nic} {f(r.sent_mb_per_node, '.3f'):>16} "
              f"{f(r.received_mb_per_node, '.3f'):>16} {reached:>8} {f(r.iterations_to_target, '.1f'):>10} "
              f"{f(r.seconds_to_target, '.1f'):>9} {r.final_loss:>9.4f} {f(r.iteration_vs_mpigrad, '.2f'):>15} "
              f"{f(r.target_vs_mpigrad, '.2f'):>20}", flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
