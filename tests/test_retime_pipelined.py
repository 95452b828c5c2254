"""`mpigrad trace retime` of a pipelined run (``--pipeline``): its trace keeps the iteration
bucket by bucket (the ``buckets`` table: when backward made each bucket ready on each worker,
each bucket's frames and average), and the retime re-charges it through the same
``LinkModel.pipelined_iteration`` the runtime charged it with. A deterministic run
(``compute_time``) re-timed to another rate and latency is that network's run, bit for bit;
with measured compute, re-timed to its own network it keeps its own times, and its ready
times are what the charge reads. Runs are in-process (each rank a thread on the loopback
channel, tests/test_exchanges.run)."""

from __future__ import annotations

import numpy as np
import pytest

from mpigrad.cli import main
from mpigrad.trace import load, read_raw
from mpigrad.trace.writer import write_closed
from test_exchanges import run

METHOD = dict(codec="uniform", policy="fixed", bits=4, servers="colocated", pipeline=True)
#: (name, options, workers): flat on 3 workers, hierarchical on 2 nodes of 2.
LAYOUTS = {
    "flat": (dict(), 3),
    "hierarchical": (dict(ranks_per_node=2, exchange="hierarchical"), 4),
}
SLOW = dict(bandwidth=1e7, latency=0.0)
FAST = dict(bandwidth=1e8, latency=1e-4)
RETIMED = (("steps", "sim_time"), ("steps", "t_comm"))
NODES = (("steps", "bytes_nic"), ("steps", "bytes_intra"), ("steps", "t_nic"), ("steps", "t_intra"))
KEPT = (("steps", "loss"), ("steps", "bytes_up"), ("steps", "bytes_down"), ("buckets", "ready"),
        ("buckets", "frames"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    traces = {}
    for layout, (options, workers) in LAYOUTS.items():
        for speed, network in (("slow", SLOW), ("fast", FAST), ("measured", {**SLOW, "compute_time": None})):
            codes, errors, config = run(tmp_path_factory.mktemp(f"{layout}-{speed}"),
                                        {**METHOD, **options, **network}, workers)
            assert not errors, errors
            traces[layout, speed] = config.trace
    return traces


def retime(capsys, source, out, *args) -> tuple[int, str, str]:
    code = main(["trace", "retime", str(source), "-o", str(out), *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_pipelined_trace_keeps_its_iteration_bucket_by_bucket(runs):
    raw = read_raw(runs["hierarchical", "measured"])
    buckets, steps = raw.arrays["buckets"], raw.arrays["steps"]
    rows, workers, count = buckets["ready"].shape
    assert (rows, workers) == (4, 4) and count > 2 and buckets["frames"].shape == (4, count, workers)
    np.testing.assert_array_equal(buckets["iteration"], steps["iteration"])
    ready = buckets["ready"]
    assert (ready >= 0).all() and (np.diff(ready, axis=2) >= 0).all()  # backward's order, last layer first
    assert (buckets["t_backward"] >= ready.max(axis=(1, 2)) - 1e-12).all()
    # each bucket's frames come from the other node's slice owner only (on the shard's own node
    # the owner is the shard's worker: its frame crosses no link)
    np.testing.assert_array_equal((buckets["frames"] > 0).sum(axis=2), np.full((4, count), 1))
    assert (buckets["intra"] > 0).all() and (buckets["bcast"] > 0).all()
    flat = read_raw(runs["flat", "measured"]).arrays["buckets"]
    assert (flat["intra"] == 0).all()
    frames = read_raw(runs["flat", "measured"]).arrays["servers"]["frame_bytes"]  # [row, shard, worker]
    by_shard = np.zeros_like(frames)
    for row in range(4):
        for b, s in enumerate(flat["shard"][row]):
            by_shard[row, s] += flat["frames"][row, b]
    own = np.eye(3, dtype=bool)  # a worker's frame to its own shard: in frame_bytes, but it crosses no link
    np.testing.assert_array_equal(by_shard, np.where(own, 0, frames))  # the buckets add up to each frame


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_deterministic_pipelined_run_retimed_is_the_other_networks_run(runs, tmp_path, capsys, layout):
    out = tmp_path / "retimed.h5"
    code, stdout, stderr = retime(capsys, runs[layout, "slow"], out, "--bandwidth", "100MB/s", "--latency", "100us")
    assert code == 0, stderr
    source, target, retimed = load(runs[layout, "slow"]), load(runs[layout, "fast"]), load(out)
    columns = RETIMED + (NODES if layout == "hierarchical" else ())
    for table, column in columns:
        np.testing.assert_array_equal(retimed.array(table, column), target.array(table, column),
                                      err_msg=f"{table}.{column}")
    for table, column in KEPT:
        np.testing.assert_array_equal(retimed.array(table, column), source.array(table, column))
    assert (source.array("steps", "t_comm") > retimed.array("steps", "t_comm")).all()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_measured_pipelined_run_retimed_to_its_own_network_keeps_its_times(runs, tmp_path, capsys, layout):
    source = runs[layout, "measured"]
    out = tmp_path / "same.h5"
    assert retime(capsys, source, out, "--bandwidth", "10MB/s")[0] == 0
    for table, column in RETIMED:
        np.testing.assert_array_equal(load(out).array(table, column), load(source).array(table, column))
    # the ready times are what the charge reads: every bucket ready when backward ends costs more
    raw = read_raw(source)
    arrays = {t: dict(c) for t, c in raw.arrays.items()}
    buckets = arrays["buckets"]
    buckets["ready"] = np.broadcast_to(buckets["t_backward"][:, None, None], buckets["ready"].shape).copy()
    late = tmp_path / "late.h5"
    write_closed(late, raw.specs, arrays, raw.attrs)
    assert retime(capsys, late, tmp_path / "late-retimed.h5", "--bandwidth", "10MB/s")[0] == 0
    assert (load(tmp_path / "late-retimed.h5").array("steps", "t_comm") >
            load(source).array("steps", "t_comm")).all()


def _edited(source, path, edit) -> str:
    raw = read_raw(source)
    specs = {t: dict(c) for t, c in raw.specs.items()}
    arrays = {t: {name: np.array(column) for name, column in c.items()} for t, c in raw.arrays.items()}
    edit(specs, arrays)
    write_closed(path, specs, arrays, raw.attrs)
    return path


def _no_buckets(specs, arrays):
    del specs["buckets"], arrays["buckets"]


def _shard_out_of_range(specs, arrays):
    arrays["buckets"]["shard"][1, 0] = 7


def _rows_missing(specs, arrays):
    arrays["buckets"] = {name: column[:-1] for name, column in arrays["buckets"].items()}


@pytest.mark.parametrize("edit, args, message", [
    (_no_buckets, [], "a pipelined run (--pipeline) whose trace keeps no buckets table"),
    (_shard_out_of_range, [], "iteration 1: a bucket's shard or bytes out of range"),
    (_rows_missing, [], "the buckets table's iterations are not the steps table's"),
    (None, ["--ranks-per-node", "1"], "a pipelined run's schedule is charged on its own 2 workers per node"),
])
def test_a_pipelined_trace_that_cannot_be_retimed_is_refused_in_one_line(runs, tmp_path, capsys, edit, args,
                                                                         message):
    source = runs["hierarchical", "slow"]
    if edit is not None:
        source = _edited(source, tmp_path / "edited.h5", edit)
    out = tmp_path / "out.h5"
    code, _, stderr = retime(capsys, source, out, "--bandwidth", "100MB/s", *args)
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not out.exists()


def test_simulate_says_a_pipelined_trace_is_not_simulated_yet(runs, capsys):
    code = main(["simulate", str(runs["flat", "slow"]), "--peers", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "a pipelined run (--pipeline) is not simulated yet" in err and err.count("\n") == 1, err
