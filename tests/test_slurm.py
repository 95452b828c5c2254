"""The jobscripts under a real Slurm: submitted with sbatch, watched with squeue/scontrol.

A private single-node cluster (tests/slurm_cluster.py) is started once per session where
this machine allows it: Slurm already installed, or root with apt-get to install Debian's
``slurmctld slurmd munge``. Otherwise every test here is skipped with the reason. Jobs are
tiny (digits, narrow FC layers, few iterations) and every wait is bounded; a failure shows
the job's record, its log and the tail of slurmd's log.

The mpich wheel speaks PMI-2 under srun, so the jobs run with ``MPIGRAD_SRUN_MPI=pmi2``,
as README's users with the wheel do; the cluster keeps Slurm's default ``MpiDefault=none``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_same_trace, run_mpi
from slurm_cluster import PrivateSlurm, SlurmError, SlurmUnavailable, ensure_installed

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]

#: Small but real, in the spirit of conftest.SMALL_RUN: the two FC layers stay quantized.
TINY = ["--model-opt", "fc_sizes=[64,64]", "--min-quantize-size", "1000", "--progress-every", "5"]

#: A deterministic 2-rank run: a fixed compute time and the modelled network. The Slurm runs
#: sleep their modelled transfers (sleep mode charges the clock exactly as virtual mode does),
#: so that they last long enough for a signal to land midway, at almost no CPU cost.
DETERMINISTIC = """\
# ranks: 2
iterations = 100
data = "digits"
model_opts = { fc_sizes = [64, 64] }
min_quantize_size = 1000
codec = "uniform"
policy = "adaptive"
bits = 4
compute_time = "10ms"
latency = "40ms"
bandwidth = "1GB/s"
seed = 7
eval_every = 50
progress_every = 5
trace_flush = 20
"""


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running private Slurm, or a skip/failure that says exactly why not."""
    try:
        installed = ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm for the jobscript tests: {exc}")
    cluster = PrivateSlurm(tmp_path_factory.mktemp("slurm"))
    began = time.monotonic()
    try:
        cluster.start()
    except SlurmError as exc:
        pytest.fail(f"private Slurm did not start ({installed}): {exc}", pytrace=False)
    sys.stderr.write(f"\n[slurm] {installed}; daemons up in {time.monotonic() - began:.1f} s\n")
    yield cluster
    cluster.stop()


class Submitter:
    """A submit directory holding the checkout's jobscripts/ and examples/ (as a user's
    checkout does), and the environment a user with the mpich wheel submits from."""

    def __init__(self, cluster: PrivateSlurm, root: Path, numba_cache: Path):
        self.cluster = cluster
        self.dir = root
        (root / "jobscripts").symlink_to(REPO / "jobscripts")
        (root / "examples").symlink_to(REPO / "examples")
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "MPIGRAD_", "NUMBA_", "OMP_", "MKL_", "HDF5_"))}
        # Modules are loaded and the venv active: its python is first on PATH.
        self.env.update(cluster.env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                        MPIGRAD_SRUN_MPI="pmi2", MPIGRAD_NUMBA_CACHE=str(numba_cache),
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

    def sbatch(self, *args: str, **env: str) -> str:
        result = self.cluster.run(["sbatch", "--parsable", *args], cwd=self.dir, env={**self.env, **env})
        return result.stdout.strip().split(";")[0]

    def log(self, name: str) -> str:
        path = self.dir / name
        return path.read_text(errors="replace") if path.exists() else f"({name} not written)"

    def wait(self, job: str, states: tuple[str, ...], timeout: float, log: str,
             until=None) -> dict[str, str]:
        """Poll ``scontrol show job`` until its state is one of ``states`` (and ``until(job)``)."""
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.cluster.job(job)
            if record["JobState"] in states and (until is None or until(record)):
                return record
            time.sleep(1)
        pytest.fail(f"job {job} not {'/'.join(states)} within {timeout:.0f} s: {record}\n"
                    f"--- {log} ---\n{self.log(log)}\n{self.cluster.log_tail('slurmd')}", pytrace=False)

    def wait_for_text(self, job: str, log: str, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log(log))
            if match:
                return match
            if self.cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING"):
                break
            time.sleep(0.5)
        pytest.fail(f"{log} never showed {pattern!r} (job {self.cluster.job(job)}):\n{self.log(log)}",
                    pytrace=False)


@pytest.fixture(scope="session")
def numba_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("numba-cache")


@pytest.fixture
def submit(slurm, tmp_path, numba_cache):
    return Submitter(slurm, tmp_path, numba_cache)


def _load(path: Path):
    from mpigrad.trace import load
    return load(str(path))


# --- a normal job ------------------------------------------------------------------------

def test_train_job_completes_with_a_complete_trace(submit, numba_cache):
    job = submit.sbatch("--ntasks=4", "--time=20", "jobscripts/train.sbatch", "examples/quick/mqgrad.toml",
                        "--iterations", "12", "--eval-every", "6", *TINY)
    log = f"mpigrad-train-{job}.out"
    record = submit.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 600, log)
    text = submit.log(log)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text
    assert "mpigrad-job: run finished" in text
    # The launch as the user sees it: srun with the PMI they chose, a --walltime from the
    # job's time limit (20 min less MPIGRAD_END_MARGIN's 60 s, give or take the start-up).
    step = re.search(r"mpigrad-job: step: (.*)", text)[1]
    assert step.startswith("srun --kill-on-bad-exit=0 --mpi=pmi2 python -m mpi4py -m mpigrad train ")
    walltime = int(re.search(r"--walltime (\d+)s", step)[1])
    assert 1100 <= walltime <= 1140, step
    # Numba's cache is the persistent one for this CPU type, and was filled.
    cache = re.search(r"NUMBA_CACHE_DIR=(\S+)", text)[1]
    assert Path(cache).parent == numba_cache and Path(cache).name.startswith("cpu-")
    assert any(Path(cache).rglob("*.nbi")), "the kernels were not cached"
    trace = _load(submit.dir / f"runs/mqgrad-{job}.h5")
    assert trace.complete and trace.status == "complete"
    assert trace.steps["iteration"].tolist() == list(range(12))
    assert (trace.attrs["job_id"], trace.attrs["cluster"], trace.attrs["ntasks"]) == (job, "mpigradtest", "4")


# --- walltime: signal, checkpoint, requeue, resume ---------------------------------------

def test_walltime_signal_requeues_and_resumes_to_the_straight_trace(submit, mpi_env):
    """The walltime warning (USR1 to the batch shell, as ``#SBATCH --signal=B:USR1@120`` asks)
    stops the run; the job requeues itself, resumes, and the trace equals one run straight
    through.

    The test sends the warning itself, with ``scancel --batch --signal=USR1``: that is what
    slurmctld does when the warning falls due, to the same process. Waiting for Slurm's own
    timer instead is too loose for a test: limits are whole minutes and slurmctld checks them
    every 30 s, so the signal lands anywhere in a 90 s window (CI once saw the run finish
    first)."""
    (submit.dir / "det.toml").write_text(DETERMINISTIC)
    job = submit.sbatch("--ntasks=2", "--time=10", "jobscripts/train.sbatch", "det.toml", "--net-mode", "sleep")
    log = f"mpigrad-train-{job}.out"
    submit.wait_for_text(job, log, r"iter +5/100", 600)
    submit.cluster.run(["scancel", "--batch", "--signal=USR1", job])

    def requeued(record):
        return int(record["Restarts"]) >= 1

    submit.wait(job, ("PENDING",), 240, log, until=requeued)
    # A requeued job is held about two minutes (EligibleTime); release it, with time enough,
    # but not within the second of the requeue: slurmd revokes the old start's credential
    # with a one-second resolution and kills a restart in that second ("Job credential
    # revoked": the job ends FAILED without running; seen once in CI). The private cluster's
    # schedulers run every 2 s (sched_interval, bf_interval): with Slurm's 60 s and 30 s the
    # restart waited up to a minute for a pass after its StartTime.
    submit.cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3", "TimeLimit=10"])
    record = submit.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 600, log)
    text = submit.log(log)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", text
    assert "batch shell got SIGUSR1: asking the job step" in text
    stopped = re.search(r"received SIGUSR1: stopped after iteration (\d+)", text)
    assert stopped, text
    assert 5 <= int(stopped[1]) < 100, "the run was meant to stop midway"
    assert f"requeueing job {job}, the next start resumes" in text
    assert f"resuming from runs/det-{job}.h5.ckpt at iteration {stopped[1]}" in text
    assert text.count(f"mpigrad-job: job {job} restart") == 2, "--open-mode=append keeps both starts"

    straight = submit.dir / "straight.h5"
    result = run_mpi(2, ["train", "--config", "det.toml", "--trace", str(straight), "--net-mode", "virtual"],
                     mpi_env, timeout=600, cwd=submit.dir)
    assert result.returncode == 0, result.stderr
    resumed = _load(submit.dir / f"runs/det-{job}.h5")
    assert resumed.complete and resumed.steps["iteration"].tolist() == list(range(100))
    assert_same_trace(_load(straight), resumed)


# --- a job array ---------------------------------------------------------------------------

def test_sweep_array_writes_one_trace_per_task(submit):
    """Fix 2, MQGrad and L-GreCo (a per-layer method) as tasks of one array; test_jobscripts
    runs every task of the sweep through fake Slurm, test_perlayer_policies each method in a
    real run (five 4-rank tasks here took 72 s of CI's 2 cores)."""
    job = submit.sbatch("--ntasks=4", "--time=20", "--array=0,4,6", "jobscripts/sweep.sbatch", "examples/quick",
                        "--iterations", "6", "--eval-every", "3", *TINY)
    methods = {0: "fix2", 4: "mqgrad", 6: "lgreco"}
    for task, method in methods.items():
        log = f"mpigrad-sweep-{job}_{task}.out"
        record = submit.wait(f"{job}_{task}", ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 900, log)
        assert record["JobState"] == "COMPLETED", submit.log(log)
        trace = _load(submit.dir / f"runs/quick/{method}-{job}_{task}.h5")
        assert trace.complete and trace.steps["iteration"].tolist() == list(range(6))
        assert trace.config["policy"] == ("fixed" if method.startswith("fix") else method)
        assert (trace.attrs["array_job_id"], trace.attrs["array_task_id"]) == (job, str(task))
    assert sorted(p.name for p in (submit.dir / "runs" / "quick").glob("*.h5")) == \
        sorted(f"{m}-{job}_{i}.h5" for i, m in methods.items())


# --- scancel and a dead worker -------------------------------------------------------------

def test_scancel_stops_at_a_checkpoint_and_the_trace_says_so(submit):
    (submit.dir / "det.toml").write_text(DETERMINISTIC)
    job = submit.sbatch("--ntasks=2", "--time=20", "jobscripts/train.sbatch", "det.toml", "--net-mode", "sleep")
    log = f"mpigrad-train-{job}.out"
    submit.wait_for_text(job, log, r"iter +5/100", 600)
    submit.cluster.run(["scancel", job])
    record = submit.wait(job, ("CANCELLED", "COMPLETED", "FAILED"), 120, log)
    text = submit.log(log)
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", text
    trace = _load(submit.dir / f"runs/det-{job}.h5")
    assert trace.status == "stopped" and not trace.complete, text
    assert 5 <= len(trace.steps) < 100
    assert (submit.dir / f"runs/det-{job}.h5.ckpt").exists()
    assert "batch shell got SIGTERM: asking the job step" in text
    assert re.search(r"received SIG(TERM|USR1): stopped after iteration", text), text
    assert "after SIGTERM (scancel or preemption): not requeueing" in text


def test_dead_worker_fails_the_job_and_the_trace_says_failed(submit):
    """A worker that dies without a word (os._exit, as a segfault or the OOM killer would):
    rank 0 names it within --timeout, the job fails without requeueing, the trace says so."""
    (submit.dir / "det.toml").write_text(DETERMINISTIC)
    job = submit.sbatch("--ntasks=2", "--time=20", "jobscripts/train.sbatch", "det.toml",
                        "--net-mode", "virtual", "--iterations", "40", "--eval-every", "0",
                        "--trace-flush", "5", "--timeout", "10s", MPIGRAD_INJECT_FAULT="exit:1:12")
    log = f"mpigrad-train-{job}.out"
    record = submit.wait(job, ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"), 600, log)
    text = submit.log(log)
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", text
    assert record["Restarts"] == "0" and "run failed with exit status" in text
    assert re.search(r"rank.{0,4} 1\b.*iteration 12", text), "rank 0 names the dead rank"
    trace = _load(submit.dir / f"runs/det-{job}.h5")
    assert trace.status == "failed" and not trace.complete, text
    assert len(trace.steps) <= 12


# --- the multi-node and GPU examples -------------------------------------------------------

def _steps(path: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("script, options", [
    ("multinode.sbatch", ["--nodes=1", "--ntasks-per-node=2"]),
    ("gpu.sbatch", ["--ntasks=2", "--cpus-per-task=1"]),
])
def test_multinode_and_gpu_examples(submit, script, options):
    """Both run train.sbatch's job; gpu.sbatch gives each rank a GPU of its own (stand-in
    devices of the private cluster; tests/fake_step.py as the step records what it saw)."""
    (submit.dir / "fake.toml").write_text("iterations = 3\n")
    steps = submit.dir / "steps.jsonl"
    job = submit.sbatch(*options, "--time=10", f"jobscripts/{script}", "fake.toml",
                        MPIGRAD_TRAIN_CMD=f"{sys.executable} {REPO / 'tests' / 'fake_step.py'}",
                        FAKE_STEP_LOG=str(steps), FAKE_STEP_SECONDS="0.01")
    log = f"mpigrad-{script.removesuffix('.sbatch')}-{job}.out"      # --output=%x-%j.out
    record = submit.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300, log)
    text = submit.log(log)
    assert record["JobState"] == "COMPLETED", text
    assert f"rank 0 (the server) runs on {submit.cluster.node}, the first of 1 node(s)" in text
    ranks = sorted(_steps(steps), key=lambda step: step["rank"])
    assert [(s["rank"], s["size"], s["exit"]) for s in ranks] == [(0, 2, 0), (1, 2, 0)], text
    assert [s["env"]["SLURMD_NODENAME"] for s in ranks] == [submit.cluster.node] * 2
    if script == "gpu.sbatch":
        assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in ranks) == ["0", "1"], ranks
