"""The network a run really had, in its trace (mpigrad/trace/network.py): what ``mpigrad lab``
hands its ranks, what ``trace info``, ``summary`` and ``compare`` label and group by, and
the one-line refusal of a resume on another network (``--force`` resumes and records it).
The lab itself builds these runs in tests/test_lab.py; here its variable is set by hand."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from conftest import SMALL_RUN, run_mpi
from test_trace_labels import cli
from mpigrad.errors import UsageError
from mpigrad.trace import TraceWriter, default_tables, load
from mpigrad.trace import network

LAB50 = {"kind": "lab", "nodes": 3, "rate": "50MB/s"}
LAB10 = {"kind": "lab", "nodes": 3, "rate": "10MB/s", "events": ["12s:node2:down"]}


def write(path: Path, attrs: dict, *, resumed_on: dict | None = None, slope: float = 0.1,
          net_mode: str = "off") -> Path:
    """A complete 20-iteration Fix 2 run, net_mode off, with root attributes ``attrs``;
    ``resumed_on``: stopped after 16 iterations and resumed on that network."""
    config = {"policy": "fixed", "bits": 2, "codec": "uniform", "seed": 0, "net_mode": net_mode, "bandwidth": 1e7}
    writer = TraceWriter(path, config=config, attrs={"seed": 0, **attrs}, tables=default_tables(2), flush_every=50)
    for i in range(20):
        if resumed_on is not None and i == 16:
            writer.close("stopped")
            writer = TraceWriter.open_append(path, tables=default_tables(2), truncate_at=16,
                                             resume={"network": resumed_on})
        writer.append("steps", {"iteration": i, "wall_time": i + 1.0, "sim_time": i + 1.0, "loss": 1.9 - slope * i,
                                "bits": 2, "bytes_up": 1000, "bytes_down": 1000, "t_compute": 0.0, "t_encode": 0.0,
                                "t_decode": 0.0, "t_comm": 1.0, "t_policy": 0.0})
    writer.close("complete")
    return path


def test_a_lab_run_timed_by_the_network_model_is_labelled_so(tmp_path, capsys):
    """In a lab at 50 MB/s a run on the simulated clock (net_mode virtual, a 10 MB/s model) is
    timed by the model, not by the links: its label says so, and it is not grouped with the
    lab run timed by the wire."""
    runs = [write(tmp_path / "wire.h5", {"network": LAB50}),
            write(tmp_path / "model.h5", {"network": LAB50}, net_mode="virtual")]
    code, out, _ = cli(capsys, "summary", *runs, "--format", "csv")
    assert code == 0
    methods = pd.read_csv(io.StringIO(out))["method"].tolist()
    assert "network=lab 50MB/s, timed by the model" in methods[1] and "timed by" not in methods[0], methods


def test_summary_and_compare_label_and_group_lab_runs_by_their_network(tmp_path, capsys):
    """Two lab runs at 50 and 10 MB/s and one on the host (net_mode off all three) were one
    group labelled alike; an old trace without the attribute reads as the host's."""
    runs = [write(tmp_path / "lab50.h5", {"network": LAB50}), write(tmp_path / "lab10.h5", {"network": LAB10}),
            write(tmp_path / "host.h5", {"network": network.HOST}), write(tmp_path / "old.h5", {})]
    code, out, _ = cli(capsys, "summary", *runs, "--format", "csv")
    assert code == 0
    assert pd.read_csv(io.StringIO(out))["method"].tolist() == [
        "Fix (2-bit) network=lab 50MB/s", "Fix (2-bit) network=lab 10MB/s, events 12s:node2:down",
        "Fix (2-bit) network=host (host)", "Fix (2-bit) network=host (old)"]
    code, out, _ = cli(capsys, "compare", *runs, "--target-loss", "1.0", "--format", "csv")
    table = pd.read_csv(io.StringIO(out))
    assert table["method"].tolist() == ["Fix (2-bit) network=lab 50MB/s",
                                        "Fix (2-bit) network=lab 10MB/s, events 12s:node2:down",
                                        "Fix (2-bit) network=host"]
    assert table["runs"].tolist() == ["1/1", "1/1", "2/2"]
    code, out, _ = cli(capsys, "info", runs[0])
    assert re.search(r"^network +lab 50MB/s \(3 nodes of mpigrad lab\)$", out, re.M), out
    code, out, _ = cli(capsys, "info", runs[3])
    assert "host (not recorded: this trace was written before mpigrad recorded it)" in out


def test_a_run_resumed_on_another_network_is_its_own_group(tmp_path, capsys):
    lab = write(tmp_path / "lab.h5", {"network": LAB10})
    mixed = write(tmp_path / "mixed.h5", {"network": LAB10}, resumed_on=network.HOST)
    assert load(mixed).network == "lab 10MB/s, events 12s:node2:down until iteration 16, then host"
    code, out, _ = cli(capsys, "compare", lab, mixed, "--target-loss", "1.0", "--format", "csv")
    assert pd.read_csv(io.StringIO(out))["runs"].tolist() == ["1/1", "1/1"]


def test_the_lab_variable_is_read_and_a_garbled_one_refused():
    assert network.current({}) == network.HOST
    assert network.current({network.VARIABLE: json.dumps(LAB50)}) == LAB50
    with pytest.raises(UsageError, match="is not a network mpigrad lab wrote"):
        network.current({network.VARIABLE: "fast"})


def test_lab_network_records_rates_latency_and_events_as_written():
    assert network.lab_network(3, {0: 1e7, 1: 1e7, 2: 1e6}, 0.001, ["12s:node2:down"], 0) == {
        "kind": "lab", "nodes": 3, "rate": "10MB/s", "node_rates": {"2": "1MB/s"}, "latency": "1ms",
        "events": ["12s:node2:down"]}
    assert network.describe(network.lab_network(2, {0: "10MB/s@0s,1MB/s@5s", 1: "10MB/s@0s,1MB/s@5s"}, 0, [], 0)) \
        == "lab 10MB/s@0s,1MB/s@5s"


def test_a_lab_run_timed_by_a_model_of_another_rate_is_warned_about_in_one_line():
    from mpigrad.config import RunConfig
    from mpigrad.runtime.run.startup import lab_clock_warning

    lab20 = network.lab_network(3, dict.fromkeys(range(3), 20e6), 0.0, [], 0)
    warning = lab_clock_warning(RunConfig(bandwidth=10e6), lab20)
    assert warning == ("mpigrad: warning: timed by the network model (10MB/s per link), not by the lab's links "
                       "(lab 20MB/s): pass --net-mode off to be timed by the wire, or the links' rate as --bandwidth "
                       "to model them")
    assert lab_clock_warning(RunConfig(bandwidth=20e6), lab20) is None          # a model of the links' rate
    assert lab_clock_warning(RunConfig(bandwidth=10e6, net_mode="off"), lab20) is None   # timed by the wire
    assert lab_clock_warning(RunConfig(bandwidth=10e6), dict(network.HOST)) is None
    assert lab_clock_warning(RunConfig(bandwidth=20e6), network.lab_network(3, {0: 20e6, 1: 20e6, 2: 1e6}, 0.0, [], 0))


@pytest.mark.mpi
@pytest.mark.slow
def test_a_resume_on_another_network_is_refused_unless_forced_and_then_recorded(tmp_path, mpi_env):
    """A run stopped in a lab (its variable) and resumed on the host: one line, exit 2, the
    trace untouched; with --force it resumes, prints the start-up lines and a warning, and
    the trace says where each part ran."""
    trace = tmp_path / "run.h5"
    run = ["train", "--trace", str(trace), *SMALL_RUN, "--net-mode", "off", "--progress-every", "0"]
    in_lab = dict(mpi_env, **{network.VARIABLE: json.dumps(LAB10)})
    stopped = run_mpi(3, [*run, "--iterations", "100000", "--walltime", "6s"], in_lab)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert "links: lab 10MB/s, events 12s:node2:down (mpigrad lab)" in stopped.stdout
    assert "warning: timed by" not in stopped.stdout  # timed by the wire (net_mode off)
    at = len(load(trace).steps)
    before = trace.read_bytes()

    refused = run_mpi(3, [*run, "--iterations", str(at + 3), "--resume"], mpi_env)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"mpigrad train: error: --resume: trace {trace} ran on lab 10MB/s, events 12s:node2:down, this run is on "
        "host: resume it where it ran, or pass --force to resume here (the trace records the change)"]
    assert trace.read_bytes() == before

    forced = run_mpi(3, [*run, "--iterations", str(at + 3), "--resume", "--force"], mpi_env)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    for line in ("mpigrad: resuming from", "network: not modelled", "config: ",
                 "mpigrad: warning: resuming on host a trace that ran on lab 10MB/s, events 12s:node2:down (--force)"):
        assert line in forced.stdout, forced.stdout
    resumed = load(trace)
    assert resumed.status == "complete" and len(resumed.steps) == at + 3
    assert resumed.network == f"lab 10MB/s, events 12s:node2:down until iteration {at}, then host"
    assert resumed.attrs["resumes"][-1]["network"] == network.HOST
