"""Where the test suite's time goes: a timeline of one run, and its report.

With ``MPIGRAD_TEST_TIMELINE=DIR`` set, ``conftest.py`` registers :class:`Recorder`: each
pytest process (every xdist worker) appends a line per test to ``DIR/tests.WORKER.jsonl``
(its start, when it held the machine lock and could begin, its end, whether it took the
machine whole), and the controlling process samples the machine's busy cores once a second
from ``/proc/stat`` into ``DIR/cpu.tsv`` (every process counted: a shared world's ranks, a
Slurm job's, a lab's, which ``getrusage`` of the pytest tree misses). Afterwards::

    python tests/timeline.py DIR

prints the machine's mean busy cores over the run, its idle core-seconds (while a worker
waited for the machine lock, and inside tests), and the busy core-seconds and wall seconds
of each module (a second's busy cores shared among the tests running in it, a test waiting
for the lock not counted).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

_SAMPLE_SECONDS = 1.0


def _busy_jiffies() -> tuple[int, int]:
    """(all, idle) jiffies of every CPU since boot, from /proc/stat's first line."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values), values[3] + values[4]  # idle and iowait


class Recorder:
    """The pytest plugin: a line per test from every process, machine samples from the
    controlling one (``sample``)."""

    def __init__(self, folder: Path, whole_markers: tuple[str, ...], sample: bool):
        self.folder, self.whole_markers = folder, whole_markers
        folder.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out = open(folder / f"tests.{worker}.jsonl", "a", buffering=1)
        self.began: dict[str, float] = {}
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, name="timeline sampler", daemon=True) if sample else None
        if self.sampler is not None:
            (folder / "cores").write_text(str(os.cpu_count() or 1))  # the recording machine's, for the report
            self.sampler.start()

    def _sample(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        with open(self.folder / "cpu.tsv", "a", buffering=1) as out:
            total, idle = _busy_jiffies()
            while not self.stop.wait(_SAMPLE_SECONDS):
                now_total, now_idle = _busy_jiffies()
                busy = ((now_total - total) - (now_idle - idle)) / ticks / _SAMPLE_SECONDS
                out.write(f"{time.time():.2f}\t{busy:.3f}\n")
                total, idle = now_total, now_idle

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start = time.time()
        yield
        whole = any(item.get_closest_marker(name) for name in self.whole_markers)
        self.out.write(json.dumps({"id": item.nodeid, "start": start, "began": self.began.pop(item.nodeid, start),
                                   "end": time.time(), "whole": whole}) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self.began[item.nodeid] = time.time()  # inside the machine lock: its wait is over

    def pytest_unconfigure(self, config):
        self.stop.set()
        if self.sampler is not None:
            self.sampler.join(timeout=5)
        self.out.close()


def report(folder: Path, top: int = 25) -> str:
    """The timeline of ``folder`` as text (see the module's docstring)."""
    tests = {path.name.split(".")[1]: [json.loads(line) for line in path.read_text().splitlines() if line]
             for path in sorted(folder.glob("tests.*.jsonl"))}
    tests = {worker: rows for worker, rows in tests.items() if rows}
    if not tests or not (folder / "cpu.tsv").exists():
        raise SystemExit(f"timeline: no tests or no cpu.tsv in {folder}")
    first = min(row["start"] for rows in tests.values() for row in rows)
    last = max(row["end"] for rows in tests.values() for row in rows)
    samples = [(float(t), float(b)) for t, b in (line.split() for line in (folder / "cpu.tsv").read_text().splitlines())]
    samples = [(t, b) for t, b in samples if first < t <= last + _SAMPLE_SECONDS]
    if not samples:
        raise SystemExit(f"timeline: no machine samples within the tests' span in {folder}")
    recorded = folder / "cores"
    cores = int(recorded.read_text()) if recorded.exists() else os.cpu_count() or 1
    busy_by, wall_by = collections.Counter(), collections.Counter()
    idle_waiting = idle_inside = idle_outside = 0.0
    for rows in tests.values():
        rows.sort(key=lambda row: row["start"])
        for row in rows:
            wall_by[row["id"].split("::")[0]] += row["end"] - row["began"]
    for t, busy in samples:
        moment = t - _SAMPLE_SECONDS / 2
        running = []
        for rows in tests.values():
            found = next((row for row in rows if row["start"] <= moment < row["end"]), None)
            running.append(found)
        idle = max(0.0, cores - busy) / len(running)
        live = [row for row in running if row is not None and moment >= row["began"]]  # a lock's wait does no work
        for row in running:
            if row is None:
                idle_outside += idle
            elif moment < row["began"]:
                idle_waiting += idle
            else:
                idle_inside += idle
        for row in live:
            busy_by[row["id"].split("::")[0]] += busy / len(live)
    span = last - first
    mean = sum(b for _, b in samples) / len(samples)
    lines = [f"{sum(map(len, tests.values()))} tests on {len(tests)} worker(s) in {span:.0f} s; the machine's "
             f"{cores} cores {mean:.2f} busy on average ({mean * span:.0f} core-s busy, "
             f"{(cores - mean) * span:.0f} idle)",
             f"idle core-s: {idle_waiting:.0f} while a worker waited for the machine lock, {idle_inside:.0f} inside "
             f"tests, {idle_outside:.0f} between them",
             f"{'busy core-s':>12} {'wall s':>8}  module (wall: its tests' own, their lock waits apart)"]
    lines += [f"{busy:12.0f} {wall_by[module]:8.0f}  {module}" for module, busy in busy_by.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/timeline.py DIR")
    print(report(Path(sys.argv[1])))
