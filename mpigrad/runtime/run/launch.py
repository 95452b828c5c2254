"""``mpigrad train``: parse options on every rank, check the launch, dispatch by rank.

Launch with ``mpiexec -n P+1 python -m mpi4py -m mpigrad train [options]`` (or ``srun``):
rank 0 is the parameter server, ranks 1..P are workers. ``python -m mpi4py`` makes an
uncaught exception abort every rank instead of leaving the others hanging.
``mpigrad train --check [--ranks N] [options]`` checks a job in one process, without MPI
(``jobcheck.check_job``), and exits 0 with a short report or 2 with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import NoReturn

from ...config import AUTOCAST, BROADCASTS, DEFAULT_LR, WEIGHT_DECAY_IN, RunConfig, parse_assignments
from ...errors import UsageError
from ...units import format_rate
from ..plan.environment import apply_thread_settings, export_thread_variables, threads_per_rank

EXIT_FAILURE = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options mirror RunConfig; every default is None so a --config file is not overridden."""
    d = RunConfig()
    parser.epilog = (f"Defaults follow the MQGrad paper ({d.codec} codec, {d.policy} policy from {d.bits} bits, "
                     f"batch {d.batch_size}, {format_rate(d.bandwidth, bits=False)}; lr {DEFAULT_LR['cifar10']} on "
                     f"cifar10, {DEFAULT_LR[d.data]} on the default {d.data}). "
                     "Launch: mpiexec -n P+1 python -m mpi4py -m mpigrad train")
    parser.formatter_class = RegistryHelpFormatter
    g = parser.add_argument_group("run")
    g.add_argument("--config", metavar="FILE", help="TOML file whose keys mirror these options")
    g.add_argument("--check", action="store_true", help="check the job and exit, in this one process, without "
                   "mpiexec (on a login node, before it queues): the options, the trace path, the data, model, "
                   "layout and optimizer, and the world of --ranks N ranks (else SLURM_NTASKS, else the config's "
                   "'# ranks' line); prints a short report and exits 0, or one line and exits 2")
    g.add_argument("--ranks", type=int, metavar="N", help="with --check: the world size to check the job for "
                   "(the N of mpiexec -n N)")
    g.add_argument("--iterations", type=int, help=f"SGD iterations (default {d.iterations})")
    g.add_argument("--batch-size", type=int, help=f"per-worker batch size (default {d.batch_size})")
    g.add_argument("--lr", type=float, help="learning rate (default: the paper's 0.2 on cifar10, 0.01 on digits, 0.05 on synthetic and teacher)")
    g.add_argument("--weight-decay", type=float, help=f"weight decay coefficient (default {d.weight_decay}); where it "
                   "acts: --weight-decay-in")
    g.add_argument("--weight-decay-in", choices=WEIGHT_DECAY_IN, help="loss (default): the paper's l2 term in "
                   "the loss (paper-cnn: its big FC weights; other models: conv and linear weights), which goes through "
                   "the codec with the gradient; optimizer: the optimizer's weight_decay option, on the decoded update "
                   "on every replica, every parameter (decoupled for adamw)")
    g.add_argument("--optimizer", help="the update's optimizer: sgd (default; without options the paper's plain "
                   "w <- w - lr g) | adam | adamw | rmsprop | adagrad | adamax | nadam | radam | asgd | rprop "
                   "(torch.optim's) | package.module:factory (docs/training.rst)")
    g.add_argument("--optimizer-opt", action="append", metavar="KEY=VALUE",
                   help="optimizer option, e.g. momentum=0.9, nesterov=true, betas=[0.9,0.999]")
    g.add_argument("--lr-schedule", metavar="NAME", help="a torch.optim.lr_scheduler class, stepped once per "
                   "iteration, e.g. CosineAnnealingLR, MultiStepLR, StepLR (default: a constant rate)")
    g.add_argument("--lr-schedule-opt", action="append", metavar="KEY=VALUE",
                   help="schedule option, e.g. T_max=300, milestones=[150,225], gamma=0.1")
    g.add_argument("--lr-warmup", type=int, metavar="N", help="linear warm-up: iteration m < N runs at (m+1)/N of the "
                   "scheduled rate (default 0)")
    g.add_argument("--lr-scaling", choices=["none", "linear"], help="linear: the base --lr times the number of "
                   "workers (Goyal et al.; default none)")
    g.add_argument("--seed", type=int, help="seeds data order, model init, codecs and policy (default 0)")
    g.add_argument("--device", choices=["cpu", "cuda", "auto"], help="torch device (default cpu; auto: cuda where available). "
                   "With cuda each GPU rank takes the device of its position on its node (docs/gpu.rst)")
    g.add_argument("--share-gpu", action="store_true", default=None, help="let a node's GPU ranks share its devices "
                   "(default: more GPU ranks than devices is refused)")
    g.add_argument("--tf32", choices=["default", "on", "off"], help="TF32 for float32 matmuls and convolutions on "
                   "the GPU: torch's defaults (default; recorded in the trace), or on/off")
    g.add_argument("--threads", type=int, help="threads per rank (default SLURM_CPUS_PER_TASK or 1)")
    g.add_argument("--wait", choices=["auto", "spin", "sleep"], help="how ranks wait for messages: poll without "
                   "sleeping, sleep-poll with back-off, or auto (default: spin where every rank of the node has a "
                   "core per thread, else sleep; the trace records each rank's)")
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", help="paper-cnn (default) | resnet20 | resnet18 | package.module:factory (docs/models.rst)")
    g.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model option, e.g. fc_sizes=[256,256], norm=group")
    g.add_argument("--data", help="digits (embedded, default) | cifar10 | synthetic | teacher | package.module:factory")
    g.add_argument("--data-dir", help="directory of the CIFAR-10 python batches")
    g.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="dataset option, e.g. shape=[3,32,32]")
    g.add_argument("--autocast", choices=AUTOCAST, help="bf16: forward and loss under torch.autocast in "
                   "bfloat16, as mixed-precision CNN recipes train (parameters, gradients and codecs stay float32; "
                   "fp16 is not offered: it needs a loss scale that every replica skips alike) (default none)")
    g.add_argument("--augment", metavar="NAME", help="training-batch augmentation: crop-flip, He et "
                   "al.'s random crop after 4-pixel padding and horizontal flip, for data sets whose images allow it "
                   "(cifar10; docs/training.rst) (default none)")
    g.add_argument("--augment-opt", action="append", metavar="KEY=VALUE", help="augmentation option: padding=4, "
                   "flip=false")
    g.add_argument("--eval-every", type=int, help=f"evaluate on the test split every N iterations, 0 = never (default {d.eval_every})")
    g.add_argument("--eval-samples", type=int, help="evaluate on the first N test examples (default all)")
    g = parser.add_argument_group("quantization")
    g.add_argument("--codec", help=f"gradient codec: %(codecs)s | package.module:Class, a codec of your own "
                   f"(docs/extending.rst) (default {d.codec})")
    g.add_argument("--codec-opt", action="append", metavar="KEY=VALUE", help="codec option, e.g. bucket_size=512; powersgd (low rank, two rounds "
                   "per iteration, --policy fixed, or lgreco with menus): rank=R (1), start=K (0: float32 before "
                   "iteration K), min_compression_rate=X (2), factor_bits=B (32: float32 factors; 1..8: "
                   "uniform, 16: fp16), rest_bits=B (the same for the layers it leaves uncompressed), "
                   "ranks=1,2,4 and widths=2,4,8 (menus: with --policy lgreco each layer gets a rank of ranks, "
                   "or goes whole uniform at a width of widths; rank must be one of ranks)")
    g.add_argument("--bits", type=int, help=f"bits, or initial bits for a moving policy (default {d.bits}); refused where "
                   "neither the policy nor the codec has a width to set (docs/policies.rst); "
                   "uniform: 2**bits levels from min to max; qsgd: the sign is one of the bits, "
                   "s = 2**(bits-1) - 1 levels per sign (bits 4 gives s = 7)")
    g.add_argument("--policy", help=f"bit policy: %(policies)s | package.module:Class, a policy of your own "
                   f"(docs/extending.rst) (default {d.policy}; schedule needs --policy-opt schedule=0:2,500:4)")
    g.add_argument("--policy-opt", action="append", metavar="KEY=VALUE", help="policy option, e.g. epsilon=0.1")
    g.add_argument("--min-quantize-size", type=int, help="quantize every parameter of at least this many elements, "
                   "the rest travels as float32 (default: the layers the paper quantizes, the weights "
                   "of the two big fully connected layers)")
    g.add_argument("--broadcast-codec", metavar="CODEC", help="codec of the server's broadcast of the average: "
                   "paper (default: the workers' codec and bits, as MQGrad's Alg. 1; mcgq: fp32, as its "
                   "all-reduce), same, fp32, fp16, a codec id at the policy's bits, or CODEC:BITS e.g. uniform:8; "
                   "a plugin: package.module:Class or package.module:Class:BITS")
    g.add_argument("--error-feedback", choices=["none", "residual", "accumulate"], help="error-feedback memory (default none)")
    g.add_argument("--momentum-correction", type=float, metavar="M", help="DGC's momentum correction: each "
                   "worker encodes its velocity u <- M u + g instead of its gradient g, and the update is plain SGD "
                   "on the average (with the optimizer's own momentum refused); default 0, off (docs/training.rst)")
    g = parser.add_argument_group("parameter servers")
    g.add_argument("--servers", metavar="S|colocated", help="S: ranks 0..S-1 are servers, each aggregating a "
                   "slice of the parameters balanced by bytes; rank 0 stays scheduler and MDP server "
                   "(default 1). colocated: every worker also serves a slice (each node's link then carries "
                   "all-reduce's 2(P-1)/P of the gradient), rank 0 serves none (docs/runtime.rst)")
    g.add_argument("--pipeline", action="store_true", default=None, help="with --servers colocated: the "
                   "pipelined iteration (the loss goes after the forward pass, rank 0 chooses the bits during "
                   "backward, each layer's frames go as soon as backward has produced its gradient, and its "
                   "average as soon as all its frames are in); the same losses as without (docs/runtime.rst)")
    g.add_argument("--control", choices=["ahead", "paper"], help="when rank 0 sends an iteration's bits: ahead of "
                   "the workers' losses where the policy knows them in advance (default: fixed, schedule, mqgrad "
                   "between its steps), or paper: after every iteration's losses (MQGrad's round trip)")
    g.add_argument("--shard-chunk", metavar="auto|ELEMENTS", help="cut quantized layers larger than ELEMENTS "
                   "into pieces quantized on their own, and the small layers' float32 piece likewise, so that S "
                   "servers can balance a model with few big layers (changes each quantized piece's min/max "
                   "scaling); 0: whole layers; default auto: whole layers with one server, else pieces that give "
                   "every server an even share of the quantized and of the small layers (docs/runtime.rst, "
                   "Sharding)")
    g = parser.add_argument_group("network model")
    g.add_argument("--bandwidth", metavar="RATE|SCHEDULE",
                   help="link bandwidth with its unit: bytes 10MB/s, 125MiB/s; bits 100Mbps, 1Gbit/s, 10Gb/s "
                        "(default 10MB/s); or a schedule on the simulated clock: 10MB/s@0s,1GB/s@60s,10MB/s@120s "
                        "(each rate from its time on; a trailing ,repeat@PERIOD starts it over every PERIOD), or "
                        "markov:10MB/s,1GB/s,dwell=30s,60s (two states, exponential dwell times of those means, "
                        "drawn from --seed); a message crossing a change pays each part at its rate")
    g.add_argument("--latency", metavar="DURATION|SCHEDULE",
                   help="per-message latency, e.g. 0.5ms (default 0), or a schedule of latencies as for --bandwidth "
                        "(0s@0s,20ms@60s or markov:0s,20ms,dwell=60s,10s)")
    g.add_argument("--link-bandwidth", action="append", metavar="RANK=RATE|SCHEDULE",
                   help="rank RANK's link at its own rate or schedule (repeatable), e.g. 1=1MB/s for a slow "
                        "server link; a message goes at the slower of its two ranks' links")
    g.add_argument("--net-mode", choices=["virtual", "sleep", "off"], help="virtual clock, real sleeps, or no model (default virtual)")
    g.add_argument("--broadcast", choices=BROADCASTS,
                   help="broadcast model: star (a copy per receiver, one after another; default), tree "
                        "(ceil(log2(n)) rounds) or mpich (MPICH's binomial Ibcast: a node's copies to its "
                        "children share its link)")
    g.add_argument("--compute-time", help="charge this per iteration for the workers' compute instead of measured "
                   "CPU time, e.g. 50ms (deterministic runs); the policy, encoding, decoding and averaging are "
                   "then charged by --cost-model")
    g.add_argument("--cost-model", metavar="default|none|FILE", help="with --compute-time: the cost model of "
                   "the policy, encode, decode and average on the simulated clock: default (the package's, measured by "
                   "mpigrad bench calibrate on the machine it names), FILE (one written by mpigrad bench "
                   "calibrate) or none (charge no local work, the clock before issue 24) (default default)")
    g = parser.add_argument_group("output")
    g.add_argument("--trace", metavar="PATH", help=f"HDF5 trace file (default {d.trace})")
    g.add_argument("--force", action="store_true", default=None,
                   help="overwrite an existing trace; with --resume, resume on another network than the "
                        "trace's (the trace records it)")
    g.add_argument("--trace-flush", type=int, help=f"flush the trace every N iterations (default {d.trace_flush})")
    g.add_argument("--progress-every", type=int, help=f"progress line every N iterations, 0 = never (default {d.progress_every})")
    g.add_argument("--checksum-every", type=int, help=f"compare parameter checksums every N iterations (default {d.checksum_every})")
    g.add_argument("--norm-every", type=int,
                   help="record the trace's norm_ratio every N iterations, 0 = never; the passes over the gradient "
                        f"behind it run only then, the other rows are NaN (default {d.norm_every})")
    g = parser.add_argument_group("robustness")
    g.add_argument("--timeout", help=f"seconds to wait for a rank before aborting (default {d.timeout:g})")
    g.add_argument("--walltime", help="stop, checkpoint and exit 75 before this much time has passed, e.g. 2h")
    g.add_argument("--checkpoint", metavar="PATH", help="checkpoint file (default TRACE.ckpt; the one before is kept as PATH.prev)")
    g.add_argument("--checkpoint-every", metavar="N|DURATION",
                   help="also checkpoint every N iterations, or every DURATION of wall time (e.g. 30m): "
                        "a crash then loses at most one interval (default: only on stop)")
    g.add_argument("--resume", action="store_true", default=None, help="continue from the checkpoint")


class RegistryHelpFormatter(argparse.HelpFormatter):
    """Fills ``%(codecs)s`` and ``%(policies)s`` in option help from the registries, only
    when help is printed (the codec registry imports Numba)."""

    def _expand_help(self, action: argparse.Action) -> str:
        if "%(codecs)s" in (action.help or "") or "%(policies)s" in (action.help or ""):
            from ...codecs import available as codecs
            from ...policies import available as policies

            action = argparse.Action(action.option_strings, action.dest, help=action.help % {
                "codecs": " | ".join(codecs()), "policies": " | ".join(policies())})
        return super()._expand_help(action)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {key: value for key, value in vars(args).items()
                 if key not in ("config", "check", "ranks") and not key.endswith("_opt")}
    for name in ("model", "data", "augment", "codec", "policy", "optimizer", "lr_schedule"):
        overrides[f"{name}_opts"] = parse_assignments(getattr(args, f"{name}_opt"), f"--{name.replace('_', '-')}-opt")
    return RunConfig.from_sources(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    """Check the options before MPI, torch or data start (every rank alike, so a bad option
    ends each rank with exit 2 and one line from rank 0, fast); then launch checks and work."""
    started = time.monotonic()
    if getattr(args, "ranks", None) is not None and not getattr(args, "check", False):
        raise UsageError("--ranks goes with --check (a launched run's world size is mpiexec's -n)")
    config = config_from_args(args)
    export_thread_variables(threads_per_rank(config.threads))  # before Numba's pool starts
    if getattr(args, "check", False):
        return check_only(config, args.ranks)
    from ...mpiexec import launch_rank
    from ..plan.checks import check_options, check_trace

    check_options(config)  # UsageError: cli prints it (rank 0 only) and exits 2
    check_trace(config)  # a directory, or an existing trace without --force
    if launch_rank() == 0:
        for note in config.notes:
            print(note, flush=True)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        # Before torch starts its thread pools.
        apply_thread_settings(threads_per_rank(config.threads))
        from .preflight import check_launch
        from .session import run_rank
        check_launch(config, comm)
        from ..plan.gpu import bind_rank
        bind_rank(config, comm)  # the rank's GPU (UsageError on every rank alike) and TF32
    except UsageError as exc:
        # Every rank gets here together (the checks are deterministic or broadcast).
        if rank == 0:
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
        end_together(comm, EXIT_USAGE)
    try:
        code = run_rank(config, comm, sys.argv, started)
        if code:
            end_together(comm, code)  # e.g. 75 after a checkpoint
        return code
    except UsageError as exc:
        if rank == 0:
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
        _abort(comm, EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - every rank must end, not hang
        from ...trace.writer import TraceExists
        if isinstance(exc, TraceExists):  # another run took the trace path after the launch checks
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
            _abort(comm, EXIT_USAGE)  # a clash, as the launch checks refuse it: not a failure
        if os.environ.get("MPIGRAD_DEBUG"):
            traceback.print_exc()
        print(f"mpigrad train: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        from .follower import RankFailure
        if isinstance(exc, RankFailure):
            exc.report()  # rank 0 closes the trace "failed" and ends the run (returns if it does not)
        _abort(comm, EXIT_FAILURE)
    return EXIT_FAILURE


def check_only(config: RunConfig, ranks: int | None) -> int:
    """``mpigrad train --check``: the config's notes, then ``jobcheck.check_job``'s report on
    stdout and 0 (UsageError, one line and exit 2 through the cli, on the first problem)."""
    began = time.monotonic()
    from .jobcheck import check_job

    for note in config.notes:
        print(note, flush=True)
    lines = check_job(config, ranks)
    for line in lines:
        print(line)
    print(f"mpigrad train --check: ok in {time.monotonic() - began:.1f} s (no rank started)", flush=True)
    return 0


def _abort(comm, code: int) -> None:
    """MPI_Abort every rank, after giving the launcher a moment to forward our last message
    (an abort can kill its output forwarding before the line gets out)."""
    time.sleep(_FORWARD_SECONDS)
    comm.Abort(code)


_FORWARD_SECONDS = 0.5


def end_together(comm, code: int) -> NoReturn:
    """Finalize every rank cleanly, then exit each with ``code`` (a non-zero one from rank 0
    first).

    A finalized MPI exits with a non-zero code instead of calling MPI_Abort (whose banner
    would follow the one-line error, and which kills ranks that may still be writing).
    Only for paths that every rank reaches together, with every file closed.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    comm.Barrier()
    MPI.Finalize()
    if code and rank:
        # Rank 0 (which printed the one line) exits first: Open MPI's launcher ends the job at
        # the first non-zero exit, and output of a rank it then kills can be lost.
        time.sleep(_FORWARD_SECONDS)
    # Every file is closed (trace) or fsynced (checkpoint) by now: skip the interpreter's
    # teardown of torch, Numba and h5py, which takes seconds per rank (a stop near the
    # walltime should not spend them; measured in the issue-13 report).
    _exit_skipping_teardown(code)


def _exit_skipping_teardown(code: int) -> NoReturn:
    """Exit through the C library's ``exit``: its atexit handlers run, Python's do not.

    Not ``os._exit``: MPICH tells its process manager that a rank finished from a C atexit
    handler (PMI finalize), and hydra SIGKILLs the ranks still running when one exits
    without it, so ``mpiexec`` reported 9 instead of ``code`` whenever a rank was late.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes

        libc_exit = ctypes.PyDLL(None).exit  # PyDLL: the GIL stays held while C tears down
    except (ImportError, OSError, AttributeError):  # no C library to load: lose only the handlers
        os._exit(code)
    libc_exit(code)
    os._exit(code)  # not reached
