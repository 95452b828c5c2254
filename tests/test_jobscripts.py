"""The Slurm jobscripts, driven without a cluster.

Fake ``sbatch``/``srun``/``scontrol``/``scancel`` on PATH record their calls and run
everything locally: fake sbatch reads the script's ``#SBATCH`` header, runs a copy of the
script from a spool directory (as slurmd does) for each array task, appends to the
``--output`` file, delivers the ``--signal=B:...`` signal to the batch shell once the step
has written its trace, and starts the job again when ``scontrol requeue`` was called.
The step is tests/fake_step.py, which honours the train command's stop/resume contract.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from mpigrad.codecs import get_codec
from mpigrad.config import RunConfig
from mpigrad.policies import get_policy

REPO = Path(__file__).resolve().parents[1]
JOBSCRIPTS = REPO / "jobscripts"
EXAMPLES = REPO / "examples"
FAKE_STEP = REPO / "tests" / "fake_step.py"
SCRIPTS = sorted(JOBSCRIPTS.glob("*.sbatch")) + sorted(JOBSCRIPTS.glob("*.sh"))
TIMEOUT = 120

FAKE_SBATCH = r'''#!{python}
"""Fake sbatch: runs the job synchronously here, array tasks in order, requeues included."""
import os, re, shutil, signal, subprocess, sys, time
from pathlib import Path

state = Path(os.environ["FAKE_SLURM_DIR"])
with open(state / "calls.log", "a") as f:
    f.write("sbatch " + " ".join(sys.argv[1:]) + "\n")


def parse(tokens):
    opts = {{}}
    for token in tokens:
        m = re.fullmatch(r"--([a-z-]+)(?:=(.*))?", token)
        if not m:
            sys.exit(f"fake sbatch: use --name=value options, got {{token!r}}")
        opts[m.group(1)] = m.group(2) or ""
    return opts


argv = sys.argv[1:]
first = next(i for i, a in enumerate(argv) if not a.startswith("-"))
script, args = Path(argv[first]), argv[first + 1:]
header = []
for line in script.read_text().splitlines()[1:]:
    if line.startswith("#SBATCH"):
        header.extend(line.split()[1:])
    elif line.strip() and not line.startswith("#"):
        break
opts = {{**parse(header), **parse(argv[:first])}}
tasks = [None]
if "array" in opts:
    lo, _, hi = opts["array"].partition("-")
    tasks = list(range(int(lo), int(hi or lo) + 1))
counter = state / "next_job_id"
array_id = int(counter.read_text()) if counter.exists() else 1000
counter.write_text(str(array_id + len(tasks)))
print(f"Submitted batch job {{array_id}}", flush=True)
stop = re.fullmatch(r"B:(USR1|USR2|TERM)@[0-9]+", opts.get("signal", ""))
name = opts.get("job-name", script.name)
(state / "node-tmp").mkdir(exist_ok=True)
(state / "jobs").mkdir(exist_ok=True)

for index, task in enumerate(tasks):
    job_id = array_id + index
    ref = str(job_id) if task is None else f"{{array_id}}_{{task}}"
    env = dict(os.environ, SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME=name,
               SLURM_NTASKS=opts.get("ntasks", "1"), SLURM_CPUS_PER_TASK=opts.get("cpus-per-task", "1"),
               SLURM_SUBMIT_DIR=os.getcwd(), SLURM_JOB_NODELIST="fakenode",
               TMPDIR=str(state / "node-tmp"))
    if task is not None:
        env.update(SLURM_ARRAY_JOB_ID=str(array_id), SLURM_ARRAY_TASK_ID=str(task))
    output = (opts.get("output", "slurm-%j.out").replace("%x", name).replace("%j", str(job_id))
              .replace("%A", str(array_id)).replace("%a", str(task)))
    spool = state / "spool" / f"job{{job_id}}"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, spool / "slurm_script")
    os.chmod(spool / "slurm_script", 0o755)
    restarts = 0
    while True:
        if restarts:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        mode = "a" if opts.get("open-mode") == "append" else "w"
        with open(output, mode) as out:
            proc = subprocess.Popen([str(spool / "slurm_script"), *args], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
            (state / "jobs" / f"{{ref}}.pid").write_text(str(proc.pid))
            when = os.environ.get("FAKE_SLURM_SIGNAL_WHEN")
            chosen = os.environ.get("FAKE_SLURM_SIGNAL_TASKS")
            if stop and when and restarts == 0 and (chosen is None or str(task) in chosen.split(",")):
                ready = Path(when.format(job_id=job_id, array_job_id=array_id, task_id=task))
                deadline = time.monotonic() + 60
                # Once it holds a row: an empty file may be opened before iteration 0 ran.
                while proc.poll() is None and not (ready.exists() and ready.stat().st_size) \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                if proc.poll() is None:
                    proc.send_signal(getattr(signal, "SIG" + stop.group(1)))
            status = proc.wait(timeout=120)
        with open(state / "jobs.log", "a") as f:
            f.write(f"{{ref}} {{restarts}} {{status}}\n")
        flags = [state / "requeue" / r for r in {{ref, str(job_id)}}]
        if any(flag.exists() for flag in flags) and restarts < 5:
            for flag in flags:
                flag.unlink(missing_ok=True)
            restarts += 1
            continue
        break
'''

FAKE_SRUN = r'''#!/bin/bash
# Fake srun: records the call, checks its options, runs the step here as a single task.
echo "srun $*" >> "$FAKE_SLURM_DIR/calls.log"
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "fake srun: not inside a job" >&2; exit 99; }
while [[ $# -gt 0 && $1 == -* ]]; do
    [[ $1 == --*=* ]] || { echo "fake srun: use --name=value options, got $1" >&2; exit 99; }
    shift
done
export SLURM_STEP_ID=0 SLURM_PROCID=0
exec "$@"
'''

FAKE_SCONTROL = r'''#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/calls.log"
if [[ $1 == requeue && $# -eq 2 ]]; then
    if [[ ${FAKE_SCONTROL_FAIL:-0} == 1 ]]; then
        echo "scontrol: error: Requested operation is presently disabled" >&2
        exit 1
    fi
    mkdir -p "$FAKE_SLURM_DIR/requeue" && touch "$FAKE_SLURM_DIR/requeue/$2"
else
    echo "fake scontrol: unsupported: $*" >&2
    exit 99
fi
'''

FAKE_SQUEUE = r'''#!/bin/bash
# Fake squeue: only "squeue -h -j JOB -o %L" (time left), answered from $FAKE_SQUEUE_LEFT.
echo "squeue $*" >> "$FAKE_SLURM_DIR/calls.log"
[[ $* == "-h -j "*" -o %L" ]] || { echo "fake squeue: unsupported: $*" >&2; exit 99; }
echo "${FAKE_SQUEUE_LEFT:-UNLIMITED}"
'''

FAKE_SCANCEL = r'''#!/bin/bash
# Fake scancel JOB: SIGTERM to the job's batch shell, as slurmd sends it.
echo "scancel $*" >> "$FAKE_SLURM_DIR/calls.log"
kill -TERM "$(cat "$FAKE_SLURM_DIR/jobs/$1.pid")"
'''


class FakeCluster:
    """A submit directory with the checkout's jobscripts/ and examples/, fake Slurm on PATH."""

    def __init__(self, root: Path):
        self.root = root
        self.submit = root / "submit"
        self.state = root / "slurm"
        bin_dir = root / "bin"
        for d in (self.submit, self.state, bin_dir):
            d.mkdir()
        (self.submit / "jobscripts").symlink_to(JOBSCRIPTS)
        (self.submit / "examples").symlink_to(EXAMPLES)
        tools = {"sbatch": FAKE_SBATCH.format(python=sys.executable), "srun": FAKE_SRUN,
                 "scontrol": FAKE_SCONTROL, "scancel": FAKE_SCANCEL, "squeue": FAKE_SQUEUE}
        for name, text in tools.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.step_log = root / "steps.jsonl"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "MPIGRAD_", "NUMBA_", "OMP_", "MKL_", "HDF5_"))}
        self.env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                        FAKE_SLURM_DIR=str(self.state), FAKE_STEP_LOG=str(self.step_log),
                        FAKE_STEP_SECONDS="0.02", MPIGRAD_NUMBA_CACHE=str(root / "numba"),
                        MPIGRAD_CHECKPOINT_EVERY="off", MPIGRAD_PYTHON=sys.executable,
                        MPIGRAD_TRAIN_CMD=f"{sys.executable} {FAKE_STEP}")

    def config(self, name: str, iterations: int, ranks: int | None = None) -> str:
        path = self.submit / f"{name}.toml"
        declared = f"# ranks: {ranks}\n" if ranks else ""
        path.write_text(f"{declared}iterations = {iterations}\n")
        return path.name

    def sbatch(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sbatch", *args], cwd=self.submit, env={**self.env, **env},
                              capture_output=True, text=True, timeout=TIMEOUT)

    def calls(self) -> list[str]:
        path = self.state / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def jobs(self) -> list[tuple[str, int, int]]:
        """(job reference, restart count, batch shell exit status) of every start."""
        lines = (self.state / "jobs.log").read_text().split("\n")
        return [(ref, int(n), int(s)) for ref, n, s in (line.split() for line in lines if line)]

    def steps(self) -> list[dict]:
        if not self.step_log.exists():
            return []
        return [json.loads(line) for line in self.step_log.read_text().splitlines()]

    def trace_rows(self, trace: str) -> list[int]:
        text = (self.submit / trace).read_text()
        return [json.loads(line)["iteration"] for line in text.splitlines()]


@pytest.fixture
def cluster(tmp_path):
    return FakeCluster(tmp_path)


def _header(script: Path) -> dict[str, str]:
    opts = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH"):
            key, _, value = line.split()[1].partition("=")
            opts[key] = value
    return opts


def _methods() -> list[str]:
    match = re.search(r"^METHODS=\(([^)]*)\)", (JOBSCRIPTS / "sweep.sbatch").read_text(), re.M)
    return match.group(1).split()


# --- static checks -------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_shellcheck_is_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name, output", [("train.sbatch", "%x-%j.out"),
                                          ("sweep.sbatch", "%x-%A_%a.out")])
def test_batch_headers_ask_for_walltime_signal_requeue_and_append(name, output):
    opts = _header(JOBSCRIPTS / name)
    assert opts["--signal"] == "B:USR1@120"
    assert "--requeue" in opts
    assert opts["--open-mode"] == "append"
    assert opts["--output"] == output
    assert opts["--cpus-per-task"] == "1"


@pytest.mark.parametrize("name, asks", [
    ("multinode.sbatch", {"--nodes": "3", "--ntasks-per-node": "4"}),
    ("gpu.sbatch", {"--ntasks": "5", "--gpus-per-task": "1"}),
])
def test_multinode_and_gpu_examples_keep_the_stop_and_requeue_header(name, asks):
    opts = _header(JOBSCRIPTS / name)
    assert {key: opts.get(key) for key in asks} == asks
    assert opts["--signal"] == "B:USR1@120" and "--requeue" in opts
    assert opts["--open-mode"] == "append" and opts["--output"] == "%x-%j.out"


def test_sweep_array_covers_the_five_methods():
    assert _methods() == ["fix2", "fix4", "fix8", "adaptive", "mqgrad", "accordion", "lgreco"]
    assert _header(JOBSCRIPTS / "sweep.sbatch")["--array"] == f"0-{len(_methods()) - 1}"


PAPER_METHODS = {"fix2": ("fixed", 2), "fix4": ("fixed", 4), "fix8": ("fixed", 8),
                 "adaptive": ("adaptive", None), "mqgrad": ("mqgrad", None),
                 "accordion": ("accordion", None), "lgreco": ("lgreco", None)}


@pytest.mark.parametrize("grid, ranks, data", [("paper-12nodes", 12, "cifar10"),
                                               ("paper-18nodes", 18, "cifar10"),
                                               ("quick", 4, "digits")])
def test_example_grids_hold_the_seven_methods(grid, ranks, data):
    directory = EXAMPLES / grid
    assert sorted(p.stem for p in directory.glob("*.toml")) == sorted(_methods())
    configs = {}
    for method in _methods():
        path = directory / f"{method}.toml"
        text = path.read_text()
        assert f"\n# ranks: {ranks}\n" in text
        assert f"sbatch --ntasks={ranks} jobscripts/sweep.sbatch examples/{grid}" in text
        with open(path, "rb") as f:
            config = tomllib.load(f)
        run = RunConfig.from_sources(str(path), {})      # what mpigrad train accepts
        get_policy(run.policy_config(), n_layers=2, seed=run.seed)
        get_codec(run.codec_config())
        policy, bits = PAPER_METHODS[method]
        assert (config["codec"], config["policy"], config.get("bits")) == ("uniform", policy, bits)
        assert (config["data"], config["net_mode"], config["bandwidth"]) == (data, "virtual", "10MB/s")
        assert config["batch_size"] == 32
        if method == "mqgrad":
            assert config["policy_opts"]["initial_bits"] == 2
        configs[method] = {k: v for k, v in config.items() if k not in ("policy", "bits", "policy_opts")}
    assert all(c == configs["fix2"] for c in configs.values()), "methods differ only in their bits"
    if data == "cifar10":
        assert configs["fix2"]["lr"] == 0.2 and configs["fix2"]["data_dir"] == "data/cifar10"


# --- runs through fake Slurm ---------------------------------------------------------

def test_normal_run_under_srun(cluster):
    cfg = cluster.config("tiny", iterations=5)
    result = cluster.sbatch("--cpus-per-task=2", "jobscripts/train.sbatch", cfg)
    assert result.returncode == 0 and result.stdout.strip() == "Submitted batch job 1000"
    assert cluster.jobs() == [("1000", 0, 0)]
    trace = "runs/tiny-1000.h5"
    assert cluster.trace_rows(trace) == list(range(5))
    [step] = cluster.steps()
    assert step["argv"] == ["--config", cfg, "--trace", trace] and step["exit"] == 0
    env = step["env"]
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                 "NUMBA_NUM_THREADS", "SRUN_CPUS_PER_TASK"):
        assert env[name] == "2", name
    cache = Path(env["NUMBA_CACHE_DIR"])
    assert cache.parent == cluster.root / "numba" and re.fullmatch(r"cpu-\d+", cache.name), cache
    assert env["HDF5_USE_FILE_LOCKING"] == "FALSE" and env["PYTHONUNBUFFERED"] == "1"
    srun = [c for c in cluster.calls() if c.startswith("srun")]
    assert srun == [f"srun --kill-on-bad-exit=0 {sys.executable} {FAKE_STEP} --config {cfg} "
                    f"--trace {trace}"]
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert "mpigrad-job: run finished" in log
    assert not any(c.startswith("scontrol") for c in cluster.calls())


def test_srun_pmi_choice_is_passed_on(cluster):
    cfg = cluster.config("tiny", iterations=1)
    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_SRUN_MPI="pmix")
    assert any(c.startswith("srun --kill-on-bad-exit=0 --mpi=pmix ") for c in cluster.calls())
    assert cluster.jobs() == [("1000", 0, 0)]


def _check_signal_requeue_resume(cluster, trace: str, ref: str, iterations: int, size: int):
    assert f"scontrol requeue {ref}" in cluster.calls()
    jobs = [job for job in cluster.jobs() if job[0] == ref]
    assert jobs == [(ref, 0, 0), (ref, 1, 0)]
    first = [s for s in cluster.steps() if "--resume" not in s["argv"] and trace in s["argv"]]
    second = [s for s in cluster.steps() if "--resume" in s["argv"] and trace in s["argv"]]
    assert len(first) == len(second) == size
    stopped = {s["stopped_at"] for s in first}
    assert all(s["exit"] == 75 for s in first) and len(stopped) == 1
    stopped_at = stopped.pop()
    assert 0 < stopped_at < iterations, "the run was meant to stop midway"
    assert all(s["start"] == stopped_at and s["exit"] == 0 for s in second)
    assert all(s["env"]["SLURM_RESTART_COUNT"] == "1" and s["size"] == size for s in second)
    assert cluster.trace_rows(trace) == list(range(iterations))


def test_walltime_signal_checkpoint_requeue_resume_under_srun(cluster):
    cfg = cluster.config("walltime", iterations=12)
    trace = "runs/walltime-1000.h5"
    result = cluster.sbatch("jobscripts/train.sbatch", cfg, FAKE_SLURM_SIGNAL_WHEN=trace,
                            FAKE_STEP_HOLD_TRACE=trace)
    assert result.returncode == 0, result.stderr
    _check_signal_requeue_resume(cluster, trace, "1000", 12, size=1)
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert "batch shell got SIGUSR1: asking the job step" in log
    assert "requeueing job 1000, the next start resumes" in log
    assert log.count("mpigrad-job: job 1000 restart") == 2, "--open-mode=append keeps both starts"
    assert "mpigrad-job: run finished" in log


@pytest.mark.parametrize("launcher", ["mpiexec", "mpirun"])
def test_walltime_cycle_through_real_mpiexec(cluster, launcher):
    if shutil.which(launcher) is None:
        pytest.skip(f"no {launcher} on PATH")
    cfg = cluster.config("viampi", iterations=12, ranks=2)
    trace = "runs/viampi-1000.h5"
    result = cluster.sbatch("--ntasks=2", "jobscripts/train.sbatch", cfg,
                            MPIGRAD_LAUNCHER=launcher, FAKE_SLURM_SIGNAL_WHEN=trace,
                            FAKE_STEP_HOLD_TRACE=trace)
    assert result.returncode == 0, result.stderr
    assert not any(c.startswith("srun") for c in cluster.calls())
    _check_signal_requeue_resume(cluster, trace, "1000", 12, size=2)
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert f"step: {launcher} -n 2 {sys.executable}" in log


def test_mpiexec_options_go_before_the_rank_count(cluster):
    """MPIGRAD_MPIEXEC_OPTS (Open MPI as root needs --allow-run-as-root): here an option both
    MPICH's and Open MPI's launchers take."""
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on PATH")
    cfg = cluster.config("opts", iterations=3, ranks=2)
    result = cluster.sbatch("--ntasks=2", "jobscripts/train.sbatch", cfg, MPIGRAD_LAUNCHER="mpirun",
                            MPIGRAD_MPIEXEC_OPTS="--bind-to  none")
    assert result.returncode == 0, result.stderr
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert f"step: mpirun --bind-to none -n 2 {sys.executable}" in log


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_real_train_command_through_walltime_requeue_and_resume(cluster):
    """The real ``mpigrad train`` stopped by the walltime signal: 2 ranks, a tiny model, the
    fp32 codec (no Numba compile), real 10 ms sleeps per message so the signal lands midway."""
    from mpigrad.trace import load

    del cluster.env["MPIGRAD_TRAIN_CMD"]
    (cluster.submit / "real.toml").write_text(
        '# ranks: 2\niterations = 40\ndata = "digits"\nmodel_opts = { fc_sizes = [64, 64] }\n'
        'codec = "fp32"\npolicy = "fixed"\nnet_mode = "sleep"\nlatency = "10ms"\nbandwidth = "1GB/s"\n'
        'eval_every = 0\nprogress_every = 10\n')
    trace = "runs/real-1000.h5"
    result = cluster.sbatch("--ntasks=2", "jobscripts/train.sbatch", "real.toml",
                            MPIGRAD_LAUNCHER="mpiexec", FAKE_SLURM_SIGNAL_WHEN=trace)
    assert result.returncode == 0, result.stderr
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert cluster.jobs() == [("1000", 0, 0), ("1000", 1, 0)], log
    assert "scontrol requeue 1000" in cluster.calls()
    stopped = re.search(r"received SIGUSR1: stopped after iteration (\d+), checkpoint "
                        r"runs/real-1000.h5.ckpt; exit 75", log)
    assert stopped, log
    assert f"resuming from runs/real-1000.h5.ckpt at iteration {stopped[1]}" in log
    assert f"step: mpiexec -n 2 python -m mpi4py -m mpigrad train --config real.toml --trace {trace} --resume" in log
    run = load(str(cluster.submit / trace))
    assert run.complete and run.steps["iteration"].tolist() == list(range(40))
    assert int(stopped[1]) < 40, "the run was meant to stop midway"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_a_scripts_job_stops_on_the_walltime_signal_requeues_and_resumes(cluster):
    """jobscripts/script.sbatch with examples/api/train.py (mpigrad.Session, MQGrad): the
    walltime signal stops the run, the script saves its checkpoint and every rank exits 75,
    the job requeues, and the next start resumes from the checkpoint to a complete trace."""
    from mpigrad.trace import load

    trace, saved = "runs/api-1000.h5", "runs/api-1000.pt"
    result = cluster.sbatch("--ntasks=3", "jobscripts/script.sbatch", "examples/api/train.py", "--config",
                            "examples/compare/mqgrad.toml", "--trace", trace, "--checkpoint", saved,
                            "--loader-workers", "0", "--set", "progress_every=16",
                            MPIGRAD_LAUNCHER="mpiexec", FAKE_SLURM_SIGNAL_WHEN=trace)
    assert result.returncode == 0, result.stderr
    log = (cluster.submit / "mpigrad-script-1000.out").read_text()
    assert cluster.jobs() == [("1000", 0, 0), ("1000", 1, 0)], log
    assert "scontrol requeue 1000" in cluster.calls()
    stopped = re.search(r"received SIGUSR1: stopped after iteration (\d+), checkpoint to worker rank 1", log)
    assert stopped and int(stopped[1]) < 48, log
    assert f"resuming from the state given at iteration {stopped[1]}" in log
    assert f"step: mpiexec -n 3 {sys.executable} -m mpi4py examples/api/train.py --config" in log
    run = load(str(cluster.submit / trace))
    assert run.complete and run.steps["iteration"].tolist() == list(range(48))
    assert not (cluster.submit / saved).exists()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_a_sweep_in_one_job_stops_on_the_walltime_signal_requeues_and_goes_on(cluster):
    """jobscripts/sweep-world.sbatch with two runs (mpigrad sweep): the walltime signal stops
    the first at a checkpoint, the step exits 75 and the job requeues; the next start
    resumes the first run and then runs the second, both to complete traces."""
    from mpigrad.trace import load

    first, second = "runs/sweep-a.h5", "runs/sweep-b.h5"
    (cluster.submit / "real.toml").write_text(  # real 10 ms sleeps per message: the signal lands midway
        '# ranks: 2\niterations = 40\ndata = "digits"\nmodel_opts = { fc_sizes = [64, 64] }\n'
        'codec = "fp32"\npolicy = "fixed"\nnet_mode = "sleep"\nlatency = "10ms"\nbandwidth = "1GB/s"\n'
        'eval_every = 0\nprogress_every = 10\n')
    runs = cluster.submit / "runs.txt"
    runs.write_text(f"--config real.toml --trace {first}\n# the second run\n--config real.toml --seed 2 --trace {second}\n")
    result = cluster.sbatch("--ntasks=2", "jobscripts/sweep-world.sbatch", "runs.txt",
                            MPIGRAD_LAUNCHER="mpiexec", FAKE_SLURM_SIGNAL_WHEN=first)
    assert result.returncode == 0, result.stderr
    log = (cluster.submit / "mpigrad-sweep-world-1000.out").read_text()
    assert cluster.jobs() == [("1000", 0, 0), ("1000", 1, 0)], log
    assert "scontrol requeue 1000" in cluster.calls()
    assert re.search(r"received SIGUSR1: stopped after iteration \d+, checkpoint", log), log
    assert f"mpigrad sweep: run 1/2 (line 1): resumed: {first} stopped at a checkpoint" in log
    assert "mpigrad sweep: run 2/2 (line 3): exit 0 after" in log
    assert f"step: mpiexec -n 2 {sys.executable} -m mpi4py -m mpigrad sweep runs.txt" in log
    for trace in (first, second):
        run = load(str(cluster.submit / trace))
        assert run.complete and run.steps["iteration"].tolist() == list(range(40))


def test_sweep_runs_every_method_and_requeues_one_task(cluster):
    result = cluster.sbatch("--ntasks=4", "jobscripts/sweep.sbatch", "examples/quick/",
                            FAKE_STEP_SECONDS="0.001", FAKE_SLURM_SIGNAL_TASKS="3",
                            FAKE_SLURM_SIGNAL_WHEN="runs/quick/adaptive-{array_job_id}_{task_id}.h5",
                            FAKE_STEP_HOLD_TRACE="runs/quick/adaptive-1000_3.h5")
    assert result.returncode == 0, result.stderr
    methods = _methods()
    started = {(s["argv"][1], s["argv"][3]) for s in cluster.steps() if s["rank"] == 0}
    assert started == {(f"examples/quick/{m}.toml", f"runs/quick/{m}-1000_{i}.h5")
                       for i, m in enumerate(methods)}
    for i, method in enumerate(methods):
        assert (cluster.submit / f"mpigrad-sweep-1000_{i}.out").exists()
        with open(EXAMPLES / "quick" / f"{method}.toml", "rb") as f:
            iterations = tomllib.load(f)["iterations"]
        assert cluster.trace_rows(f"runs/quick/{method}-1000_{i}.h5") == list(range(iterations))
    with open(EXAMPLES / "quick" / "adaptive.toml", "rb") as f:
        iterations = tomllib.load(f)["iterations"]
    _check_signal_requeue_resume(cluster, "runs/quick/adaptive-1000_3.h5", "1000_3",
                                 iterations, size=1)
    assert [c for c in cluster.calls() if c.startswith("scontrol")] == ["scontrol requeue 1000_3"]


def test_scancel_checkpoints_without_requeue_and_a_resubmission_resumes(cluster):
    cfg = cluster.config("cancelled", iterations=12)
    trace = "runs/cancelled-1000.h5"
    submit = subprocess.Popen(["sbatch", "jobscripts/train.sbatch", cfg], cwd=cluster.submit,
                              env={**cluster.env, "FAKE_STEP_HOLD_TRACE": trace},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (cluster.submit / trace).exists() and time.monotonic() < deadline \
                and submit.poll() is None:
            time.sleep(0.02)
        subprocess.run(["scancel", "1000"], env=cluster.env, timeout=30, check=True)
        submit.wait(timeout=TIMEOUT)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert cluster.jobs() == [("1000", 0, 75)]
    assert not any(c.startswith("scontrol") for c in cluster.calls())
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert "after SIGTERM (scancel or preemption): not requeueing; to resume, submit the same " \
           "script and arguments again with MPIGRAD_RUN_ID=1000" in log
    [stopped] = cluster.steps()
    assert stopped["exit"] == 75 and 0 < stopped["stopped_at"] < 12

    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_RUN_ID="1000")
    assert cluster.jobs()[1:] == [("1001", 0, 0)]
    resumed = cluster.steps()[1]
    assert resumed["argv"] == ["--config", cfg, "--trace", trace, "--resume"]
    assert resumed["start"] == stopped["stopped_at"] and resumed["env"]["SLURM_JOB_ID"] == "1001"
    assert cluster.trace_rows(trace) == list(range(12))


def test_env_script_is_sourced_first(cluster):
    site = cluster.root / "site-env.sh"
    site.write_text(f'false\n[ -z "$UNSET_BY_DESIGN" ] && touch {cluster.root / "sourced"}\n')
    cluster.sbatch("jobscripts/train.sbatch", cluster.config("env", iterations=1),
                   MPIGRAD_ENV_SCRIPT=str(site))
    assert cluster.jobs() == [("1000", 0, 0)] and (cluster.root / "sourced").exists()
    cluster.sbatch("jobscripts/train.sbatch", "env.toml", MPIGRAD_ENV_SCRIPT="/nonexistent/env.sh")
    assert cluster.jobs()[1] == ("1001", 0, 2)
    assert "MPIGRAD_ENV_SCRIPT=/nonexistent/env.sh not found" in \
        (cluster.submit / "mpigrad-train-1001.out").read_text()


@pytest.mark.parametrize("env, message", [
    ({"FAKE_SCONTROL_FAIL": "1"}, "scontrol requeue 1000 failed; to resume, submit the same"),
    ({"MPIGRAD_MAX_REQUEUES": "0"}, "restarted 0 times already (MPIGRAD_MAX_REQUEUES): not requeueing"),
])
def test_no_requeue_leaves_exit_75_and_the_checkpoint(cluster, env, message):
    cfg = cluster.config("stuck", iterations=12)
    trace = "runs/stuck-1000.h5"
    cluster.sbatch("jobscripts/train.sbatch", cfg, FAKE_SLURM_SIGNAL_WHEN=trace,
                   FAKE_STEP_HOLD_TRACE=trace, **env)
    assert cluster.jobs() == [("1000", 0, 75)]
    assert (cluster.submit / (trace + ".ckpt.json")).exists()
    assert message in (cluster.submit / "mpigrad-train-1000.out").read_text()


def test_failed_step_is_not_requeued(cluster):
    cfg = cluster.config("broken", iterations=3)
    (cluster.submit / "runs").mkdir()
    (cluster.submit / "runs" / "broken-1000.h5").write_text("")   # trace without checkpoint
    cluster.sbatch("jobscripts/train.sbatch", cfg)
    [step] = cluster.steps()
    assert "--resume" in step["argv"] and step["exit"] == 2
    assert cluster.jobs() == [("1000", 0, 2)]
    assert not any(c.startswith("scontrol") for c in cluster.calls())
    assert (cluster.submit / "runs" / "broken-1000.h5").read_text() == ""
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert "run failed with exit status 2" in log
    # After a failed step the job offers the trace to `mpigrad trace repair` (where mpigrad
    # has it), which must leave a file that is no trace as it is (checked above).
    assert "mpigrad trace repair runs/broken-1000.h5" in log or \
        "has no `mpigrad trace repair`: runs/broken-1000.h5 left as the run left it" in log


@pytest.mark.parametrize("args, env, message", [
    (["jobscripts/train.sbatch", "missing.toml"], {}, "config missing.toml not found"),
    (["jobscripts/train.sbatch"], {}, "usage: sbatch jobscripts/train.sbatch CONFIG.toml"),
    (["--ntasks=4", "jobscripts/train.sbatch", "CFG"], {"MPIGRAD_LAUNCHER": "ssh"},
     "MPIGRAD_LAUNCHER must be srun, mpiexec or mpirun, not 'ssh'"),
    (["--ntasks=4", "jobscripts/train.sbatch", "CFG"], {"FAKE_SQUEUE_LEFT": "1:00"},
     "the job has 60 s left, no more than MPIGRAD_END_MARGIN=60: ask for a longer --time"),
    (["--ntasks=2", "jobscripts/train.sbatch", "CFG"], {},
     "four.toml is written for 4 ranks but this job has SLURM_NTASKS=2; submit with sbatch --ntasks=4"),
    (["--ntasks=4", "--cpus-per-task=0", "jobscripts/train.sbatch", "CFG"], {},
     "SLURM_CPUS_PER_TASK='0' is not a positive whole number"),
    (["--array=7", "jobscripts/sweep.sbatch", "examples/quick"], {},
     "array task '7' has no method: submit with --array=0-6"),
])
def test_bad_submissions_fail_before_launching(cluster, args, env, message):
    cfg = cluster.config("four", iterations=1, ranks=4)
    cluster.sbatch(*(cfg if a == "CFG" else a for a in args), **env)
    [(_, _, status)] = cluster.jobs()
    assert status == 2
    outputs = list(cluster.submit.glob("mpigrad-*.out"))
    assert len(outputs) == 1 and f"mpigrad-job: error: {message}" in outputs[0].read_text()
    assert not any(c.startswith("srun") for c in cluster.calls()) and cluster.steps() == []


def test_common_sh_missing_is_reported(cluster):
    (cluster.submit / "jobscripts").unlink()
    shutil.copy(JOBSCRIPTS / "train.sbatch", cluster.submit / "train.sbatch")
    cluster.sbatch("train.sbatch", cluster.config("x", iterations=1))
    assert cluster.jobs() == [("1000", 0, 2)]
    assert "cannot find jobscripts/common.sh" in (cluster.submit / "mpigrad-train-1000.out").read_text()


def test_signal_during_set_up_skips_the_step_and_requeues(cluster):
    """USR1 while the job still sets up (module loads...): no step, requeue, start over."""
    site = cluster.root / "slow-site-env.sh"
    site.write_text('[ -n "${SLURM_RESTART_COUNT:-}" ] || kill -USR1 $$\n')
    cfg = cluster.config("early", iterations=3)
    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_ENV_SCRIPT=str(site))
    assert cluster.jobs() == [("1000", 0, 0), ("1000", 1, 0)]
    assert "scontrol requeue 1000" in cluster.calls()
    [step] = cluster.steps()
    assert "--resume" not in step["argv"] and step["env"]["SLURM_RESTART_COUNT"] == "1"
    assert cluster.trace_rows("runs/early-1000.h5") == [0, 1, 2]
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert "SIGUSR1 arrived before the step started: not starting it" in log


@pytest.mark.serial  # a wall-clock bound
def test_signal_between_fork_and_pid_is_passed_on(cluster, tmp_path):
    script = tmp_path / "window.sh"
    script.write_text(f"""
source {JOBSCRIPTS / 'common.sh'}
_mpigrad_pending=USR1   # what _mpigrad_on_signal records while no step pid is known yet
status=0
mpigrad_run_step sleep 20 || status=$?
echo "status=$status"
""")
    started = time.monotonic()
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                            env=cluster.env)
    assert time.monotonic() - started < 15
    assert "passing on SIGUSR1 that arrived while the step started" in result.stdout
    assert f"status={128 + signal.SIGUSR1}" in result.stdout, result.stdout + result.stderr


def test_walltime_option_from_the_jobs_time_left(cluster):
    """The run gets --walltime = time left - MPIGRAD_END_MARGIN, before the user's options."""
    cfg = cluster.config("limited", iterations=2)
    cluster.sbatch("jobscripts/train.sbatch", cfg, "--walltime", "1h", FAKE_SQUEUE_LEFT="1-02:03:04")
    cluster.sbatch("jobscripts/train.sbatch", cfg, FAKE_SQUEUE_LEFT="05:00", MPIGRAD_END_MARGIN="30",
                   MPIGRAD_RUN_ID="other")
    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_RUN_ID="unlimited")
    first, second, third = cluster.steps()
    day = ((24 + 2) * 60 + 3) * 60 + 4
    assert first["argv"] == ["--config", cfg, "--trace", "runs/limited-1000.h5",
                             "--walltime", f"{day - 60}s", "--walltime", "1h"]
    assert second["argv"][-2:] == ["--walltime", "270s"]
    assert "--walltime" not in third["argv"]          # UNLIMITED
    assert "squeue -h -j 1000 -o %L" in cluster.calls()


def _mpigrad_has(key: str) -> bool:
    import dataclasses

    return key in {f.name for f in dataclasses.fields(RunConfig)}


def test_periodic_checkpoints_by_default_where_mpigrad_has_them(cluster):
    cfg = cluster.config("periodic", iterations=2)
    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_CHECKPOINT_EVERY="")
    cluster.sbatch("jobscripts/train.sbatch", cfg, MPIGRAD_CHECKPOINT_EVERY="500", MPIGRAD_RUN_ID="b")
    default, every = cluster.steps()
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    if _mpigrad_has("checkpoint_every"):
        assert default["argv"][-2:] == ["--checkpoint-every", "30m"]
        assert every["argv"][-2:] == ["--checkpoint-every", "500"]
    else:
        assert "--checkpoint-every" not in default["argv"] + every["argv"]
        assert "this mpigrad has no --checkpoint-every: no periodic checkpoints" in log


@pytest.mark.parametrize("setting", ["job", "unwritable"])
def test_per_job_numba_cache_on_node_local_disk_is_removed(cluster, setting):
    root = "job"
    if setting == "unwritable":
        (cluster.root / "readonly").write_text("a file, not a directory")
        root = str(cluster.root / "readonly")
    cluster.sbatch("jobscripts/train.sbatch", cluster.config("local", iterations=2), MPIGRAD_NUMBA_CACHE=root)
    [step] = cluster.steps()
    local = cluster.state / "node-tmp" / "mpigrad-numba-1000"
    assert step["env"]["NUMBA_CACHE_DIR"] == str(local) and step["exit"] == 0
    assert not local.exists(), "a per-job cache is removed when the job ends"
    log = (cluster.submit / "mpigrad-train-1000.out").read_text()
    assert ("cannot be written: compiling into a per-job cache on this node" in log) == (setting == "unwritable")


def test_numba_cache_dir_set_by_the_user_is_kept(cluster):
    mine = cluster.root / "my-cache"
    cluster.sbatch("jobscripts/train.sbatch", cluster.config("mine", iterations=1), NUMBA_CACHE_DIR=str(mine))
    assert cluster.steps()[0]["env"]["NUMBA_CACHE_DIR"] == str(mine)


def test_cpu_type_names_the_cache_directory(cluster):
    result = subprocess.run(["bash", "-c", f"source {JOBSCRIPTS / 'common.sh'}; mpigrad_cpu_type; mpigrad_cpu_type"],
                            capture_output=True, text=True, timeout=30, env=cluster.env)
    first, second = result.stdout.split()
    assert first == second and first.isdigit()
