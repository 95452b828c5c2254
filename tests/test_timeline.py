"""tests/timeline.py: the suite's timeline (``MPIGRAD_TEST_TIMELINE=DIR``) and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from timeline import report


def _rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_report_shares_each_seconds_busy_cores_among_the_tests_running_in_it(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine reading it: the recording one's count wins
    (tmp_path / "cores").write_text("2")
    # gw0: a.py for 4 s; gw1: waits 2 s for the lock, then b.py for 2 s.
    _rows(tmp_path / "tests.gw0.jsonl", [{"id": "a.py::x", "start": 100, "began": 100, "end": 104, "whole": False}])
    _rows(tmp_path / "tests.gw1.jsonl", [{"id": "b.py::y", "start": 100, "began": 102, "end": 104, "whole": True}])
    (tmp_path / "cpu.tsv").write_text("".join(f"{t}\t{b}\n" for t, b in [(101, 1.0), (102, 1.0), (103, 2.0),
                                                                          (104, 1.5), (200, 2.0)]))
    text = report(tmp_path)
    assert "2 tests on 2 worker(s) in 4 s; the machine's 2 cores 1.38 busy on average" in text
    # Idle 1, 1, 0, 0.5 core-s: half of each second's to each worker; gw1 waited in the first two.
    assert "idle core-s: 1 while a worker waited for the machine lock, 2 inside tests, 0 between them" in text
    lines = text.splitlines()
    assert lines[3].split() == ["4", "4", "a.py"]  # 1 + 1 + 1 + 0.75 core-s (b.py waited in the first two)
    assert lines[4].split() == ["2", "2", "b.py"]  # 1 + 0.75 core-s, in its 2 s past the lock


def test_a_folder_without_a_timeline_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="timeline: no tests or no cpu.tsv in"):
        report(tmp_path)


def test_a_run_with_the_variable_set_records_its_tests_and_the_machine(tmp_path):
    """A real pytest run of this module's ``test_a_second_of_work`` under the variable: its
    line, at least one machine sample, and the report naming this module."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}  # not a worker
    env["MPIGRAD_TEST_TIMELINE"] = str(tmp_path / "timeline")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{__file__}::test_a_second_of_work"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in (tmp_path / "timeline" / "tests.main.jsonl").read_text().splitlines()]
    assert [row["id"].split("::")[1] for row in rows] == ["test_a_second_of_work"]
    assert rows[0]["end"] - rows[0]["began"] >= 1.5
    assert int((tmp_path / "timeline" / "cores").read_text()) == os.cpu_count()
    shown = subprocess.run([sys.executable, str(REPO / "tests" / "timeline.py"), str(tmp_path / "timeline")],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "1 tests on 1 worker(s)" in shown.stdout and "tests/test_timeline.py" in shown.stdout, shown.stdout


def test_a_second_of_work():
    """The timed run's test (above): long enough for a machine sample, instant otherwise."""
    if os.environ.get("MPIGRAD_TEST_TIMELINE"):
        time.sleep(1.6)
