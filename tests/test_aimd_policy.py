"""The ``aimd`` policy: its rule on synthetic measurements, its options and state, and one
real mpiexec run whose simulated bandwidth drops and recovers."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import SMALL_RUN, assert_same_trace, mpiexec, run_mpi

from mpigrad.policies import Observation, PolicyError, available, check_decision, get_policy, policy_options
from mpigrad.policies.aimd import aimd_step, next_bytes
from mpigrad.runtime import EXIT_REQUEUE
from mpigrad.trace import load

BYTES_PER_BIT = 1000  # synthetic payload: bytes in proportion to the width


def drive(policy, rates, *, start=0, bits=None, jitter=0.0, seed=0, overhead=0):
    """Feed ``policy`` one iteration per entry of ``rates`` (bytes per ms of the network),
    each iteration's communication time being its payload at that rate, times a uniform
    jitter of +-``jitter``; return the bits decided at every iteration (one per layer)."""
    rng = np.random.default_rng(seed)
    decided = []
    for m, rate in enumerate(rates, start=start):
        if m == 0:
            obs = Observation(0, 2.3, 0.0)
        else:
            nbytes = BYTES_PER_BIT * bits + overhead
            ms = nbytes / rate * (1.0 + jitter * rng.uniform(-1.0, 1.0))
            obs = Observation(m, 2.3, 50.0 + ms, last_comm_ms=ms, last_bytes=nbytes)
        decision = check_decision(policy, policy.decide(obs), m)
        assert len(set(decision)) == 1  # one width for every layer
        bits = decision[0]
        decided.append(bits)
    return decided


def changes(bits):
    return [m for m in range(1, len(bits)) if bits[m] != bits[m - 1]]


def test_registered_with_its_options_and_reads_the_clock():
    assert "aimd" in available()
    assert policy_options("aimd") == {"window": 10, "band": 0.25, "decrease": 0.5, "increase": 1,
                                      "min_bits": 2, "max_bits": 8}
    policy = get_policy({"id": "aimd"}, n_layers=2, seed=3)
    assert policy.reads_clock and not policy.uses_gradients
    assert policy.bits_range() == (2, 8)
    config = {"id": "aimd", "window": 4, "band": 0.1, "decrease": 0.75, "increase": 2, "min_bits": 3, "max_bits": 7}
    again = get_policy(json.loads(json.dumps(get_policy(config, n_layers=2).get_config())), n_layers=2)
    assert again.get_config() == config and again == get_policy(config, n_layers=2)


def test_time_grows_bits_drop_then_time_falls_bits_rise():
    """100 -> 10 -> 100 bytes/ms: halving to the floor while communication is over budget,
    then one bit per window back to max_bits; every change at least a window apart."""
    policy = get_policy({"id": "aimd", "window": 5}, n_layers=2)
    rates = [100.0] * 30 + [10.0] * 40 + [100.0] * 60
    bits = drive(policy, rates)
    assert bits[:30] == [8] * 30
    drop = bits[29:70]
    assert drop[-1] == 2 and all(np.diff(drop) <= 0)
    assert sorted(set(drop)) == [2, 4, 8]                                # multiplicative: 8 -> 4 -> 2
    rise = bits[70:]
    assert rise[-1] == 8 and all(np.diff(rise) >= 0)
    assert sorted(set(rise)) == [2, 3, 4, 5, 6, 7, 8]                    # additive: one bit at a time
    assert min(np.diff(changes(bits))) >= 5                              # a fresh window after each
    rows = policy.drain_records()
    assert [(r["previous_bits"], r["bits"]) for r in rows] == [(8, 4), (4, 2), (2, 3), (3, 4), (4, 5), (5, 6),
                                                               (6, 7), (7, 8)]
    assert [r["iteration"] for r in rows] == changes(bits)
    assert all(r["budget_ms"] == pytest.approx(8 * BYTES_PER_BIT / 100.0) for r in rows)
    assert rows[1]["bandwidth"] == pytest.approx(10.0 / 1e3)              # MB/s from bytes per ms
    columns = policy.record_columns()
    assert all(set(r) == set(columns) for r in rows)


def test_the_width_settles_where_the_budget_holds():
    """Half the bandwidth: 8 bits cost twice the budget, 4 bits fit it, 5 would not."""
    policy = get_policy({"id": "aimd", "window": 5}, n_layers=1)
    bits = drive(policy, [100.0] * 20 + [50.0] * 200)
    assert bits[-1] == 4 and changes(bits) and max(changes(bits)) < 40


@pytest.mark.parametrize("rate, expected", [(100.0, 8), (50.0, 4)])
def test_noise_within_the_band_changes_nothing(rate, expected):
    """+-10 % jitter on every iteration's time: at full width on the best network, and at
    the width that fits half of it, the bits hold for 1000 iterations."""
    policy = get_policy({"id": "aimd"}, n_layers=1)
    bits = drive(policy, [100.0] * 30 + [rate] * 1000, jitter=0.1, seed=1)
    settled = bits[200:]
    assert settled == [expected] * len(settled)


def test_the_bounds_hold_however_far_the_network_moves():
    policy = get_policy({"id": "aimd", "window": 3, "min_bits": 3, "max_bits": 6}, n_layers=3)
    bits = drive(policy, [1000.0] * 10 + [0.01] * 30 + [1e6] * 60, overhead=500)
    assert min(bits) == 3 and max(bits) == 6 and bits[-1] == 6
    assert policy.bits_range() == (3, 6)


def test_step_rule_and_the_predicted_bytes():
    kw = dict(band=0.25, decrease=0.5, increase=1, min_bits=2, max_bits=8)
    assert aimd_step(8, 1.26, 1.26, **kw) == 4 and aimd_step(8, 1.25, 1.25, **kw) == 8   # over the band only
    assert aimd_step(3, 9.0, 12.0, **kw) == 2 and aimd_step(2, 9.0, 13.5, **kw) == 2    # floor at min_bits
    assert aimd_step(4, 0.9, 1.125, **kw) == 5 and aimd_step(4, 0.9, 1.13, **kw) == 4   # half the band up
    assert aimd_step(8, 0.1, 0.1, **kw) == 8                                             # ceiling
    assert aimd_step(7, 0.5, 0.6, **{**kw, "increase": 3}) == 8
    assert aimd_step(5, 1.3, 1.5, **{**kw, "decrease": 0.9}) == 4                        # one bit at least
    assert next_bytes(4, 4500.0, 8500.0, 1, 8) == 5500.0      # float32 layers and headers: not in proportion
    assert next_bytes(7, 7500.0, 8500.0, 3, 8) == 8500.0 and next_bytes(8, 8500.0, 8500.0, 1, 8) == 8500.0


def test_no_measurement_no_change():
    """Iteration 0 and observations without bytes (a network-free loopback) keep max_bits."""
    policy = get_policy({"id": "aimd", "window": 2}, n_layers=1)
    assert [policy.decide(Observation(m, 1.0, 5.0))[0] for m in range(20)] == [8] * 20
    policy = get_policy({"id": "aimd", "window": 2}, n_layers=1)
    bits = [policy.decide(Observation(m, 1.0, 5.0, last_comm_ms=0.0, last_bytes=100 if m else 0))[0]
            for m in range(20)]
    assert bits == [8] * 20


def test_state_dict_round_trip_gives_the_same_decisions():
    rates = [100.0] * 30 + [10.0] * 37 + [100.0] * 50
    whole = get_policy({"id": "aimd", "window": 5}, n_layers=2, seed=4)
    expected = drive(whole, rates, jitter=0.05, seed=2)
    first = get_policy({"id": "aimd", "window": 5}, n_layers=2, seed=4)
    head = drive(first, rates[:43], jitter=0.05, seed=2)
    first.drain_records()
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = get_policy({"id": "aimd", "window": 5}, n_layers=2, seed=4)
    resumed.load_state_dict(state)
    rng_state = np.random.default_rng(2)
    rng_state.uniform(-1.0, 1.0, size=42)  # the jitter draws the head used (iterations 1..42)
    tail = []
    bits = head[-1]
    for m in range(43, len(rates)):
        nbytes = BYTES_PER_BIT * bits
        ms = nbytes / rates[m] * (1.0 + 0.05 * rng_state.uniform(-1.0, 1.0))
        bits = resumed.decide(Observation(m, 2.3, ms, last_comm_ms=ms, last_bytes=nbytes))[0]
        tail.append(bits)
    assert head + tail == expected
    assert resumed.state_dict()["best_cost"] == whole.state_dict()["best_cost"]
    with pytest.raises(PolicyError, match="checkpoint was written with config"):
        get_policy({"id": "aimd", "window": 6}, n_layers=2).load_state_dict(state)
    with pytest.raises(PolicyError, match="does not fit"):
        get_policy({"id": "aimd", "window": 5}, n_layers=2).load_state_dict({**state, "bits": 9})


def test_decide_in_order_only():
    policy = get_policy({"id": "aimd"}, n_layers=1)
    policy.decide(Observation(0, 1.0, 0.0))
    with pytest.raises(PolicyError, match="expected iteration 1, got 3"):
        policy.decide(Observation(3, 1.0, 0.0))


@pytest.mark.parametrize("options, fragment", [
    ({"window": 0}, "window must be an integer >= 1, got 0"),
    ({"window": 2.5}, "window must be an integer"),
    ({"band": 0}, "band must be a number > 0.0, got 0"),
    ({"band": "wide"}, "band must be a number"),
    ({"decrease": 1.0}, "decrease must be a number > 0.0 and < 1.0, got 1.0"),
    ({"decrease": 0}, "decrease must be a number > 0.0 and < 1.0, got 0"),
    ({"decrease": float("nan")}, "decrease must be a number > 0.0 and < 1.0, got nan"),
    ({"decrease": True}, "decrease must be a number"),
    ({"decrease": "half"}, "decrease must be a number"),
    ({"increase": 0}, "increase must be an integer in [1, 6], got 0"),
    ({"increase": 7}, "increase must be an integer in [1, 6], got 7"),
    ({"min_bits": 4, "max_bits": 4}, "min_bits = max_bits = 4 leaves nothing to adapt; use --policy fixed"),
    ({"min_bits": 6, "max_bits": 4}, "bits range is empty (min_bits=6 > max_bits=4)"),
    ({"max_bits": 33}, "max_bits must be an integer in [1, 32], got 33"),
    ({"windw": 3}, "unknown option(s) windw; valid: window, band, decrease, increase, min_bits, max_bits"),
])
def test_bad_options_are_one_line(options, fragment):
    with pytest.raises(PolicyError) as info:
        get_policy({"id": "aimd", **options}, n_layers=2)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("policy 'aimd'")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"last_comm_ms": -1.0}, "last_comm_ms must be finite and >= 0, got -1.0"),
    ({"last_comm_ms": float("nan")}, "last_comm_ms must be finite"),
    ({"last_bytes": -1}, "last_bytes must be an integer >= 0, got -1"),
    ({"last_bytes": 10.0}, "last_bytes must be an integer"),
])
def test_observation_checks_the_measurements(kwargs, fragment):
    with pytest.raises(PolicyError, match="observation") as info:
        Observation(1, 1.0, 1.0, **kwargs)
    assert fragment in str(info.value)


def test_cli_lists_it_and_refuses_a_bad_option_in_one_line(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "aimd" in help_text
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--policy", "aimd", "--policy-opt",
                             "decrease=1", "--trace", str(tmp_path / "x.h5")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("mpigrad train: error: policy 'aimd': decrease must be a number > 0.0 "
                                     "and < 1.0, got 1")
    assert not (tmp_path / "x.h5").exists()


# ---- a real run -----------------------------------------------------------------------

def train_args(trace):
    return ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", str(ITERATIONS), "--seed", "1",
            "--compute-time", "10ms", "--bandwidth", DROP, "--policy", "aimd", "--policy-opt", "window=4"]


@pytest.fixture(scope="module")
def drop_run(tmp_path_factory, mpi_env):
    trace = tmp_path_factory.mktemp("aimd") / "aimd.h5"
    result = run_mpi(3, train_args(trace), mpi_env)
    assert result.returncode == 0, result.stderr
    return trace


@pytest.mark.mpi
def test_under_mpiexec_the_bits_follow_a_bandwidth_drop_and_its_recovery(drop_run, tmp_path, capsys):
    """The simulated bandwidth falls 20x for a stretch and comes back: the policy, seeing
    only its measured communication, cuts the width during the drop and restores it after;
    ``trace retime`` refuses the run (its bits depend on the network)."""
    trace = drop_run
    tr = load(trace)
    assert tr.complete and tr.label == "AIMD"
    bits = tr.steps["bits"].to_numpy()
    end = tr.steps["sim_time"].to_numpy()
    start = np.concatenate([[0.0], end[:-1]])
    with capsys.disabled():
        print(f"\nbits by iteration: {''.join(map(str, bits))}\n"
              f"iteration start (s): {np.round(start[::10], 2).tolist()}")
    during = bits[(start >= DROP_AT + SETTLE) & (start < RECOVER_AT)]
    assert (bits[start < DROP_AT] == 8).all()
    assert len(during) >= 5 and during.max() <= 4, bits
    after = bits[-10:]
    assert after.min() > during.max() and after[-1] >= 7, bits
    rows = tr.policy
    assert (rows["bits"] < rows["previous_bits"]).any() and (rows["bits"] > rows["previous_bits"]).any()
    assert rows["bandwidth"].min() < 10.0 and rows["bandwidth"].max() > 50.0   # MB/s, as measured

    out = tmp_path / "retimed.h5"
    retime = subprocess.run([sys.executable, "-m", "mpigrad", "trace", "retime", str(trace), "--bandwidth",
                             "100MB/s", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert retime.returncode == 2 and "policy 'aimd' reads the clock" in retime.stderr
    assert retime.stderr.count("\n") == 1 and not out.exists()


ITERATIONS = 140
DROP_AT, RECOVER_AT, SETTLE = 1.0, 3.0, 0.5  # seconds on the simulated clock
DROP = f"100MB/s@0s,5MB/s@{DROP_AT:g}s,100MB/s@{RECOVER_AT:g}s"


@pytest.mark.mpi
def test_a_run_stopped_in_the_drop_resumes_to_the_same_trace(drop_run, tmp_path, mpi_env):
    """The policy's window and the server's last measurements are in the checkpoint: a run
    stopped by SIGUSR1 and resumed decides every width as the straight run did."""
    stopped = tmp_path / "stopped.h5"
    process = subprocess.Popen(mpiexec(3, [sys.executable, "-m", "mpi4py", "-m", "mpigrad",
                                           *train_args(stopped)]),
                               env=mpi_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        for line in process.stdout:
            if f"iter  60/{ITERATIONS}" in line:
                os.killpg(process.pid, signal.SIGUSR1)
                break
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == EXIT_REQUEUE, err
    assert 60 <= len(load(stopped).steps) < ITERATIONS
    resumed = run_mpi(3, [*train_args(stopped), "--resume"], mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_trace(load(drop_run), load(stopped))
