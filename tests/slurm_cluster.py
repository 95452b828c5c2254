"""A private single-node Slurm for tests: munged, slurmctld and slurmd under one directory.

``PrivateSlurm(root).start()`` writes a minimal slurm.conf and a munge key under ``root``,
starts the three daemons in the foreground as children of this process (so their pids are
known and nothing else is touched), and waits until the node is idle. Clients find the
cluster through ``SLURM_CONF`` (``cluster.env``). ``stop()`` cancels what is left in the
queue and ends exactly the daemons it started. A daemon that fails to come up raises
``SlurmError`` with the tail of its log; every wait is bounded.

``ensure_installed()`` installs Debian's ``slurmctld slurmd munge`` with apt-get when they
are missing and this process may (root and apt-get present); otherwise it says why not.

Run as a script to keep a cluster up for manual experiments:
``python tests/slurm_cluster.py DIR`` (Ctrl-C stops it).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
APT_PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")

#: CPUs the node declares (SlurmdParameters=config_overrides lets it exceed the real count):
#: enough for one 4-rank job beside another, never more ranks than the tests can afford.
NODE_CPUS = 8


class SlurmError(RuntimeError):
    """The private cluster could not be set up; the message carries the daemon's log tail."""


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here; the message says why."""


def _missing() -> list[str]:
    """The daemon and client programs not found on PATH (daemons live in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=path) is None]


def which(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise SlurmUnavailable(f"{name} not found")
    return found


def ensure_installed(timeout: float = 600) -> str:
    """Install Slurm and munge with apt-get if missing; returns what was done.

    Raises SlurmUnavailable with the precise reason when they are missing and cannot be
    installed (not root, no apt-get, or apt-get failed: its output's tail is included)."""
    missing = _missing()
    if not missing:
        return "already installed"
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and not root (cannot apt-get install "
                               f"{' '.join(APT_PACKAGES)})")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    started = time.monotonic()
    log = ""
    # A fresh machine may have no package lists yet: update once and retry.
    for attempt in (install, ["apt-get", "update", "-q"], install):
        left = timeout - (time.monotonic() - started)
        try:
            result = subprocess.run(attempt, env=env, capture_output=True, text=True,
                                    timeout=max(left, 1), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(attempt)} did not finish within {timeout:.0f} s") from None
        log = result.stdout + result.stderr
        if attempt is install and result.returncode == 0:
            break
    if _missing():
        raise SlurmUnavailable(f"apt-get install {' '.join(APT_PACKAGES)} failed:\n{_tail(log)}")
    return f"apt-get installed {' '.join(APT_PACKAGES)} in {time.monotonic() - started:.0f} s"


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateSlurm:
    """One node, one partition, this user as SlurmUser; every file under ``root``."""

    def __init__(self, root: Path, cpus: int = NODE_CPUS, gpus: int = 2, mpi_default: str = "none",
                 kill_wait: int = 30):
        self.root = Path(root)
        self.cpus = cpus
        self.gpus = gpus      # stand-in GPU devices (as root): Slurm binds them to tasks
        self.mpi_default = mpi_default
        self.kill_wait = kill_wait
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.logs = {name: self.root / f"{name}.log" for name in DAEMONS}
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {"SLURM_CONF": str(self.conf)}
        # Job ids never repeat on a real cluster, and node-local leftovers of a killed job
        # (MPI shared-memory files, caches) may be named after them: no two clusters started
        # here begin at the same id.
        self.first_job_id = 1000 + int(time.time() * 10) % 50_000_000

    # --- set-up ------------------------------------------------------------------------

    def _write_files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)   # munged refuses a socket or key in a writable directory
        for d in ("state", "spool", "munge"):
            (self.root / d).mkdir(exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.socket = self.root / "munge" / "munge.socket"
        gres = ""
        if self.gpus and os.geteuid() == 0:
            # slurmd wants character devices: nodes that behave like /dev/null (1, 3).
            devices = self.root / "dev"
            devices.mkdir(exist_ok=True)
            for i in range(self.gpus):
                if not (devices / f"gpu{i}").exists():
                    os.mknod(devices / f"gpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            (self.root / "gres.conf").write_text(
                f"NodeName={self.node} Name=gpu File={devices}/gpu[0-{self.gpus - 1}]\n")
            gres = f" Gres=gpu:{self.gpus}"
        self.conf.write_text(f"""\
# Private single-node test cluster written by tests/slurm_cluster.py
ClusterName=mpigradtest
FirstJobId={self.first_job_id}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={getpass.getuser()}
SlurmdUser={getpass.getuser()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'slurmd.pid'}
SlurmctldLogFile={self.logs['slurmctld']}
SlurmdLogFile={self.logs['slurmd']}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault={self.mpi_default}
ReturnToService=2
KillWait={self.kill_wait}
InactiveLimit=0
MinJobAge=600
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus}{gres} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.logs[name], "ab")
        try:
            self.processes[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **self.env})
        finally:
            log.close()

    def _wait_for(self, name: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.processes[name]
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with status {proc.returncode} while starting:\n"
                                 f"{self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        raise SlurmError(f"{name} not ready within {timeout:.0f} s:\n{self.log_tail(name)}")

    def start(self, timeout: float = 60) -> "PrivateSlurm":
        """Start munged, slurmctld, slurmd in that order; returns once the node is idle."""
        self._write_files()
        try:
            self._spawn("munged", [which("munged"), "--foreground", "--force",
                                   f"--socket={self.socket}",
                                   f"--key-file={self.root / 'munge' / 'munge.key'}",
                                   f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                   f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                   f"--log-file={self.logs['munged']}"])
            self._wait_for("munged", self._munge_works, timeout)
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait_for("slurmctld", lambda: self._client_ok(["scontrol", "ping"], "UP"), timeout)
            self._spawn("slurmd", [which("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
            self._wait_for("slurmd", self._node_idle, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _munge_works(self) -> bool:
        if not self.socket.exists():
            return False
        munge = subprocess.run([which("munge"), "-n", f"--socket={self.socket}"],
                               capture_output=True, timeout=10)
        return munge.returncode == 0

    def _client_ok(self, argv: list[str], expect: str) -> bool:
        result = self.run(argv, check=False, timeout=15)
        return result.returncode == 0 and expect in result.stdout

    def _node_idle(self) -> bool:
        result = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=15)
        return result.returncode == 0 and result.stdout.strip().rstrip("*") == "idle"

    # --- use ---------------------------------------------------------------------------

    def run(self, argv: list[str], check: bool = True, timeout: float = 30, **kwargs):
        """A Slurm client command against this cluster."""
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        try:
            result = subprocess.run([which(argv[0]), *argv[1:]], env=env, capture_output=True,
                                    text=True, timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(argv)} did not answer within {timeout:.0f} s") from None
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, Reason, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text.splitlines()[0]))

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.logs[name]
        return f"--- {path} (last {lines} lines) ---\n" + \
            (_tail(path.read_text(errors="replace"), lines) if path.exists() else "(no log written)")

    # --- tear-down ---------------------------------------------------------------------

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job left, then end the daemons this object started (slurmd first)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", getpass.getuser()], check=False, timeout=15)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=15)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            proc = self.processes.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)


if __name__ == "__main__":
    print(ensure_installed())
    cluster = PrivateSlurm(Path(sys.argv[1]).resolve())
    began = time.monotonic()
    cluster.start()
    print(f"up in {time.monotonic() - began:.1f} s; export SLURM_CONF={cluster.conf}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
