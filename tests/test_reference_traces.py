"""No behaviour change: deterministic runs reproduce the traces recorded before runtime v2.

``tests/data/reference_traces.json`` was written by ``python tests/test_reference_traces.py
--record`` on the runtime as it was before the redesign (commit e84c41f), except
``qsgd-adaptive-residual``: issue 12 made the gradient policies observe the workers' average
before the re-quantization (a fix with no option to restore the old observation), so that
case was re-recorded on the pre-v2 runtime of issue 12 (commit 98b0f92). Each case runs a
small real ``mpiexec`` job in deterministic mode (``--net-mode virtual --compute-time``) and
compares every deterministic column bit for bit: losses (global and per worker), bits per
layer, bytes, simulated times, the parameter CRC of every rank at each checksum iteration
(the last one is the parameters after the final update but one), and the policy's records.
The same seed therefore gives the same trace run after run; ``mqgrad-3-workers`` also shows
that the server's float sum does not depend on the order in which frames arrive.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_RUN, run_mpi  # noqa: E402

REFERENCE = Path(__file__).resolve().parent / "data" / "reference_traces.json"
COMMON = [*SMALL_RUN, "--iterations", "13", "--net-mode", "virtual", "--compute-time", "20ms",
          "--checksum-every", "4", "--latency", "1ms", "--eval-every", "6"]
CASES = {
    "uniform-fixed-2": (3, ["--policy", "fixed", "--bits", "2", "--seed", "11"]),
    "mqgrad-3-workers": (4, ["--policy", "mqgrad", "--bits", "2", "--seed", "12"]),
    "qsgd-adaptive-residual": (3, ["--codec", "qsgd", "--codec-opt", "bucket_size=256", "--policy",
                                   "adaptive", "--bits", "4", "--error-feedback", "residual",
                                   "--seed", "13"]),
    # Recorded before --broadcast-codec (issue 12), when the server re-sampled MCGQ's average:
    # pinned to that, not to the float32 broadcast that is now mcgq's default.
    "mcgq-accumulate-tree": (3, ["--codec", "mcgq", "--policy", "fixed", "--bits", "4",
                                 "--error-feedback", "accumulate", "--broadcast", "tree",
                                 "--broadcast-codec", "same", "--seed", "14"]),
}
#: Stopped after iteration 0 by a walltime that has passed when the first iteration ends,
#: then resumed: the trace must equal the reference of the straight run.
RESUMED = ("qsgd-mqgrad-resumed", 3, ["--codec", "qsgd", "--policy", "mqgrad", "--bits", "3",
                                      "--error-feedback", "residual", "--seed", "15"])
STEP_COLUMNS = ("iteration", "loss", "bits", "bytes_up", "bytes_down", "t_comm", "sim_time")


def summarise(trace_path) -> dict:
    from mpigrad.trace import load

    tr = load(trace_path)
    steps = tr.steps
    out = {column: steps[column].tolist() for column in STEP_COLUMNS}
    out["bits_layers"] = steps.filter(like="bits_layers").to_numpy().tolist()
    out["worker_losses"] = tr.workers.filter(like="loss").to_numpy().tolist()
    out["worker_bytes"] = tr.workers.filter(like="bytes").to_numpy().tolist()
    out["checksums"] = tr.checksums.to_numpy().tolist()
    out["eval"] = tr.eval[["iteration", "test_loss", "test_accuracy"]].to_numpy().tolist()
    policy = tr.policy
    out["policy"] = [] if policy is None else \
        json.loads(policy.select_dtypes(exclude="object").to_json(orient="values", double_precision=15))
    return out


def run_case(tmp_path, env, name, ranks, args) -> dict:
    trace = tmp_path / f"{name}.h5"
    result = run_mpi(ranks, ["train", "--trace", str(trace), *COMMON, *args], env, timeout=240)
    assert result.returncode == 0, result.stderr
    return summarise(trace)


def run_resumed(tmp_path, env, name, ranks, args) -> dict:
    trace = tmp_path / f"{name}.h5"
    stopped = run_mpi(ranks, ["train", "--trace", str(trace), *COMMON, *args, "--walltime", "1s"],
                      env, timeout=240)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    resumed = run_mpi(ranks, ["train", "--trace", str(trace), *COMMON, *args, "--resume"], env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    return summarise(trace)


def compare(name: str, got: dict, expected: dict) -> None:
    for key, value in expected.items():
        if key == "policy":
            np.testing.assert_allclose(np.asarray(got[key], float), np.asarray(value, float),
                                       rtol=1e-14, err_msg=f"{name}: {key}")
        else:
            assert got[key] == value, f"{name}: {key} differs from the reference"


@pytest.mark.mpi
@pytest.mark.parametrize("name", [*CASES, RESUMED[0]])
def test_trace_matches_the_pre_redesign_reference(tmp_path, mpi_env, name):
    reference = json.loads(REFERENCE.read_text())
    if name == RESUMED[0]:
        got = run_resumed(tmp_path, mpi_env, *RESUMED)
    else:
        got = run_case(tmp_path, mpi_env, name, *CASES[name])
    compare(name, got, reference[name])


def record(extra: list[str]) -> None:
    """Write the reference file (run on the commit the file names)."""
    import os
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("SLURM_NTASKS", "SLURM_JOB_ID", "MPIGRAD_INJECT_FAULT"):
        env.pop(key, None)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ranks, args) in CASES.items():
            out[name] = run_case(Path(tmp), env, name, ranks, args + extra)
            print(name, "recorded", flush=True)
        straight = run_case(Path(tmp), env, RESUMED[0] + "-straight", RESUMED[1], RESUMED[2] + extra)
        resumed = run_resumed(Path(tmp), env, *RESUMED)
        compare("resume reproduces the straight run", resumed, straight)
        out[RESUMED[0]] = straight
    REFERENCE.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/test_reference_traces.py --record")
    record(sys.argv[2:])
