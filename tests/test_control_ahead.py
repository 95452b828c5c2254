"""``control = "ahead"``: rank 0 sends an iteration's Control before the workers' losses
where the policy knows its bits in advance, so no worker waits for the round trip; the
run is the paper's protocol's (losses, bits, bytes, parameters) and the clock charges
neither the losses nor the Control on those iterations (the in-process loopback channel
here, a real mpiexec run at the end)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpigrad.clockmodel import IterationTraffic, LinkModel, PipelinedTraffic
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.policies import Observation, get_policy
from mpigrad.trace import load
from test_runtime_loopback import run

SAME = ("loss", "bits", "bytes_up", "bytes_down")


def _observation(m: int, loss: float = 2.0) -> Observation:
    return Observation(iteration=m, loss=loss, last_iteration_ms=50.0 + m)


def test_policies_that_know_their_bits_ahead_say_what_decide_then_returns():
    """fixed and schedule always; MQGrad between its steps (every T-th iteration it steps
    on the losses); the others never. Asking changes nothing."""
    fixed = get_policy({"id": "fixed", "bits": 3}, n_layers=2)
    schedule = get_policy({"id": "schedule", "schedule": "0:2,4:8"}, n_layers=2)
    for m in range(8):
        assert fixed.bits_ahead(m) == fixed.decide(_observation(m)) == (3, 3)
        assert schedule.bits_ahead(m) == schedule.decide(_observation(m)) == ((2, 2) if m < 4 else (8, 8))
    mqgrad = get_policy({"id": "mqgrad", "T": 3, "epsilon": 0.5}, n_layers=1, seed=7)
    twin = get_policy({"id": "mqgrad", "T": 3, "epsilon": 0.5}, n_layers=1, seed=7)  # never asked
    rng = np.random.default_rng(0)
    ahead = []
    for m in range(30):
        loss = 2.0 * math.exp(-m / 20) + rng.uniform(0, 0.1)
        said = mqgrad.bits_ahead(m)
        decided = mqgrad.decide(_observation(m, loss))
        assert decided == twin.decide(_observation(m, loss))
        if said is not None:
            assert said == decided
        ahead.append(said is not None)
    assert ahead == [m % 3 != 0 for m in range(30)]
    assert mqgrad.bits_ahead(31) is None  # not the next iteration: unknown
    assert get_policy({"id": "adaptive"}, n_layers=1).bits_ahead(0) is None


def test_the_clock_charges_neither_losses_nor_control_when_the_control_went_ahead():
    link = LinkModel(bandwidth=1e6, latency=1e-3)
    frames_in, frames_out = ((1000, 1000),), (2008,)
    paper = IterationTraffic(40, 64, frames_in, frames_out)
    ahead = IterationTraffic(40, 64, frames_in, frames_out, ahead=True)
    assert (ahead.bytes_up, ahead.bytes_down) == (paper.bytes_up, paper.bytes_down)  # the bytes still cross
    exchange = link.gradients(frames_in, False) + link.broadcasts(2, frames_out, False)
    # sent at the iteration's start, 50 ms of compute before the exchange: there long before
    assert link.comm_seconds(ahead, start=0.05, sent=0.0) == pytest.approx(exchange)
    assert link.comm_seconds(paper) == pytest.approx(exchange + link.losses(2, 40) + link.control(2, 1, 64))
    again = IterationTraffic.from_totals(ahead.bytes_up, ahead.bytes_down, frames_in, frames_out, ahead=True)
    assert again == ahead
    # pipelined: the frames need not wait for the Control
    piped = dict(loss_bytes=40, control_bytes=64, ready=((0.0,), (0.0,)),
                 frames=(((0, 500),), ((500, 0),)), bcast=((504,), (504,)))
    slow = LinkModel(bandwidth=1e6, latency=5e-3)
    ahead_span = slow.pipelined(PipelinedTraffic(**piped, ahead=True), start=0.05, sent=0.0)
    assert ahead_span < slow.pipelined(PipelinedTraffic(**piped), start=0.05) - 5e-3


@pytest.mark.parametrize("options", [
    dict(servers=2, workers=2, policy="fixed", bits=2),
    dict(servers="colocated", workers=3, policy="schedule", policy_opts={"schedule": "0:2,3:4"}),
    dict(servers="colocated", workers=2, policy="fixed", codec="fp32", pipeline=True),
    dict(servers=1, workers=2, policy="fixed", codec="powersgd", codec_opts={"rank": 2, "start": 2}),
], ids=["two-servers-fixed", "colocated-schedule", "pipelined-fp32", "powersgd"])
def test_ahead_gives_the_papers_run_and_records_which_controls_went_ahead(tmp_path, options):
    servers, workers = options.pop("servers"), options.pop("workers")
    code1, errors1, paper = run(tmp_path, servers=servers, workers=workers, name="paper.h5", control="paper",
                                **options)
    code2, errors2, ahead = run(tmp_path, servers=servers, workers=workers, name="ahead.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(paper.trace), load(ahead.trace)
    for column in SAME:
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    assert "control_ahead" not in a.steps and (b.steps["control_ahead"] == 1).all()
    assert a.config["control"] == "paper" and b.config["control"] == "ahead"
    if not options.get("pipeline"):  # ahead: no loss gather or Control on the simulated clock
        assert (np.diff(b.steps["sim_time"]) < np.diff(a.steps["sim_time"])).all()


def test_mqgrad_sends_ahead_between_its_steps_only(tmp_path):
    code, errors, config = run(tmp_path, servers=1, workers=2, policy="mqgrad", policy_opts={"T": 3}, iterations=9)
    assert code == 0 and not errors, errors
    steps = load(config.trace).steps
    assert steps["control_ahead"].tolist() == [int(m % 3 != 0) for m in range(9)]


def test_a_non_finite_loss_still_stops_the_run_with_its_own_message(tmp_path, monkeypatch):
    """Rank 0 learns of the loss after the Control went: the run fails as under the paper's
    protocol, naming the worker and iteration."""
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", "nan-loss:2:3")
    code, errors, config = run(tmp_path, servers="colocated", workers=2, timeout=5.0, policy="fixed")
    assert code != 0
    messages = " | ".join(str(e) for e in errors.values())
    assert "worker rank 2 computed a non-finite loss" in messages and "iteration 3" in messages, messages
    assert load(config.trace).status == "failed"


def test_a_bad_control_choice_is_one_line():
    with pytest.raises(UsageError, match="control must be one of ahead, paper"):
        RunConfig(control="early", lr=0.01).validate()


@pytest.mark.mpi
@pytest.mark.parametrize("servers", ["colocated", "1"])
def test_ahead_under_mpiexec_is_the_papers_run_less_the_round_trip_on_its_clock(tmp_path, mpi_env, servers):
    """The same run; each iteration's t_comm is the paper's less exactly what the clock
    charges the loss gather and the Control (constant rate, 1 ms latency), and ``trace
    retime`` of the ahead trace to its own network gives its own clock back."""
    from conftest import SMALL_RUN, run_mpi

    from mpigrad.cli import main

    traces = {}
    for control in ("paper", "ahead"):
        traces[control] = tmp_path / f"{control}.h5"
        done = run_mpi(3, ["train", *SMALL_RUN, "--iterations", "12", "--policy", "fixed", "--bits", "2",
                           "--servers", servers, "--control", control, "--seed", "3", "--net-mode", "virtual",
                           "--compute-time", "20ms", "--cost-model", "none", "--latency", "1ms",
                           "--bandwidth", "10MB/s", "--trace", str(traces[control])], mpi_env)
        assert done.returncode == 0, done.stderr
    a, b = load(traces["paper"]), load(traces["ahead"])
    for column in SAME:
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    assert (b.steps["control_ahead"] == 1).all() and "control_ahead" not in a.steps
    link = LinkModel(bandwidth=10e6, latency=1e-3)
    colocated = servers == "colocated"
    steps, frames = b.steps, b.servers
    for row in range(len(steps)):  # the loss and Control sizes, solved from the recorded totals
        frames_in = frames[[c for c in frames if c.startswith("frame_bytes_")]].to_numpy()[row].reshape(-1, 2)
        traffic = IterationTraffic.from_totals(steps["bytes_up"][row], steps["bytes_down"][row], frames_in,
                                               frames[[c for c in frames if c.startswith("bytes_out_")]].to_numpy()[row],
                                               colocated)
        round_trip = link.losses(2, traffic.loss_bytes, servers=traffic.servers, colocated=colocated) + \
            link.control(2, traffic.servers, traffic.control_bytes, colocated)
        assert a.steps["t_comm"][row] - steps["t_comm"][row] == pytest.approx(round_trip, rel=1e-9)
    out = tmp_path / "retimed.h5"
    assert main(["trace", "retime", str(traces["ahead"]), "--bandwidth", "10MB/s", "--latency", "1ms",
                 "-o", str(out)]) == 0
    np.testing.assert_allclose(load(out).steps["sim_time"], b.steps["sim_time"], rtol=1e-12)


def test_a_control_slower_than_the_compute_holds_the_exchange_for_the_rest_of_its_way():
    """Sent at the iteration's start, the Control is charged only for what of its way
    outlasts the compute: nothing after 20 ms of compute, 5 ms after 1 ms of it."""
    link = LinkModel(bandwidth=1e9, latency=3e-3)   # a star broadcast to 2 workers: 6 ms
    frames_in, frames_out = ((1000, 1000),), (2008,)
    ahead = IterationTraffic(40, 64, frames_in, frames_out, ahead=True)
    exchange = link.gradients(frames_in, False) + link.broadcasts(2, frames_out, False)
    transit = link.control(2, 1, 64)
    assert link.comm_seconds(ahead, start=0.020, sent=0.0) == pytest.approx(exchange)
    assert link.comm_seconds(ahead, start=0.001, sent=0.0) == pytest.approx(transit - 0.001 + exchange)
    assert link.control_ahead(2, 1, 64, False, 0.0, 0.001) == pytest.approx(transit - 0.001)


def test_a_checkpoint_from_before_control_is_resumed_by_a_paper_run():
    from mpigrad.runtime.measure import checkpoint

    config = RunConfig(control="paper").to_dict()
    before = {k: v for k, v in config.items() if k != "control"}   # written before the option
    assert checkpoint.identity(config, 3) == checkpoint.identity(before, 3)
    assert checkpoint.identity({**config, "control": "ahead"}, 3) != checkpoint.identity(before, 3)
