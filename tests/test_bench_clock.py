"""``mpigrad bench clock``: the simulated clock against the network lab (root), and its refusals."""

import json
import re
import subprocess
import sys

import pytest

from mpigrad.cli import main as cli_main
from mpigrad.simulate.simgrid_module import simgrid_path

needs_simgrid = pytest.mark.skipif(not simgrid_path().is_file(), reason="SimGrid's Python module: "
                                   "apt-get install python3-simgrid")


def _lab_reason():
    from mpigrad.lab.host import unavailable_reason
    return unavailable_reason() if sys.platform.startswith("linux") else "network namespaces need Linux"


@pytest.mark.parametrize("args, message", [
    (["--codecs", "fp64"], "unknown codec 'fp64'"),
    (["--rates", "10"], "has no unit"),
    (["--servers", "0"], "servers must be a number of server ranks"),
    (["--broadcast", "ring"], "broadcast must be one of star, tree, mpich"),
    (["--iterations", "4", "--warmup", "3"], "--iterations must exceed --warmup"),
    (["--servers", "pipeline", "--codecs", "powersgd2q8"], "--servers pipeline does not run two-round codecs"),
    (["--servers", "1", "--ranks-per-node", "2"], "--ranks-per-node L > 1 needs --servers colocated"),
    (["--workers", "3", "--servers", "colocated", "--ranks-per-node", "2"], "a --workers P that L divides"),
    (["--exchange", "ring"], "exchange must be one of auto, flat, hierarchical"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, args, message):
    assert cli_main(["bench", "clock", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.lab
@pytest.mark.mpi
@pytest.mark.skipif(_lab_reason() is not None, reason="mpigrad lab cannot run here")
def test_a_run_in_the_lab_gives_both_clocks():
    command = [sys.executable, "-m", "mpigrad", "bench", "clock", "--workers", "2", "--servers", "colocated,pipeline",
               "--codecs", "uniform2", "--rates", "20MB/s", "--iterations", "6", "--warmup", "2",
               "--", "--model-opt", "fc_sizes=[64,64]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert [(row["servers"], row["rate"]) for row in rows] == [("colocated", "20MB/s"), ("pipeline", "20MB/s")]
    for row in rows:
        assert row["real_s"] > 0 and row["sim_s"] > 0 and 0 < row["local_s"] < row["real_s"]
        assert set(row["phases"]) == {"compute", "losses", "control", "gradients", "broadcast", "after"}
        assert all(real >= 0 and sim >= 0 for real, sim in row["phases"].values()), row["phases"]
        assert row["phases"]["gradients"][1] > 0 and "real (sim) s: compute" in done.stdout
        # the modelled messages take real time too: a clock off by 3x either way is broken
        assert 0.33 < row["sim_over_real"] < 3, row
    if simgrid_path().is_file():  # SimGrid's column: both runs replayed, the pipelined one bucket by bucket
        for row in rows:
            assert 0.33 < row["simgrid_over_real"] < 3 and row["simgrid_model"] == "cm02", row
            assert "simgrid_note" not in row, row
        assert re.search(r"; SimGrid [012] of 2 replayed rows\n", done.stdout), done.stdout
    else:
        assert "SimGrid column: not measured, SimGrid's Python module is not installed" in done.stdout


def test_the_phase_log_times_every_phase_of_every_rank(tmp_path, monkeypatch):
    """MPIGRAD_PHASE_LOG: each rank logs when it ended each phase, rank 0 what the clock
    charged; the bench's per-phase medians come out of it."""
    from mpigrad.bench.clock import _phases
    from mpigrad.config import COLOCATED
    from mpigrad.runtime.roles.iteration import PHASES
    from mpigrad.runtime.measure.phaselog import ENV, read
    from test_runtime_loopback import run

    monkeypatch.setenv(ENV, str(tmp_path / "phases"))
    code, errors, _ = run(tmp_path, servers="colocated", workers=2, iterations=4)
    assert code == 0 and not errors, errors
    lines = read(tmp_path / "phases")
    assert sorted(lines) == [0, 1, 2, 3] and all(sorted(ranks) == [0, 1, 2] for ranks in lines.values())
    for ranks in lines.values():
        for line in ranks.values():
            times = [line["t"][phase] for phase in ("begin", *PHASES, "end")]
            assert times == sorted(times)
        assert set(ranks[0]["sim"]) == {"losses", "control", "gradients", "broadcast", "local"}
    phases = _phases(tmp_path / "phases", 2, COLOCATED, 1)
    assert all(real >= 0 for real, _ in phases.values()) and phases["gradients"][1] > 0


def test_two_round_phases_add_the_second_round_to_the_first(tmp_path, monkeypatch):
    """PowerSGD's second round (gradients2, broadcast2) is real time the clock charges under
    "gradients" and "broadcast": the bench adds it there, and leaving it out loses time."""
    from mpigrad.bench.clock import _phases
    from mpigrad.config import COLOCATED
    from mpigrad.runtime.measure.phaselog import ENV, read
    from test_runtime_loopback import run

    monkeypatch.setenv(ENV, str(tmp_path / "phases"))
    code, errors, _ = run(tmp_path, servers="colocated", workers=2, iterations=5, codec="powersgd",
                          codec_opts={"rank": 2, "factor_bits": 8}, policy="fixed", min_quantize_size=None)
    assert code == 0 and not errors, errors
    lines = read(tmp_path / "phases")
    one, two = _phases(tmp_path / "phases", 2, COLOCATED, 1), _phases(tmp_path / "phases", 2, COLOCATED, 1, True)
    assert all(real >= 0 for real, _ in two.values()), two
    assert two["gradients"][1] == one["gradients"][1] > 0  # the charge holds both rounds either way
    round2 = [max(r[w]["t"]["broadcast2"] for w in (1, 2)) - max(r[w]["t"]["broadcast"] for w in (1, 2))
              for m, r in sorted(lines.items())[2:]]
    assert min(round2) > 0
    # per iteration the second round moves from "after" into the rounds: medians keep the order
    assert two["gradients"][0] > one["gradients"][0] and two["broadcast"][0] >= one["broadcast"][0]
    assert two["after"][0] < one["after"][0]


def test_an_existing_out_file_is_refused_without_force(tmp_path, capsys):
    out = tmp_path / "clock.json"
    out.write_text("keep me")
    assert cli_main(["bench", "clock", "--workers", "2", "--servers", "1", "--codecs", "fp32", "--rates", "20MB/s",
                     "--iterations", "4", "--warmup", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} exists; pass --force to overwrite it" in err, err
    assert out.read_text() == "keep me"


@pytest.mark.lab
@pytest.mark.mpi
@pytest.mark.skipif(_lab_reason() is not None, reason="mpigrad lab cannot run here")
def test_nodes_of_two_workers_in_the_lab_give_both_clocks():
    """2 nodes of 2 workers, flat and hierarchical: each row says its nodes and exchange, and
    the hierarchical one's simulated gradients and broadcast hold its intra-node phases."""
    command = [sys.executable, "-m", "mpigrad", "bench", "clock", "--workers", "4", "--servers", "colocated",
               "--ranks-per-node", "2", "--exchange", "flat,hierarchical", "--codecs", "uniform2", "--rates", "20MB/s",
               "--iterations", "6", "--warmup", "2", "--", "--model-opt", "fc_sizes=[64,64]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert [(r["ranks_per_node"], r["exchange"]) for r in rows] == [(2, "flat"), (2, "hierarchical")]
    for row in rows:
        assert row["real_s"] > 0 and row["sim_s"] > 0 and row["phases"]["gradients"][1] > 0


@pytest.fixture(scope="module")
def colocated_trace(tmp_path_factory):
    """A colocated run of 2 workers on loopback, one a node, at 10 MB/s with 10 ms of compute:
    the trace a lab run leaves, without the lab."""
    from test_runtime_loopback import run

    folder = tmp_path_factory.mktemp("colocated")
    code, errors, config = run(folder, servers="colocated", workers=2, iterations=6, compute_time=0.01,
                               policy="fixed", bits=4, latency=0.0)
    assert code == 0 and not errors, errors
    return config.trace


@needs_simgrid
def test_the_simgrid_column_is_the_runs_trace_replayed_on_the_labs_platform(colocated_trace, capsys):
    """The row's SimGrid seconds: ``mpigrad simulate TRACE --json`` on the lab's platform (2
    nodes of one worker, 10 MB/s, latency 0), over the iterations the clocks are timed on; with
    the trace's own local work and no latency SimGrid's CM02 and mpigrad's clock agree."""
    from pathlib import Path

    from mpigrad.bench.clock import _clocks, _format, _simgrid, simgrid_unavailable

    assert simgrid_unavailable() is None
    trace, warmup = Path(colocated_trace), 1
    row = {**_clocks(trace, warmup), **_simgrid(trace, 2, 1, "10MB/s", warmup)}
    assert row["simgrid_model"] == "cm02" and row["simgrid_replay"] == "exact"
    assert cli_main(["simulate", str(trace), "--json", "--peers", "none", "--sample", "6", "--nodes", "2",
                     "--bandwidth", "10MB/s", "--latency", "0"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["platform"]["nodes"] == 2 and replayed["platform"]["bandwidth"] == 10e6
    steady = sorted(replayed["iteration_seconds"][warmup + 1:])
    assert row["simgrid_s"] == pytest.approx((steady[1] + steady[2]) / 2)  # the median of the 4 timed
    assert row["simgrid_s"] == pytest.approx(row["sim_s"], rel=0.02)
    assert 0 < row["simgrid_over_real"] and row["simgrid_over_real"] == pytest.approx(row["sim_over_real"], rel=0.02)
    # a slower link: SimGrid's time grows, as it replays the trace's bytes at that rate
    slower = _simgrid(trace, 2, 1, "1MB/s", warmup)
    assert slower["simgrid_s"] > row["simgrid_s"] * 1.5
    line = _format(dict(workers=2, servers="colocated", codec="uniform4", broadcast="star", rate="10MB/s",
                        phases={}, **row))
    assert line.split()[-2:] == [f"{row['simgrid_s']:.3f}", f"{row['simgrid_over_real']:.2f}"]


def test_without_simgrid_the_column_says_so_in_one_line(colocated_trace, monkeypatch):
    from pathlib import Path

    from mpigrad.bench.clock import _format, _simgrid, simgrid_unavailable

    monkeypatch.setenv("MPIGRAD_SIMGRID", "/nonexistent/simgrid.so")
    reason = simgrid_unavailable()
    assert "SimGrid's Python module is not installed" in reason and "\n" not in reason
    row = _simgrid(Path(colocated_trace), 2, 1, "10MB/s", 1)  # the child says the same, in one line
    assert row["simgrid_s"] is None and "apt-get install python3-simgrid" in row["simgrid_note"]
    line = _format(dict(workers=2, servers="colocated", codec="uniform4", broadcast="star", rate="10MB/s",
                        real_s=1.0, sim_s=0.9, sim_over_real=0.9, local_s=0.1, real_comm_s=0.9, sim_comm_s=0.8,
                        comm_sim_over_real=0.89, **row))
    assert line.split()[-2:] == ["-", "-"]
