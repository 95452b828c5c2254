"""`mpigrad trace retime`: a run re-charged under another network equals that network's run.

The runs are deterministic (``--net-mode virtual --compute-time``, one seed), so a Fix 2 run
at 10 MB/s re-timed to 100 MB/s must give a real 100 MB/s run's simulated times, and its
losses and bytes unchanged; with measured local work, re-timing a run to its own network
gives back its own times. Refusals are checked on copies of a real trace whose attributes
are edited.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import SMALL_RUN, run_mpi
from mpigrad.cli import main
from mpigrad.trace import load, read_raw
from mpigrad.trace.writer import write_closed

pytestmark = pytest.mark.mpi

FIX2 = [*SMALL_RUN, "--iterations", "10", "--eval-every", "4", "--policy", "fixed", "--bits", "2",
        "--codec", "uniform", "--seed", "5"]
DETERMINISTIC = ["--net-mode", "virtual", "--compute-time", "20ms"]
#: Re-charged columns: they must equal the target network's run (the runtime and retime
#: charge through the same clockmodel code, in the same order: to the last bit, in fact).
RETIMED_COLUMNS = (("steps", "sim_time"), ("steps", "t_comm"), ("eval", "sim_time"))
#: Kept columns: they must equal the source's exactly.
KEPT_COLUMNS = (("steps", "loss"), ("steps", "bits"), ("steps", "bytes_up"), ("steps", "bytes_down"),
                ("steps", "wall_time"), ("eval", "test_accuracy"), ("eval", "test_loss"))


def train(tmp_path, env, name, ranks, *extra):
    trace = tmp_path / name
    result = run_mpi(ranks, ["train", "--trace", str(trace), *FIX2, *extra], env, timeout=180)
    assert result.returncode == 0, result.stderr
    return trace


def cli(capsys, *args):
    code = main(["trace", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mpi_env):
    """Fix 2 at 10 MB/s and at 100 MB/s, with one server and with two servers (tree broadcast
    and 1 ms latency at 100 MB/s), and one run with measured local work."""
    tmp = tmp_path_factory.mktemp("retime")
    two = ["--servers", "2"]
    return {
        "slow": train(tmp, mpi_env, "slow.h5", 3, *DETERMINISTIC, "--bandwidth", "10MB/s"),
        "fast": train(tmp, mpi_env, "fast.h5", 3, *DETERMINISTIC, "--bandwidth", "100MB/s"),
        "slow-2s": train(tmp, mpi_env, "slow-2s.h5", 4, *DETERMINISTIC, *two, "--bandwidth", "10MB/s"),
        "fast-2s-tree": train(tmp, mpi_env, "fast-2s-tree.h5", 4, *DETERMINISTIC, *two, "--bandwidth", "100MB/s",
                              "--latency", "1ms", "--broadcast", "tree"),
        "slow-col": train(tmp, mpi_env, "slow-col.h5", 4, *DETERMINISTIC, "--servers", "colocated",
                          "--bandwidth", "10MB/s"),
        "fast-col-tree": train(tmp, mpi_env, "fast-col-tree.h5", 4, *DETERMINISTIC, "--servers", "colocated",
                               "--bandwidth", "100MB/s", "--latency", "1ms", "--broadcast", "tree"),
        "measured": train(tmp, mpi_env, "measured.h5", 3, "--net-mode", "virtual", "--bandwidth", "10MB/s",
                          "--iterations", "4"),
    }


def assert_retimed_as(retimed, target, source) -> None:
    for table, column in RETIMED_COLUMNS:
        np.testing.assert_allclose(retimed.array(table, column), target.array(table, column), rtol=1e-12,
                                   err_msg=f"{table}.{column}")
        np.testing.assert_array_equal(retimed.array(table, column), target.array(table, column),
                                      err_msg=f"{table}.{column} (bit for bit)")
    for table, column in KEPT_COLUMNS:
        np.testing.assert_array_equal(retimed.array(table, column), source.array(table, column),
                                      err_msg=f"{table}.{column}")
    # Same seed, same bits: the target run's losses and bytes are the source's too.
    for table, column in KEPT_COLUMNS:
        if column != "wall_time":
            np.testing.assert_array_equal(source.array(table, column), target.array(table, column),
                                          err_msg=f"{table}.{column}")


def test_fix2_at_10MBps_retimed_to_100MBps_is_the_100MBps_run(runs, tmp_path, capsys):
    out = tmp_path / "retimed.h5"
    code, stdout, stderr = cli(capsys, "retime", runs["slow"], "--bandwidth", "100MB/s", "-o", out)
    assert code == 0, stderr
    assert stdout.startswith(f"wrote {out}: 10 iterations re-timed from 10MB/s latency 0s star to "
                             "100MB/s latency 0s star"), stdout
    source, target, retimed = load(runs["slow"]), load(runs["fast"]), load(out)
    assert_retimed_as(retimed, target, source)
    assert retimed.array("steps", "sim_time")[-1] < 0.5 * source.array("steps", "sim_time")[-1]
    # The output says what it is: the new network in its config, the source and its network.
    assert {k: retimed.config[k] for k in ("bandwidth", "latency", "broadcast")} == \
        {"bandwidth": 1e8, "latency": 0.0, "broadcast": "star"}
    assert retimed.config["retimed"] is True and retimed.attrs["retimed_from"] == str(runs["slow"])
    assert retimed.attrs["retimed_from_network"] == {"bandwidth": 1e7, "latency": 0.0, "broadcast": "star"}
    assert retimed.complete and retimed.label == "Fix (2-bit) (retimed)"


def test_two_servers_retimed_to_another_rate_latency_and_broadcast(runs, tmp_path, capsys):
    out = tmp_path / "retimed-2s.h5"
    code, _, stderr = cli(capsys, "retime", runs["slow-2s"], "--bandwidth", "100MB/s", "--latency", "1ms",
                          "--broadcast", "tree", "-o", out)
    assert code == 0, stderr
    source, target = load(runs["slow-2s"]), load(runs["fast-2s-tree"])
    assert_retimed_as(load(out), target, source)
    # The frames the clock charges one by one add up to what each server and worker sent.
    frames = source.array("servers", "frame_bytes")
    assert frames.shape == (10, 2, 2)
    np.testing.assert_array_equal(frames.sum(axis=2), source.array("servers", "bytes_in"))
    np.testing.assert_array_equal(frames.sum(axis=1), source.array("workers", "bytes_sent"))


def test_colocated_servers_retimed_to_another_rate_latency_and_broadcast(runs, tmp_path, capsys):
    out = tmp_path / "retimed-col.h5"
    code, _, stderr = cli(capsys, "retime", runs["slow-col"], "--bandwidth", "100MB/s", "--latency", "1ms",
                          "--broadcast", "tree", "-o", out)
    assert code == 0, stderr
    source, target = load(runs["slow-col"]), load(runs["fast-col-tree"])
    assert_retimed_as(load(out), target, source)
    # A worker's frame to the shard it serves crosses no link: left out of what it sent.
    frames = source.array("servers", "frame_bytes")
    assert frames.shape == (10, 3, 3)
    local = np.trace(frames, axis1=1, axis2=2)
    np.testing.assert_array_equal(source.array("servers", "bytes_in").sum(axis=1), frames.sum(axis=(1, 2)) - local)


def test_a_run_retimed_to_its_own_network_keeps_its_times(runs, tmp_path, capsys):
    """With measured local work the recorded t_compute, t_encode, t_decode and t_policy are
    charged again: the same network gives the run's own clock, bit for bit."""
    for name in ("measured", "slow-2s"):
        out = tmp_path / f"same-{name}.h5"
        assert cli(capsys, "retime", runs[name], "--bandwidth", "10MB/s", "-o", out)[0] == 0
        source, retimed = load(runs[name]), load(out)
        for table, column in RETIMED_COLUMNS:
            np.testing.assert_array_equal(retimed.array(table, column), source.array(table, column),
                                          err_msg=f"{name} {table}.{column}")


def test_compare_labels_and_groups_a_retimed_trace(runs, tmp_path, capsys):
    out = tmp_path / "retimed.h5"
    assert cli(capsys, "retime", runs["slow"], "--bandwidth", "100MB/s", "-o", out)[0] == 0
    code, stdout, stderr = cli(capsys, "compare", runs["fast"], out, "--target-loss", "100", "--format", "csv")
    assert code == 0, stderr
    assert pd.read_csv(io.StringIO(stdout))["method"].tolist() == ["Fix (2-bit)", "Fix (2-bit) (retimed)"]
    code, stdout, _ = cli(capsys, "summary", runs["slow"], out, "--format", "csv")
    assert pd.read_csv(io.StringIO(stdout))["method"].tolist() == ["Fix (2-bit) bandwidth=10MB/s",
                                                                   "Fix (2-bit) (retimed) bandwidth=100MB/s"]


def _edited(source, path, *, status=None, **config):
    raw = read_raw(source)
    attrs = {**raw.attrs, "config": {**raw.attrs["config"], **config}}
    if status:
        attrs.update(status=status, complete=False)
    write_closed(path, raw.specs, raw.arrays, attrs)
    return path


@pytest.mark.parametrize("edit, args, message", [
    ({"policy": "mqgrad"}, [], "policy 'mqgrad' reads the clock to choose its bits"),
    ({"status": "stopped"}, [], "trace status 'stopped'; only a complete run is re-timed"),
    ({"net_mode": "off"}, [], "run with --net-mode off"),
    ({"peer": {"system": "torch DDP"}}, [], "a peer system's run"),
    ({"pipeline": True}, [], "a pipelined run (--pipeline)"),
    ({}, ["--bandwidth", "100"], "bandwidth '100' has no unit"),
    ({}, ["--bandwidth", "0MB/s"], "must be positive"),  # parse_rate or retime says it
    ({}, ["--latency", "soon"], "cannot read duration 'soon'"),
])
def test_refusals_are_one_line_and_write_nothing(runs, tmp_path, capsys, edit, args, message):
    source = _edited(runs["slow"], tmp_path / "source.h5", **edit)
    out = tmp_path / "out.h5"
    code, stdout, stderr = cli(capsys, "retime", source, "--bandwidth", "100MB/s", *args, "-o", out)
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))


def _without(source, path, table, column=None, *, add_to_bytes_up=0):
    """A copy of ``source`` lacking ``table`` (or one of its columns), or whose bytes_up is off."""
    raw = read_raw(source)
    specs = {t: dict(c) for t, c in raw.specs.items()}
    arrays = {t: dict(c) for t, c in raw.arrays.items()}
    if column:
        del specs[table][column], arrays[table][column]
    elif table:
        del specs[table], arrays[table]
    arrays["steps"]["bytes_up"] = arrays["steps"]["bytes_up"] + add_to_bytes_up
    write_closed(path, specs, arrays, raw.attrs)
    return path


def test_traces_that_lack_the_bytes_are_refused(runs, tmp_path, capsys):
    out = tmp_path / "out.h5"
    cases = [(_without(runs["slow-2s"], tmp_path / "a.h5", "servers", "frame_bytes"),
              "records no frame sizes per server and worker"),
             (_without(runs["slow"], tmp_path / "b.h5", "servers"), "has no servers table"),
             (_without(runs["slow"], tmp_path / "c.h5", None, add_to_bytes_up=1), "iteration 0: bytes up")]
    for source, message in cases:
        code, _, stderr = cli(capsys, "retime", source, "--bandwidth", "100MB/s", "-o", out)
        assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
        assert not out.exists()
    # One server: the workers' bytes are its frames, so a trace without frame_bytes still re-times.
    source = _without(runs["slow"], tmp_path / "d.h5", "servers", "frame_bytes")
    assert cli(capsys, "retime", source, "--bandwidth", "100MB/s", "-o", out)[0] == 0
    np.testing.assert_array_equal(load(out).array("steps", "sim_time"), load(runs["fast"]).array("steps", "sim_time"))


def test_an_existing_output_needs_force(runs, tmp_path, capsys):
    out = tmp_path / "out.h5"
    out.write_bytes(b"keep me")
    code, _, stderr = cli(capsys, "retime", runs["slow"], "--bandwidth", "100MB/s", "-o", out)
    assert code == 2 and "exists; pass --force" in stderr and out.read_bytes() == b"keep me"
    assert cli(capsys, "retime", runs["slow"], "--bandwidth", "100MB/s", "-o", out, "--force")[0] == 0
    assert load(out).config["retimed"] is True


def test_retime_imports_neither_mpi_nor_torch():
    code = ("import sys, mpigrad.analysis.cli, mpigrad.analysis.retime; "
            "print(sorted(m for m in ('mpi4py', 'torch', 'numba') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
