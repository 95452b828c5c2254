"""MCGQ's dynamic sampling (Alg. 3) turned on from ``mpigrad train``, with real MPI runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SMALL_RUN, mpiexec, run_mpi
from mpigrad.runtime import EXIT_REQUEUE
from mpigrad.runtime.measure import checkpoint
from mpigrad.trace import load

pytestmark = pytest.mark.mpi

DYNAMIC = ["--codec", "mcgq", "--codec-opt", "dynamic=true", "--policy", "fixed", "--iterations", "60",
           "--model-opt", "fc_sizes=[256,256]", "--eval-every", "0"]


# A step large enough that K visibly moves (d is about 0.32 / (n K), so the default step
# of 1.0 moves K by ~1e-5 on these layers), and deterministic clocks so that traces compare.
# The server re-samples its broadcast with MCGQ too (not the paper's float32 default), so
# that every rank's encoder holds adapted codec state.
RESUMABLE = [*SMALL_RUN, *DYNAMIC, "--broadcast-codec", "same", "--codec-opt", "step=300", "--net-mode", "virtual",
             "--compute-time", "20ms", "--seed", "3", "--progress-every", "5"]


def test_dynamic_sampling_state_survives_stop_and_resume(tmp_path, mpi_env):
    straight = tmp_path / "straight.h5"
    result = run_mpi(3, ["train", "--trace", str(straight), *RESUMABLE], mpi_env)
    assert result.returncode == 0, result.stderr

    stopped = tmp_path / "stopped.h5"
    command = mpiexec(3, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train",
               "--trace", str(stopped), *RESUMABLE])
    process = subprocess.Popen(command, env=mpi_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if "iter 10/60" in line or (not line and process.poll() is not None):
                break
        os.killpg(process.pid, signal.SIGUSR1)
        out, err = process.communicate(timeout=120)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == EXIT_REQUEUE, err
    n_done = len(load(stopped).steps)
    assert 10 <= n_done < 60

    # The checkpoint holds each layer codec's adapted K and last distance, on every rank.
    state = checkpoint.read(f"{stopped}.ckpt")
    encoders = [state["server"]["compressor"]] + [w["compressor"] for w in state["workers"]]
    assert len(encoders) == 3
    for encoder in encoders:
        layers = sorted(layer for layer, _, _ in encoder["codecs"])
        assert layers == list(range(len(encoder["calls"]))) and encoder["calls"] == [n_done] * len(layers)
        for _, _, codec_state in encoder["codecs"]:
            assert codec_state["K"] != 0.1 and 0.01 <= codec_state["K"] <= 1.0
            assert codec_state["distance"] is not None
    # Each rank's layers adapt on their own.
    assert len({c["K"] for e in encoders for _, _, c in e["codecs"]}) == sum(len(e["codecs"]) for e in encoders)

    resumed = run_mpi(3, ["train", "--trace", str(stopped), *RESUMABLE, "--resume"], mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load(straight), load(stopped)
    assert b.complete and len(a.steps) == len(b.steps) == 60
    for table in ("steps", "workers", "checksums"):
        left, right = getattr(a, table), getattr(b, table)
        assert len(left) == len(right), table
        for column in left.columns:
            if not column.startswith(("wall_time", "t_compute", "t_encode", "t_decode", "t_policy")):
                np.testing.assert_array_equal(left[column].to_numpy(), right[column].to_numpy(),
                                              err_msg=f"{table}.{column}")
