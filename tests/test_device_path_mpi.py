"""The device path under a real mpiexec (runtime/exchange/device.py): the workers' codecs, the
colocated shard's decode-add, average and re-encode, the error memory and the update in
(simulated) device memory give the host path's run, iteration for iteration.

Without a GPU the path runs in Numba's CUDA simulator over CPU tensors
(NUMBA_ENABLE_CUDASIM=1, from conftest, and MPIGRAD_DEVICE_CODECS=simulator): every
kernel, buffer and copy of the path runs, on a model small enough for the simulator.
With MPIGRAD_TEST_GPU=1 on a GPU machine the same runs take ``--device cuda --share-gpu``
and are compared with the same GPU runs on the host codecs (MPIGRAD_DEVICE_CODECS=host):
cuDNN's backward is not bit-reproducible between two processes, so there the losses agree
to a tolerance and the bytes sent exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import run_mpi
from mpigrad.trace import load

pytestmark = pytest.mark.mpi

ON_GPU = os.environ.get("MPIGRAD_TEST_GPU") == "1"

TINY = ["--model-opt", "fc_sizes=[32,32]", "--model-opt", "conv_channels=4", "--min-quantize-size", "500",
        "--net-mode", "off", "--eval-every", "3", "--progress-every", "1", "--checksum-every", "1",
        "--iterations", "3", "--policy", "fixed"]
#: Measured times, and the energies' ratio (torch's dot sums in another order than NumPy's).
TIMED = ("wall_time", "sim_time", "t_")


def run(tmp_path, env, name, *extra, device=True, phase_log=None, ranks=3):
    env = dict(env)
    if phase_log is not None:
        env["MPIGRAD_PHASE_LOG"] = str(phase_log)
    if ON_GPU:
        extra = ("--device", "cuda", "--share-gpu", *extra)
        if not device:
            env["MPIGRAD_DEVICE_CODECS"] = "host"
    elif device:
        env["MPIGRAD_DEVICE_CODECS"] = "simulator"
    trace = tmp_path / f"{name}.h5"
    result = run_mpi(ranks, ["train", "--trace", str(trace), *TINY, *extra], env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result, load(trace)


def assert_same_run(device, host):
    for table in ("steps", "workers", "eval", "policy", "checksums"):
        left, right = getattr(device, table), getattr(host, table)
        assert list(left.columns) == list(right.columns) and len(left) == len(right), table
        for column in left.columns:
            if column.startswith(TIMED):
                continue
            a, b = left[column].to_numpy(), right[column].to_numpy()
            if ON_GPU and a.dtype.kind == "f" and not column.startswith(("bytes", "bits")):
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6, err_msg=f"{table}.{column}")
            elif column.startswith("norm_ratio"):
                np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=column)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{table}.{column}")


@pytest.mark.parametrize("name, extra", [
    ("pipelined-fp16", ["--servers", "colocated", "--pipeline", "--codec", "fp16"]),   # float frames by table
    ("pipelined-uniform-feedback", ["--servers", "colocated", "--pipeline", "--codec", "uniform", "--bits", "3",
                                    "--codec-opt", "rounding=stochastic", "--error-feedback", "residual"]),  # by table
    ("one-server-uniform-momentum", ["--servers", "1", "--codec", "uniform", "--bits", "4", "--codec-opt",
                                     "bucket_size=128", "--momentum-correction", "0.9"]),
])
def test_the_device_path_trains_as_the_host_path_does(tmp_path, mpi_env, name, extra):
    pipelined = "--pipeline" in extra
    result, device = run(tmp_path, mpi_env, name, *extra, phase_log=tmp_path / "phases" if pipelined else None)
    where = "on the GPU" if ON_GPU else "in Numba's CUDA simulator"
    assert f"codecs: {where} (Numba CUDA kernels): gradients encoded and updates decoded in " \
        "device memory, the packed frames staged through pinned host memory" in result.stdout, result.stdout
    # every device kernel launched before iteration 0 (run_mpi fails on a rank's line naming
    # one first launched during the run), on both workers
    assert "device warm-up: every device kernel this run can use launched once on each of 2 worker(s) before " \
        "iteration 0, in parallel" in result.stdout, result.stdout
    host_result, host = run(tmp_path, mpi_env, name + "-host", *extra, device=False)
    assert "device warm-up" not in host_result.stdout
    assert device.complete and len(device.steps) == 3
    assert_same_run(device, host)
    if pipelined and not ON_GPU:
        # No wait inside backward: each bucket's frames are queued from its hook and sent once
        # the device has done them (here, the simulator, at once; on a GPU the one wait after
        # backward is "frames after backward"). The gradients phase's one synchronisation is
        # the re-encode of the worker's own bucket's average, after backward (TINY: one bucket
        # per shard). Before, every bucket's frames waited in its hook.
        from mpigrad.bench.device import last_iteration_counts

        counts = last_iteration_counts(tmp_path / "phases")
        for rank in (1, 2):
            syncs = {site: n for site, n in counts[rank]["gradients"]["sites"].items() if site.startswith("sync")}
            assert syncs == {"sync: frame and status": 1}, (rank, counts[rank])


#: What one iteration of the colocated path asks of the host (P = 2, uniform 3-bit with error
#: feedback; TINY quantizes one layer, fc2, which is worker 2's shard, and worker 1's shard is
#: the small layers), per worker and phase as (launches, synchronisations), counted at the
#: call sites (mpigrad/counters.py): the budget that a change adding a launch or
#: a synchronisation breaks. Iteration 2 is evaluated (TINY: --eval-every 3), so worker 1
#: sends rank 0 its parameters in "end"; TINY checksums every iteration ("losses").
#: Measured when the counters came (issue 46's "before"): 24-25 synchronisations per worker,
#: 3 per frame each way; one per frame since (the frame's copies and status waited for together),
#: one for all of a worker's frames of its gradient (``encode_shards``), and none per decode:
#: the decodes' status is read once per iteration, with the energies where the worker has some
#: (worker 2's "reports"), else before the update ("end"; worker 1's there also sends rank 0 its
#: parameters). Outside the two encodes' waits for the wire, an iteration neither evaluated nor
#: checksummed takes 2: the loss and that one read.
#: Launches: every frame goes by table, 3 to encode (its error memory fused in) and 2 to decode
#: whatever its pieces (a frame of the small layers, float32 only: 1 and 1); before, a uniform
#: piece took 9 to encode with its memory and 3 to decode: 22 and 40 per worker, now 13 and 21.
COLOCATED_BUDGET = {
    1: {"begin": (1, 1), "losses": (0, 1), "gradients": (6, 1), "broadcast": (5, 1), "end": (1, 2)},
    2: {"begin": (1, 1), "losses": (0, 1), "gradients": (8, 1), "broadcast": (7, 1), "reports": (4, 1),
        "end": (1, 0)},
}


def test_bench_device_counts_what_the_colocated_path_asks_of_the_host(tmp_path, mpi_env, world_relay):
    """``mpigrad bench device`` runs the colocated device path (in the simulator here, on the GPU
    where there is one) and prints the last iteration's launches and synchronisations per
    worker and phase; the run's trace is the host path's, as for the other device runs."""
    import json
    import subprocess
    import sys

    # whole layers (--shard-chunk 0): the budget's layout; auto's pieces would add launches
    name, extra = "colocated-counted", ["--servers", "colocated", "--shard-chunk", "0", "--codec", "uniform",
                                        "--bits", "3", "--codec-opt", "rounding=stochastic", "--error-feedback",
                                        "residual"]
    trace = tmp_path / f"{name}.h5"
    at = TINY.index("--iterations")
    tiny = TINY[:at] + TINY[at + 2:]   # bench device takes the iterations itself
    command = [sys.executable, "-m", "mpigrad", "bench", "device", "--ranks", "3", "--iterations", "3", "--json", "--",
               *tiny, *extra, "--trace", str(trace)]
    done = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    where = "on the GPU" if ON_GPU else "in Numba's CUDA simulator"
    assert report["iteration"] == 2 and report["where"] == where
    assert report["codecs"] == (f"codecs: {where} (Numba CUDA kernels): gradients encoded and updates decoded in "
                                "device memory, the packed frames staged through pinned host memory")
    counts = {int(rank): phases for rank, phases in report["ranks"].items()}
    assert counts[0] == {}                                  # rank 0: the scheduler asks nothing of a device
    for rank, budget in COLOCATED_BUDGET.items():
        got = {phase: (c["launches"], c["syncs"]) for phase, c in counts[rank].items()}
        assert got == budget, (rank, counts[rank])
        assert counts[rank]["begin"]["sites"] == {"sync: loss read": 1, "launch: torch": 1}   # the loss; zero_
    assert counts[1]["end"]["sites"]["sync: decodes' status"] == 1
    assert counts[2]["reports"]["sites"]["sync: decodes' status and energies"] == 1
    device = load(trace)
    assert device.complete and len(device.steps) == 3
    _, host = run(tmp_path, mpi_env, name + "-host", *extra, device=False)
    assert_same_run(device, host)


def test_a_codec_without_kernels_keeps_the_host_path_and_says_so(tmp_path, mpi_env):
    result, trace = run(tmp_path, mpi_env, "elias", "--servers", "colocated", "--codec", "qsgd", "--bits", "4",
                        "--codec-opt", "coding=elias")
    assert "codecs: on the host, the whole gradient copied out every iteration: qsgd: coding='elias' " \
           "(variable-length) has no GPU kernels (coding='fixed' has); it runs on the host" in result.stdout
    assert trace.complete


def test_the_hierarchical_exchange_keeps_its_codecs_on_the_host_and_says_so(tmp_path, mpi_env):
    """2 nodes x 2 workers with --exchange hierarchical where the device path is on (the
    simulator here, the GPU with MPIGRAD_TEST_GPU=1): the codecs stay on the host (the slices
    are host arrays), rank 0 says why, and the run is the host path's."""
    nodes = ("--servers", "colocated", "--ranks-per-node", "2", "--exchange", "hierarchical", "--codec", "uniform",
             "--bits", "4")
    result, device = run(tmp_path, mpi_env, "hier-device", *nodes, ranks=5)
    assert ("codecs: on the host, the whole gradient copied out every iteration: the hierarchical exchange's slices "
            "are host arrays\n") in result.stdout
    assert "device warm-up" not in result.stdout  # no worker took the device path
    _, host = run(tmp_path, mpi_env, "hier-host", *nodes, device=False, ranks=5)
    assert device.config["exchange"] == "hierarchical" and device.complete
    assert_same_run(device, host)
