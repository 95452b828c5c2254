"""End-to-end training runs under a real mpiexec: protocol, determinism, failures, bad input."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import SMALL_RUN, run_mpi
from mpigrad.trace import load, read_raw

pytestmark = pytest.mark.mpi

DETERMINISTIC = ["--net-mode", "virtual", "--compute-time", "20ms", "--seed", "7"]


def train(tmp_path, env, *extra, ranks=3, name="run.h5", timeout=180):
    trace = tmp_path / name
    result = run_mpi(ranks, ["train", "--trace", str(trace), *SMALL_RUN, *extra], env, timeout=timeout)
    return result, trace


@pytest.mark.quick  # the quick tier's real mpiexec run
@pytest.mark.each_mpi
def test_training_run_learns_and_traces_every_iteration(tmp_path, mpi_env):
    result, trace = train(tmp_path, mpi_env, "--iterations", "150", "--policy", "fixed", "--bits", "4",
                          "--lr", "0.1", "--weight-decay", "0", "--eval-every", "50")
    assert result.returncode == 0, result.stderr
    last = [line for line in result.stdout.splitlines() if line.startswith("iter 150/150")]
    # The printed loss says what it holds (no l2 term at --weight-decay 0: "loss", not "loss+l2",
    # which tests/test_analysis_defects.py checks for the other cases); the accuracy says when
    # it was measured.
    assert len(last) == 1 and "  loss " in last[0] and "loss+l2" not in last[0] and last[0].endswith(" @150"), \
        result.stdout
    tr = load(trace)
    assert tr.complete and tr.label == "Fix (4-bit)"
    steps = tr.steps
    assert list(steps["iteration"]) == list(range(150))
    assert (steps["bits"] == 4).all()
    # Real digits, 4-bit gradients: the loss falls and the test accuracy is far above chance.
    assert steps["loss"].iloc[-10:].mean() < 0.6 * steps["loss"].iloc[:5].mean()
    assert list(tr.eval["iteration"]) == [49, 99, 149]
    assert tr.eval["test_accuracy"].iloc[-1] > 0.6
    # Each worker sent a frame every iteration; the modelled clock moved every iteration.
    assert (tr.workers.filter(like="bytes").to_numpy() > 0).all()
    assert (steps["bytes_down"] > 0).all() and (steps["sim_time"].diff().iloc[1:] > 0).all()
    # Replica checksums were recorded for every rank at iterations 0, 50, 100 (and agreed).
    assert list(tr.checksums["iteration"]) == [0, 50, 100]
    assert tr.checksums.filter(like="checksum").nunique(axis=1).eq(1).all()


#: fp32 frames (lossless: test_fp32_run_is_exactly_sgd_on_the_averaged_gradient) on a modelled
#: 8 Mbit/s star with 1 ms latency, every message on the clock (--control paper; ahead:
#: tests/test_control_ahead.py). The network flags move only the clock, not the parameters.
FP32_SEED, FP32_LR, FP32_STEPS = 5, 0.05, 6
FP32_RUN = ["--codec", "fp32", "--policy", "fixed", "--iterations", str(FP32_STEPS), "--seed", str(FP32_SEED),
            "--lr", str(FP32_LR), "--checksum-every", "5", "--bandwidth", "8Mbps", "--latency", "1ms",
            "--compute-time", "0", "--cost-model", "none", "--control", "paper"]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, mpi_env):
    """FP32_RUN's result and trace, the trace in a two-level directory not there before."""
    return train(tmp_path_factory.mktemp("fp32"), mpi_env, *FP32_RUN, name="runs/quick/run.h5")


def test_network_model_charges_bytes_over_bandwidth(fp32_run):
    """Also: the trace's directory (two levels, not there before) is created."""
    result, trace = fp32_run
    assert result.returncode == 0, result.stderr
    assert load(trace).complete
    # 8 Mbit/s is 1 MB/s; the start-up lines say so in both units.
    assert "network: 1MB/s (8Mbit/s) per link, latency 1ms per message" in result.stdout, result.stdout
    steps = load(trace).steps
    workers = 2
    # Star model: every message costs latency + bytes / bandwidth, serialised on rank 0's link.
    expected = (steps["bytes_up"] + steps["bytes_down"]) / 1e6 + 1e-3 * 4 * workers
    np.testing.assert_allclose(steps["t_comm"], expected, rtol=1e-9)
    np.testing.assert_allclose(np.diff(steps["sim_time"]), steps["t_comm"].iloc[1:], rtol=1e-9)


def test_a_trace_directory_that_is_a_file_is_refused(tmp_path, mpi_env):
    """(That a missing directory is created: test_network_model_charges_bytes_over_bandwidth.)"""
    (tmp_path / "file").write_text("not a directory")
    result = run_mpi(3, ["train", "--trace", str(tmp_path / "file" / "run.h5"), "--iterations", "2"],
                     mpi_env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"mpigrad train: error: {tmp_path / 'file'}, where the trace should go, "
                                     "is not a directory"), result.stderr


def test_a_config_written_for_other_ranks_is_refused(tmp_path, mpi_env):
    config = tmp_path / "four.toml"
    config.write_text("# Fix 2 for 1 server + 3 workers.\n# ranks: 4\npolicy = \"fixed\"\n")
    result = run_mpi(3, ["train", "--config", str(config), "--trace", str(tmp_path / "x.h5"), "--iterations", "2"],
                     mpi_env, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (f"mpigrad train: error: {config} is written for 4 ranks (its '# ranks: 4' line) but "
                             "this run has 3: launch with mpiexec -n 4, or edit that line in a copy\n")
    assert not (tmp_path / "x.h5").exists()


def test_existing_trace_is_not_overwritten_without_force(tmp_path, mpi_env):
    trace = tmp_path / "keep.h5"
    trace.write_bytes(b"precious results")
    result = run_mpi(3, ["train", "--trace", str(trace), "--iterations", "2"], mpi_env, timeout=120)
    assert result.returncode == 2
    assert "exists; pass --force" in result.stderr
    assert trace.read_bytes() == b"precious results"


@pytest.mark.parametrize("args, message", [
    (["--bandwidth=-5MB/s"], "cannot read bandwidth '-5MB/s'"),
    (["--bandwidth"], "argument --bandwidth: expected one argument"),
    (["--net-mode", "warp"], "argument --net-mode: invalid choice"),
    (["--codec", "nope"], "unknown codec 'nope'"),
    (["--bits", "40"], "bits must be in"),
    (["--policy", "mqgrad", "--codec", "sign"], "has no bits option"),
    (["--policy", "schedule"], "--policy schedule needs its schedule"),
    (["--checkpoint-every", "0"], "checkpoint_every must be a positive"),
    (["--checkpoint-every", "10 parsecs"], "cannot read"),
    (["--model-opt", "fc_sizes=[256,256]", "--min-quantize-size", "120000"],
     "codec 'uniform' would quantize nothing: the largest layer of this model has 102,400 elements"),
    pytest.param(["--device", "cuda"], "torch sees no CUDA device",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="has CUDA")),
])
@pytest.mark.each_mpi
def test_bad_options_fail_before_work_with_one_line(tmp_path, mpi_env, args, message):
    result = run_mpi(3, ["train", "--trace", str(tmp_path / "x.h5"), "--iterations", "2", *args],
                     mpi_env, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpigrad train: error")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # no MPI_Abort banner
    assert not (tmp_path / "x.h5").exists()


def test_bad_options_are_refused_before_torch_and_mpi_start():
    """What makes a refusal fast: neither torch nor MPI is imported to check the options."""
    probe = ("import sys\nfrom mpigrad.cli import main\ncode = main(sys.argv[1:])\n"
             "print(code, 'torch' in sys.modules, 'mpi4py.MPI' in sys.modules)")
    for args in (["--codec", "nope"], ["--policy", "schedule"], ["--bandwidth", "fast"], ["--bandwidth", "10"],
                 ["--bandwidth", "100mbps"]):
        result = subprocess.run([sys.executable, "-c", probe, "train", *args], capture_output=True,
                                text=True, timeout=120)
        assert result.stdout.split() == ["2", "False", "False"], (args, result.stdout, result.stderr)
        assert result.stderr.startswith("mpigrad train: error:") and result.stderr.count("\n") == 1


def test_help_lists_the_registered_codecs_and_policies():
    from mpigrad.codecs import available as codecs
    from mpigrad.policies import available as policies

    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--help"], capture_output=True,
                            text=True, timeout=120)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0
    assert "gradient codec: " + " | ".join(codecs()) in text
    assert "bit policy: " + " | ".join(policies()) in text


def test_one_rank_is_refused(tmp_path, mpi_env):
    result = run_mpi(1, ["train", "--trace", str(tmp_path / "x.h5")], mpi_env, timeout=120)
    assert result.returncode == 2
    assert "at least 2 MPI ranks" in result.stderr


def test_world_size_must_match_slurm_ntasks(tmp_path, mpi_env):
    env = dict(mpi_env, SLURM_NTASKS="4")
    result = run_mpi(3, ["train", "--trace", str(tmp_path / "x.h5")], env, timeout=120)
    assert result.returncode == 2
    assert "SLURM_NTASKS" in result.stderr


#: A worker raises at iteration 3; rank 0's --timeout is long enough that the worker's error
#: report (message 8), not the timeout, ends the run.
RAISE_RUN = ["--iterations", "50", "--timeout", "20", "--trace-flush", "2"]


@pytest.fixture(scope="module")
def worker_that_raises(tmp_path_factory, mpi_env):
    """RAISE_RUN with rank 2 raising at iteration 3: its result and trace."""
    env = dict(mpi_env, MPIGRAD_INJECT_FAULT="raise:2:3")
    return train(tmp_path_factory.mktemp("raise"), env, *RAISE_RUN, timeout=90)


@pytest.mark.parametrize("fault, message", [
    ("raise:2:3", "rank 2: error: injected fault at iteration 3"),
    ("nan-loss:1:4", "worker rank 1 computed a non-finite loss (nan) at iteration 4"),
    ("nan-grad:2:2", "worker rank 2 computed a non-finite gradient at iteration 2"),
    ("hang:1:3", "worker rank(s) 1 sent no loss for iteration 3 within 5 s"),
])
@pytest.mark.each_mpi
def test_failures_end_every_rank_with_a_message(tmp_path, mpi_env, request, fault, message):
    if fault == "raise:2:3":  # the run test_a_rank_that_raises_has_rank_0_close_the_trace_failed reads
        result, trace = request.getfixturevalue("worker_that_raises")
    else:
        env = dict(mpi_env, MPIGRAD_INJECT_FAULT=fault)
        result, trace = train(tmp_path, env, "--iterations", "50", "--timeout", "5", timeout=90)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    # MPI_Abort SIGKILLs rank 0, so its trace stays marked as running; it still opens,
    # with every row up to the last flush (none where the run died before the first flush;
    # raise:2:3's rank 0 closes it "failed" with rows 0..2 first).
    if trace.exists():
        tr = load(trace)
        assert not tr.complete and tr.status in ("failed", "running")
        with h5py.File(trace, "r", swmr=True) as f:
            assert f["steps/_rows"][()] == len(tr.steps)
    if fault.startswith("hang"):
        # Rank 0 saw it and closed the trace itself: failed, why, and the last whole iteration.
        tr = load(trace)
        assert (tr.status, tr.attrs["last_iteration"]) == ("failed", 2)
        assert message in tr.attrs["error"] and list(tr.steps["iteration"]) == [0, 1, 2]
        with h5py.File(trace, "r") as f:  # closed cleanly: plain h5py opens it
            assert f.attrs["status"] == "failed"


@pytest.mark.parametrize("fault, ranks, extra, named", [
    ("raise:2:3", 3, [], "worker rank 2 failed at iteration 3: injected fault at iteration 3"),
    ("raise:1:3", 4, ["--servers", "2"], "server rank 1 failed at iteration 3: injected fault at iteration 3"),
    ("raise:1:3", 3, ["--servers", "colocated"], "worker rank 1 failed at iteration 3: injected fault at iteration 3"),
])
def test_a_rank_that_raises_has_rank_0_close_the_trace_failed(tmp_path, mpi_env, request, fault, ranks, extra,
                                                              named):
    """The failed rank sends rank 0 an error report (message 8): rank 0 names it, closes the
    trace "failed" with the rows before it, and ends the run (no trace left "running")."""
    if (fault, extra) == ("raise:2:3", []):
        result, trace = request.getfixturevalue("worker_that_raises")
    else:
        env = dict(mpi_env, MPIGRAD_INJECT_FAULT=fault)
        result, trace = train(tmp_path, env, *RAISE_RUN, *extra, ranks=ranks, timeout=90)
    assert result.returncode != 0
    assert f"rank 0: error: {named}" in result.stderr, result.stderr
    tr = load(trace)
    assert (tr.status, tr.attrs["last_iteration"]) == ("failed", 2)
    assert named in tr.attrs["error"] and list(tr.steps["iteration"]) == [0, 1, 2]
    with h5py.File(trace, "r") as f:  # closed by rank 0: plain h5py opens it
        assert f.attrs["status"] == "failed"


def test_fp32_run_is_exactly_sgd_on_the_averaged_gradient(fp32_run):
    """With lossless fp32 frames, 2 workers equal one process stepping on the mean gradient."""
    import zlib

    import torch

    from mpigrad.data import ShardSampler, load_dataset
    from mpigrad.models import build_model
    from mpigrad.runtime.exchange.replica import Replica

    seed, lr, steps = FP32_SEED, FP32_LR, FP32_STEPS
    result, trace = fp32_run
    assert result.returncode == 0, result.stderr
    recorded = load(trace).checksums.set_index("iteration")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran with one thread each: same reduction order
    try:
        data = load_dataset("digits", seed=seed)
        torch.manual_seed(seed)
        model = build_model("paper-cnn", input_shape=data.input_shape, num_classes=data.num_classes,
                            fc_sizes=[256, 256])
        replica = Replica(model, 10000, torch.device("cpu"))
        samplers = [ShardSampler(len(data.train_y), w, 2, 32, seed) for w in range(2)]
        checksums = {}
        for m in range(steps):
            checksums[m] = zlib.crc32(replica.flat.detach().numpy().view(np.uint8))
            grads = []
            for sampler in samplers:
                idx = sampler.next_batch()
                replica.flat_grad.zero_()
                model.loss(model(torch.from_numpy(data.train_x[idx])), torch.from_numpy(data.train_y[idx]),
                           0.004).backward()
                grads.append(replica.flat_grad.numpy().copy())
            mean = (grads[0] + grads[1]) * np.float32(0.5)
            replica.flat.add_(torch.from_numpy(mean), alpha=-lr)
    finally:
        torch.set_num_threads(threads)
    for m in (0, 5):
        assert (recorded.loc[m].to_numpy() == checksums[m]).all(), m


@pytest.mark.each_mpi
def test_a_worker_that_dies_ends_the_run_instead_of_hanging(tmp_path, mpi_env):
    # The launcher sees the dead process and kills every rank (MPICH's mpiexec reports the
    # dead process's exit code, or the SIGKILL it sent the others, and "BAD TERMINATION");
    # rank 0's --timeout covers a worker that hangs instead.
    env = dict(mpi_env, MPIGRAD_INJECT_FAULT="exit:2:3")
    result, trace = train(tmp_path, env, "--iterations", "500", "--timeout", "5", "--trace-flush", "2",
                          timeout=90)
    assert result.returncode in (3, 9), result.stdout + result.stderr
    assert "iter 500/500" not in result.stdout
    # mpiexec killed rank 0 too: the trace stays "running" with its writer's mark, and
    # `mpigrad trace repair` (what the jobscripts run after a failed launch) closes it.
    assert load(trace).status == "running"
    repaired = subprocess.run([sys.executable, "-m", "mpigrad", "trace", "repair", str(trace), "--error",
                               f"mpiexec exit {result.returncode}"], env=mpi_env, capture_output=True,
                              text=True, timeout=60)
    assert repaired.returncode == 0, repaired.stderr
    assert "status 'failed', last iteration 1" in repaired.stdout  # rows 0, 1 flushed before iteration 3
    with h5py.File(trace, "r") as f:
        assert f.attrs["status"] == "failed" and f.attrs["last_iteration"] == 1


@pytest.mark.each_mpi
def test_two_servers_give_the_one_server_run_bit_for_bit(tmp_path, mpi_env):
    """--servers 2 (ranks 0, 1 servers; 2, 3 workers), layer-aligned shards (--shard-chunk 0):
    the same seed gives the same losses and bit-identical parameters as one server with 2 workers."""
    args = ["--iterations", "12", "--policy", "mqgrad", "--codec", "qsgd", "--error-feedback", "residual",
            "--checksum-every", "4", "--shard-chunk", "0", *DETERMINISTIC]
    one, trace_one = train(tmp_path, mpi_env, *args, name="s1.h5", ranks=3)
    two, trace_two = train(tmp_path, mpi_env, *args, "--servers", "2", name="s2.h5", ranks=4)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "2 workers + 2 servers" in two.stdout
    a, b = load(trace_one), load(trace_two)
    np.testing.assert_array_equal(a.steps["loss"].to_numpy(), b.steps["loss"].to_numpy())
    np.testing.assert_array_equal(a.steps["bits"].to_numpy(), b.steps["bits"].to_numpy())
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    # Both servers received frames and broadcast their shard every iteration.
    assert b.attrs["servers"] == 2
    assert (b.servers.filter(like="bytes_in").to_numpy() > 0).all()
    assert (b.servers.filter(like="bytes_out").to_numpy() > 0).all()


@pytest.mark.each_mpi
def test_colocated_servers_give_the_one_server_run_bit_for_bit(tmp_path, mpi_env):
    """--servers colocated (rank 0 scheduler; ranks 1..3 workers, each serving a shard): the
    same losses, bits, parameters and evaluations as one server with 3 workers (whole layers,
    --shard-chunk 0), with fewer bytes on the busiest link and a shorter simulated iteration."""
    args = ["--iterations", "12", "--policy", "mqgrad", "--codec", "qsgd", "--error-feedback", "residual",
            "--checksum-every", "4", "--eval-every", "6", "--shard-chunk", "0", *DETERMINISTIC]
    one, trace_one = train(tmp_path, mpi_env, *args, name="s1.h5", ranks=4)
    col, trace_col = train(tmp_path, mpi_env, *args, "--servers", "colocated", name="col.h5", ranks=4)
    assert one.returncode == 0 and col.returncode == 0, one.stderr + col.stderr
    assert "3 workers + scheduler, each worker serving a shard (colocated)" in col.stdout
    a, b = load(trace_one), load(trace_col)
    for column in ("loss", "bits"):
        np.testing.assert_array_equal(a.steps[column].to_numpy(), b.steps[column].to_numpy())
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    np.testing.assert_array_equal(a.eval["test_accuracy"].to_numpy(), b.eval["test_accuracy"].to_numpy())
    assert b.attrs["servers"] == 3 and b.attrs["config"]["servers"] == "colocated"
    assert (b.servers.filter(like="bytes_out").to_numpy() > 0).all()
    assert (b.steps["bytes_up"] < a.steps["bytes_up"]).all() and (b.steps["t_comm"] < a.steps["t_comm"]).all()


def test_colocated_servers_share_the_big_layers_evenly_by_default(tmp_path, mpi_env):
    """--shard-chunk auto (the default): the paper CNN's 102400-element conv layer, alone 1.67x
    an even third of the quantized elements, is cut so that each of three colocated workers
    receives an even share of the float32 frames, which the start-up line and the trace say."""
    col, trace = train(tmp_path, mpi_env, "--iterations", "3", "--codec", "fp32", "--policy", "fixed",
                       "--servers", "colocated", *DETERMINISTIC, name="auto.h5", ranks=4)
    assert col.returncode == 0, col.stderr
    line = next(line for line in col.stdout.splitlines() if line.startswith("shards at the initial bits"))
    assert "(--shard-chunk auto)" in line and "quantized layers in pieces of at most 16,384 elements" in line, line
    tr = load(trace)
    received = tr.servers.filter(like="bytes_in").to_numpy()
    assert received.shape[1] == 3 and (received.max(axis=1) <= 1.1 * received.mean(axis=1)).all(), received
    assert tr.attrs["shards"]["setting"] == "auto" and len(tr.attrs["shards"]["pieces"]) == 3


@pytest.mark.each_mpi
def test_the_pipelined_iteration_gives_the_sequential_run_bit_for_bit(tmp_path, mpi_env):
    """--pipeline under real MPI (frames per bucket, posted receives, hooks in backward): the
    same losses, bits, parameters and evaluations as the sequential colocated run; on the
    deterministic clock (no backward to hide behind) its communication costs the same within
    its extra frame headers and the schedule of its messages (whole layers, --shard-chunk 0:
    auto's pieces make more buckets, each a message with its latency)."""
    args = ["--iterations", "12", "--policy", "adaptive", "--codec", "qsgd", "--error-feedback", "residual",
            "--checksum-every", "4", "--eval-every", "6", "--servers", "colocated", "--shard-chunk", "0",
            *DETERMINISTIC]
    seq, trace_seq = train(tmp_path, mpi_env, *args, name="seq.h5", ranks=4)
    pipe, trace_pipe = train(tmp_path, mpi_env, *args, "--pipeline", name="pipe.h5", ranks=4)
    assert seq.returncode == 0 and pipe.returncode == 0, seq.stderr + pipe.stderr
    a, b = load(trace_seq), load(trace_pipe)
    for column in ("loss", "bits"):
        np.testing.assert_array_equal(a.steps[column].to_numpy(), b.steps[column].to_numpy())
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    np.testing.assert_array_equal(a.eval["test_accuracy"].to_numpy(), b.eval["test_accuracy"].to_numpy())
    assert b.attrs["config"]["pipeline"] is True
    np.testing.assert_allclose(b.steps["t_comm"].to_numpy(), a.steps["t_comm"].to_numpy(), rtol=0.03)
    # its trace keeps the iteration bucket by bucket: re-timed to its own network, its own clock
    from mpigrad.analysis.retime import retime

    retime(trace_pipe, tmp_path / "same.h5", bandwidth=b.config["bandwidth"])
    same = load(tmp_path / "same.h5")
    for column in ("t_comm", "sim_time"):
        np.testing.assert_array_equal(same.steps[column].to_numpy(), b.steps[column].to_numpy())
    assert read_raw(trace_pipe).arrays["buckets"]["ready"].shape[:2] == (12, 3)


def test_a_shard_server_that_hangs_is_named_by_rank_0(tmp_path, mpi_env):
    env = dict(mpi_env, MPIGRAD_INJECT_FAULT="hang:1:3")
    result, _ = train(tmp_path, env, "--iterations", "50", "--timeout", "5", "--servers", "2",
                      ranks=4, timeout=90)
    assert result.returncode != 0
    assert "server rank(s) 1 sent no report for iteration 3 within 5 s" in result.stderr, result.stderr


def test_powersgd_warm_up_is_recorded_as_float32(tmp_path, mpi_env):
    """``start=2``: iterations 0-1 send every layer as float32 (32 bits in the trace and the
    progress line), the factors at factor_bits after."""
    trace = tmp_path / "lowrank.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), "--model-opt", "fc_sizes=[256,256]", "--codec", "powersgd",
                         "--policy", "fixed", "--codec-opt", "rank=2", "--codec-opt", "factor_bits=8",
                         "--codec-opt", "start=2", "--servers", "colocated", "--iterations", "4",
                         "--progress-every", "1", "--eval-every", "0"], mpi_env, timeout=120)
    assert result.returncode == 0, result.stderr
    steps = load(trace).steps
    assert list(steps["bits"]) == [32, 32, 8, 8]
    lines = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert [line.split("  bits ")[1].split()[0] for line in lines] == ["32", "32", "8", "8"], result.stdout


def test_the_start_up_lines_say_what_runs_in_one_form_each(tmp_path, mpi_env):
    """A plugin policy the cost model lacks: the local-work line says so after the cost, at
    the widths the policy may choose; the config line leaves the network to the network line
    and shows durations as written; the last progress line and the done line give the
    simulated time alike."""
    result, _ = train(tmp_path, mpi_env, "--policy", "mpigrad.policies.progress:ProgressPolicy", "--iterations", "3",
                      "--progress-every", "3", "--compute-time", "50ms", "--bandwidth", "10MB/s")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    work = next(line for line in lines if line.startswith("local work: "))
    assert work.startswith("local work: 50ms per iteration for compute, encode, decode and average by the package's "
                           "cost model (measured on "), work
    assert " per iteration at 2 bits to " in work and " at 8 bits; policy 'mpigrad.policies.progress:ProgressPolicy' " \
        "not in the model: not charged" in work, work
    config = next(line for line in lines if line.startswith("config: "))
    assert "bandwidth=" not in config and "latency=" not in config and " compute_time=50ms " in config, config
    assert "network: 10MB/s (80Mbit/s) per link" in result.stdout
    sim = next(line for line in lines if line.startswith("iter 3/3")).split("  sim ")[1].split()[0]
    assert f"simulated time {sim}; trace " in result.stdout, result.stdout
