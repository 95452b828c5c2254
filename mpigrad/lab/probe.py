"""The rate check's two ends, run inside the lab's namespaces by :mod:`.ratecheck`::

    python -m mpigrad.lab.probe recv ADDRESS PORT SKIP   # prints {"bytes": B, "seconds": S}
    python -m mpigrad.lab.probe send ADDRESS PORT BYTES

The receiver times the payload after its first SKIP bytes (tbf lets its bucket's burst
through at line speed) to the last byte, and prints what it counted as one JSON line.
Standard library only: it starts in tens of milliseconds.
"""

from __future__ import annotations

import json
import socket
import sys
import time

_CHUNK = 1 << 20
_CONNECT_SECONDS = 10.0


def receive(address: str, port: int, skip: int) -> dict:
    with socket.create_server((address, port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            total, started, counted = 0, None, 0
            while True:
                n = conn.recv_into(view)
                if not n:
                    break
                total += n
                if started is None and total >= skip:
                    started, counted = time.perf_counter(), total
            ended = time.perf_counter()
    if started is None:
        return {"bytes": 0, "seconds": 0.0, "total": total}
    return {"bytes": total - counted, "seconds": ended - started, "total": total}


def send(address: str, port: int, size: int) -> None:
    deadline = time.monotonic() + _CONNECT_SECONDS
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=_CONNECT_SECONDS)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    payload = bytes(_CHUNK)
    with conn:
        conn.settimeout(None)
        left = size
        while left > 0:
            conn.sendall(payload[:min(left, _CHUNK)])
            left -= min(left, _CHUNK)


def main(argv: list[str]) -> int:
    role, address, port, amount = argv[0], argv[1], int(argv[2]), int(argv[3])
    if role == "recv":
        print(json.dumps(receive(address, port, amount)), flush=True)
    else:
        send(address, port, amount)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
