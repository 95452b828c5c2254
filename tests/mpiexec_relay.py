"""An ``mpiexec`` in front of the real one, for commands a test runs through a shell (the
documented commands): ``mpiexec -n N python -m mpi4py -m mpigrad train ARGS`` (or ``sweep
RUNS``) is handed to
the pytest worker's shared world (``tests/worlds.py``'s :class:`WorldRelay`, over the Unix
socket SOCKET) and answered with what a fresh ``mpiexec`` would have given: the ranks'
stdout and stderr, and the exit code. Anything else, and a run the relay declines (an
environment a world cannot take, more ranks than it keeps), goes to the real ``mpiexec``.

Usage (by the ``mpiexec`` script ``WorldRelay.install`` writes): ``python mpiexec_relay.py
SOCKET REAL_MPIEXEC ARG...``. Imports nothing heavy: it runs once per command."""

from __future__ import annotations

import json
import os
import socket
import sys

#: Flags mpigrad's own launches give Open MPI (mpigrad.mpiexec.launch_flags): a world's
#: ranks already have what they ask for.
LAUNCH_FLAGS = ("--oversubscribe", "--allow-run-as-root")


def world_command(args: list[str]) -> bool:
    """Whether ``mpigrad ARGS`` is a command a world runs: a ``train`` run (not its
    ``--check``: the launcher's own path), or ``sweep RUNS``."""
    if args[:1] == ["train"]:
        return "--check" not in args
    return len(args) == 2 and args[0] == "sweep" and not args[1].startswith("-")


def relayed_run(argv: list[str]) -> tuple[int, list[str]] | None:
    """``(ranks, mpigrad's arguments)`` where ``argv`` (what follows ``mpiexec``) starts a
    command a world runs (:func:`world_command`) on ``-n`` ranks; None for any other."""
    while argv[:1] and argv[0] in LAUNCH_FLAGS:
        argv = argv[1:]
    if len(argv) < 7 or argv[0] not in ("-n", "-np") or not argv[1].isdigit():
        return None
    python, *module = argv[2:7]
    if not os.path.basename(python).startswith("python") or module != ["-m", "mpi4py", "-m", "mpigrad"]:
        return None
    args = argv[7:]
    return (int(argv[1]), args) if world_command(args) else None


def _ask(path: str, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(path)
        connection.sendall(json.dumps(request).encode())
        connection.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: connection.recv(1 << 16), b""))
    return json.loads(reply)


def main() -> None:
    path, real, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    run = relayed_run(argv)
    if run is not None:
        ranks, args = run
        reply = _ask(path, {"ranks": ranks, "command": args[0], "argv": args[1:], "cwd": os.getcwd(),
                            "env": dict(os.environ)})
        if not reply.get("declined"):
            sys.stdout.write(reply["stdout"])
            sys.stderr.write(reply["stderr"])
            sys.stdout.flush()
            sys.stderr.flush()
            sys.exit(reply["code"])
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main()
