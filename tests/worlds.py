"""Shared MPI worlds for the test suite (issue 65): a real ``mpigrad train`` run of a test
goes to a long-lived ``mpiexec`` world (``tests/world_server.py``) instead of a fresh one,
so that it pays no start-up (processes, imports, Numba's cache, MPI's wire-up).

:class:`WorldPool` (one per pytest worker) keeps one world, as large as the largest run
asked of it so far (at least ``SMALLEST`` ranks), and restarts it when a run needs more
ranks, when a scenario aborted it (MPI_Abort ends every rank: the harness sees the
``mpiexec`` exit), hung (past its timeout: killed, the test fails), or left its processes
changed (``world_server.LEFT_STATE``). :meth:`WorldPool.run` gives what ``subprocess.run``
gives a test: the exit code (the first rank's non-zero one, as the launchers report it),
stdout and stderr (each rank's, in rank order).

A run goes to a world only where a world gives what a fresh ``mpiexec`` would: ``train``
runs whose environment differs from the world's in ``mpigrad``'s own run-time variables
and ``PYTHONPATH`` only (``MPIGRAD_*``: read when a run starts, not at import; the import
path: ``world_server`` gives each scenario a fresh process's). The rest keep their own
``mpiexec`` (``run_mpi`` decides: ``conftest.py``): a run with an injected fault
(``MPIGRAD_INJECT_FAULT``: an abort would end a warm world; a run that fails otherwise
does end it, and the next run starts another), and signals, kills and hangs a test
provokes on purpose, the launcher's own checks and other commands, which are not runs of a
world. ``MPIGRAD_TEST_WORLDS=0``
sends every run to its own ``mpiexec``.

:class:`WorldRelay` takes the same runs from commands a test runs through a shell (the
documented commands): an ``mpiexec`` first on the shell's ``PATH`` (``mpiexec_relay.py``)
hands a plain ``mpiexec -n N python -m mpi4py -m mpigrad train ...`` to this worker's world.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

#: The smallest world started: most real runs of the suite take 3 or 4 ranks, and those of
#: nodes of two workers 5, which would otherwise end a world of 4 for a larger one (3 of
#: the 10 worlds of a suite's run, counted at 2797e1e); an idle rank sleeps between polls.
SMALLEST = 5
#: A world's start-up (imports on every rank) may take this long on a loaded machine.
START_SECONDS = 120
SERVER = Path(__file__).resolve().with_name("world_server.py")
LEFT_STATE = 97
ABORTED = "aborted"
#: What MPICH and Open MPI print on a rank's stderr for its MPI_Abort.
MPI_ABORT_SAID = ("application called MPI_Abort(", "MPI_ABORT was invoked on rank")
#: Variables beyond ``MPIGRAD_*`` a world gives a scenario as a fresh process would have
#: them: the import path (``world_server._scenario_environment``), and gloo's interface
#: (read when a process group starts, not at import; ``bench peers`` sets it for every run).
WORLD_TAKES = ("PYTHONPATH", "GLOO_SOCKET_IFNAME")
#: A run with an injected fault goes to an ``mpiexec`` of its own: it would abort a warm world.
FAULT = "MPIGRAD_INJECT_FAULT"


def world_env_differs(env: dict[str, str], base: dict[str, str]) -> dict[str, str | None]:
    """The variables a run sets beyond ``base`` (None: unset), or raise ValueError where one
    is not mpigrad's run-time own (a world cannot take it: it was read at import)."""
    changed = {name: value for name, value in env.items() if base.get(name) != value}
    changed.update({name: None for name in base if name not in env})
    foreign = sorted(name for name in changed if not name.startswith("MPIGRAD_") and name not in WORLD_TAKES)
    if foreign:
        raise ValueError(f"variables a world cannot change: {', '.join(foreign)}")
    if changed.get(FAULT):
        raise ValueError(f"{FAULT}: the run is meant to fail, and an abort would end the world")
    return changed


def _code(text: str) -> int:
    """A rank's exit code as its code file holds it (``world_server``: "N", or "N aborted")."""
    return int(text.split()[0])


class WorldGone(RuntimeError):
    """The world ended during a scenario (an abort, a crash): its exit code is ``code``."""

    def __init__(self, code: int):
        super().__init__(f"the world exited with {code}")
        self.code = code


class World:
    """One ``mpiexec`` world of ``size`` ranks serving scenarios from ``folder``."""

    def __init__(self, size: int, env: dict[str, str], folder: Path, command):
        self.size, self.env, self.folder = size, dict(env), folder
        folder.mkdir(parents=True, exist_ok=True)
        self.log = open(folder / "world.log", "wb")
        self.process = subprocess.Popen(command(size, [sys.executable, "-m", "mpi4py", str(SERVER), str(folder)]),
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.next = 0
        self.started = time.monotonic()
        #: Scenarios served: a world serving many is where the start-ups were saved.
        self.served = 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def submit(self, request: dict) -> int:
        number = self.next
        path = self.folder / f"{number}.request.json"
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(request))
        os.replace(partial, path)
        self.next += 1
        return number

    def wait(self, number: int, ranks: int, timeout: float) -> list[str]:
        """Each rank's code file of scenario ``number`` (its text); WorldGone where the world ended
        first, TimeoutError past ``timeout`` (the world's start-up not counted)."""
        deadline = max(time.monotonic(), self.started + START_SECONDS if not self.served else 0) + timeout
        codes = [self.folder / f"{number}.{rank}.code" for rank in range(ranks)]
        while not all(path.exists() for path in codes):
            if not self.alive():
                raise WorldGone(self.process.returncode)
            if time.monotonic() > deadline:
                raise TimeoutError(number)
            time.sleep(0.01)
        self.served += 1
        return [path.read_text() for path in codes]

    def output(self, number: int, ranks: int) -> tuple[str, str]:
        def read(suffix: str) -> str:
            parts = []
            for rank in range(ranks):
                path = self.folder / f"{number}.{rank}.{suffix}"
                parts.append(path.read_text(errors="replace") if path.exists() else "")
            return "".join(parts)
        return read("out"), read("err")

    def close(self) -> None:
        if self.alive():
            self.submit({"quit": True})
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


class WorldPool:
    """This pytest worker's world, started on first use and restarted when it must be."""

    def __init__(self, folder: Path, env: dict[str, str], command):
        self.folder, self.env, self.command = folder, dict(env), command
        self.world: World | None = None
        self.started = 0  # worlds started: the suite's mpiexec starts that ran in a world

    def _world(self, ranks: int) -> World:
        if self.world is not None and (not self.world.alive() or self.world.size < ranks):
            self.world.close()
            self.world = None
        if self.world is None:
            self.started += 1
            self.world = World(max(SMALLEST, ranks), self.env, self.folder / f"world{self.started}", self.command)
        return self.world

    def run(self, ranks: int, request: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run one scenario (``request``: ``argv`` of ``mpigrad train``, or ``script``) on
        ``ranks`` ranks; TimeoutError where it did not end within ``timeout`` (the world is
        killed)."""
        world = self._world(ranks)
        number = world.submit({**request, "ranks": ranks})
        try:
            codes = world.wait(number, ranks, timeout)
        except WorldGone as gone:
            stdout, stderr = world.output(number, ranks)
            self.world = None
            world.log.close()
            # The aborting rank wrote its code before the abort; the launcher's may be 0.
            written = [_code(path.read_text()) for path in sorted(world.folder.glob(f"{number}.*.code"))]
            code = next((c for c in written if c), gone.code or 1)
            return subprocess.CompletedProcess(request, code, stdout, stderr)
        except TimeoutError:
            world.kill()
            world.log.close()
            self.world = None
            raise
        stdout, stderr = world.output(number, ranks)
        aborted = any(text.endswith(ABORTED) for text in codes)  # every rank wrote before the abort ended them
        codes = [_code(text) for text in codes]
        # A rank that said MPI_Abort failed the run, whatever the code files hold: stop 68's
        # CI read 0 for a scenario whose rank 1 printed MPI_Abort(MPI_COMM_WORLD, 5) (its
        # MPI_Abort had returned and the scenario went on: world_server's Abort no longer
        # returns). A failed run must never read as passed.
        said_abort = any(text in stderr for text in MPI_ABORT_SAID)
        if LEFT_STATE in codes or aborted or said_abort:  # the next scenario must not inherit it, nor a dying world
            world.kill()
            world.log.close()
            self.world = None
        code = next((c for c in codes if c), 1 if said_abort else 0)
        return subprocess.CompletedProcess(request, code, stdout, stderr)

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
            self.world = None


#: A relayed run's world keeps this many ranks at most: a larger run gets its own ``mpiexec``
#: rather than a world that would hold that many idle processes for the rest of the worker.
MAX_RELAYED_RANKS = 5
#: Variables a shell sets (or drops: PS1) of its own in a command's environment.
SHELL_OWN = ("PWD", "OLDPWD", "SHLVL", "_", "PS1")
RELAY = Path(__file__).resolve().with_name("mpiexec_relay.py")


class WorldRelay:
    """Serves ``mpiexec_relay.py``'s requests from a thread: each plain ``train`` run goes to
    ``pool`` (one at a time, as the shell runs them), declined where a fresh ``mpiexec``
    would differ: an environment that differs from ``base`` (the one the test gave the
    shell: :meth:`install`) in more than ``mpigrad``'s run-time variables, or more than
    ``MAX_RELAYED_RANKS`` ranks. ``runs`` keeps (options, result) of each relayed run,
    ``declined`` (options, why) of each sent to the real ``mpiexec``."""

    def __init__(self, pool: WorldPool, folder: Path, timeout: float):
        self.pool, self.folder, self.timeout = pool, folder, timeout
        self.base: dict[str, str] = {}
        self.runs: list[tuple[list[str], subprocess.CompletedProcess]] = []
        self.declined: list[tuple[list[str], str]] = []  # (options, why): sent to the real mpiexec
        self.path = str(folder / "relay.sock")  # a short folder: a socket's path has ~100 bytes
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(4)
        self.server.settimeout(0.2)  # so that close() ends the thread's wait
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="world relay", daemon=True)
        self.thread.start()

    def install(self, env: dict[str, str], real_mpiexec: str) -> dict[str, str]:
        """``env`` with an ``mpiexec`` that relays here first on its ``PATH`` and in
        ``$MPIGRAD_MPIEXEC`` (which mpigrad's own launches take): the environment of the
        command that starts runs, and the one a relayed run's is compared with."""
        from mpigrad.mpiexec import MPIEXEC_VARIABLE

        folder = self.folder / "bin"
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / "mpiexec"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{RELAY}" "{self.path}" "{real_mpiexec}" "$@"\n')
        script.chmod(0o755)
        self.base = dict(env, PATH=os.pathsep.join([str(folder), env.get("PATH", "")]), **{MPIEXEC_VARIABLE: str(script)})
        return dict(self.base)

    def answer(self, request: dict) -> dict:
        env = {name: value for name, value in request["env"].items() if name not in SHELL_OWN}
        base = {name: value for name, value in self.base.items() if name not in SHELL_OWN}
        try:
            changed = world_env_differs(env, base)
            if request["ranks"] > MAX_RELAYED_RANKS:
                raise ValueError(f"{request['ranks']} ranks: more than a relayed run's world keeps")
        except ValueError as exc:
            self.declined.append((request["argv"], str(exc)))
            return {"declined": True}
        try:
            result = self.pool.run(request["ranks"], {"command": request["command"], "argv": request["argv"],
                                                      "env": changed, "cwd": request["cwd"]}, self.timeout)
        except TimeoutError:
            result = subprocess.CompletedProcess(request["argv"], 124, "",
                                                 f"mpiexec (a shared world): timed out after {self.timeout} s\n")
        self.runs.append((request["argv"], result))
        return {"code": result.returncode, "stdout": result.stdout, "stderr": result.stderr}

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:  # closed
                return
            connection.settimeout(None)
            with connection:
                data = b"".join(iter(lambda: connection.recv(1 << 16), b""))
                try:
                    reply = self.answer(json.loads(data))
                except Exception as exc:  # the shell's command must fail, not hang
                    reply = {"code": 1, "stdout": "", "stderr": f"world relay: {type(exc).__name__}: {exc}\n"}
                connection.sendall(json.dumps(reply).encode())

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=5)
        self.server.close()
        Path(self.path).unlink(missing_ok=True)
