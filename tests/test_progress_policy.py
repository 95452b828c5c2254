"""The ``progress`` policy: its decision rule on synthetic measurements and gradients, its
solver against enumeration, its options and state, what it reads, and one real mpiexec run."""

from __future__ import annotations

import ast
import inspect
import json
import pickle

import numpy as np
import pytest
from conftest import SMALL_RUN, run_mpi

from mpigrad.codecs import get_codec
from mpigrad.policies import Observation, PolicyError, available, check_decision, get_policy, policy_options
from mpigrad.policies import progress
from mpigrad.policies.progress import choose_widths, objective
from mpigrad.trace import load

CODEC = get_codec({"id": "uniform", "bits": 8})
COPIES, OTHER_BYTES, COMPUTE_MS = 4, 5000, 50.0


def gradients(scales=(1.0,), n=20000, seed=0):
    rng = np.random.default_rng(seed)
    return tuple((scale * rng.standard_normal(n)).astype(np.float32) for scale in scales)


def drive(policy, rate, grads, iterations=30, start=0, bits=None):
    """Feed ``policy`` ``iterations`` iterations of a network of ``rate`` bytes per ms: each
    iteration puts COPIES x the layers' buffers at the bits in force, plus OTHER_BYTES, on it.
    Returns the bits decided at every iteration."""
    decided = []
    for m in range(start, start + iterations):
        if m == 0:
            obs = Observation(0, 2.3, 0.0, codec=CODEC)
        else:
            nbytes = OTHER_BYTES + COPIES * sum(CODEC.with_bits(b).max_encoded_size(g.size)
                                                for b, g in zip(bits, grads))
            ms = nbytes / rate
            obs = Observation(m, 2.3, COMPUTE_MS + ms, gradients=grads, codec=CODEC, last_comm_ms=ms,
                              last_bytes=nbytes)
        bits = check_decision(policy, policy.decide(obs), m)
        decided.append(tuple(bits))
    return decided


def test_registered_with_its_options_and_reads_gradients_and_the_clock():
    assert "progress" in available()
    assert policy_options("progress") == {"interval": 10, "min_bits": 2, "max_bits": 8, "sample_size": 65536,
                                          "smoothing": 0.3, "variance_weight": 1.0, "cost_model": "default",
                                          "exhaustive_limit": 4096}
    policy = get_policy({"id": "progress"}, n_layers=2, seed=3)
    assert policy.reads_clock and policy.uses_gradients and policy.bits_range() == (2, 8)
    config = {"id": "progress", "interval": 3, "min_bits": 3, "max_bits": 6, "sample_size": 0, "smoothing": 1.0,
              "variance_weight": 2.0, "cost_model": "none", "exhaustive_limit": 1}
    again = get_policy(json.loads(json.dumps(get_policy(config, n_layers=2).get_config())), n_layers=2)
    assert again.get_config() == config and again == get_policy(config, n_layers=2)


def test_the_widest_width_until_something_is_measured():
    policy = get_policy({"id": "progress"}, n_layers=2)
    assert policy.decide(Observation(0, 2.3, 0.0, codec=CODEC)) == (8, 8)
    # A gradient without a measurement (no bytes yet) decides nothing either.
    assert policy.decide(Observation(1, 2.3, 0.0, gradients=gradients((1, 1)), codec=CODEC)) == (8, 8)
    assert policy.drain_records() == []


def test_slow_network_low_widths_fast_network_high_widths():
    grads = gradients((1.0, 1.0))
    slow = drive(get_policy({"id": "progress", "interval": 5}, n_layers=2), rate=10.0, grads=grads)
    fast = drive(get_policy({"id": "progress", "interval": 5}, n_layers=2), rate=1e6, grads=grads)
    assert slow[0] == fast[0] == (8, 8)
    assert max(slow[-1]) <= 3, slow
    assert min(fast[-1]) >= 7, fast   # 8 bits' variance gain is below its encoding's cost
    middle = drive(get_policy({"id": "progress", "interval": 5}, n_layers=2), rate=1e4, grads=grads)
    assert max(slow[-1]) < min(middle[-1]) <= max(middle[-1]) < min(fast[-1]), middle


def test_a_layer_with_a_large_quantization_variance_gets_more_bits():
    """Layer 1's gradient is 10x layer 0's: its squared error, relative to the whole
    gradient's energy, is 100x larger, at the same bytes."""
    policy = get_policy({"id": "progress", "interval": 5}, n_layers=2)
    decided = drive(policy, rate=300.0, grads=gradients((1.0, 10.0)))
    low, high = decided[-1]
    assert high > low, decided
    rows = policy.drain_records()
    last = [r for r in rows if r["iteration"] == rows[-1]["iteration"]]
    assert (last[1]["variance"] > 50 * last[0]["variance"]).all()
    assert np.allclose(last[0]["time_ms"], last[1]["time_ms"])  # same sizes, same cost


def test_it_measures_the_copies_and_the_bandwidth_from_the_bytes():
    policy = get_policy({"id": "progress", "interval": 5, "cost_model": "none"}, n_layers=2)
    drive(policy, rate=300.0, grads=gradients((1.0, 1.0)), iterations=20)
    rows = policy.drain_records()
    first, later = rows[0], rows[-1]
    assert first["copies"] > COPIES                          # one width seen: bytes / Q, an upper bound
    assert later["copies"] == pytest.approx(COPIES, rel=1e-9)  # two widths seen: exact
    assert later["ms_per_byte"] == pytest.approx(1 / 300.0)
    sizes = np.array([CODEC.with_bits(b).max_encoded_size(20000) for b in range(2, 9)])
    assert later["time_ms"] == pytest.approx(COPIES * sizes / 300.0)
    assert later["t_fixed_ms"] == pytest.approx(COMPUTE_MS + OTHER_BYTES / 300.0)
    picks = [r["bits"] - 2 for r in rows[-2:]]
    J = objective(np.array([r["variance"] for r in rows[-2:]]), np.array([r["time_ms"] for r in rows[-2:]]),
                  later["t_fixed_ms"], picks)
    assert later["objective"] == pytest.approx(J)


def test_the_codec_cost_from_the_model_enters_the_time():
    with_model = get_policy({"id": "progress", "interval": 5}, n_layers=1)
    without = get_policy({"id": "progress", "interval": 5, "cost_model": "none"}, n_layers=1)
    grads = gradients((1.0,), n=200000)
    drive(with_model, 1e3, grads, iterations=2)
    drive(without, 1e3, grads, iterations=2)
    extra = with_model.drain_records()[0]["time_ms"] - without.drain_records()[0]["time_ms"]
    assert (extra > 0).all() and extra.max() < 10.0   # milliseconds of encoding 200000 elements


@pytest.mark.parametrize("seed", range(40))
def test_the_search_finds_what_enumeration_finds(seed):
    rng = np.random.default_rng(seed)
    layers, choices = rng.integers(1, 5), rng.integers(2, 8)
    variance = rng.exponential(size=(layers, choices)) * rng.choice([0.01, 1.0, 100.0])
    seconds = rng.exponential(size=(layers, choices))
    t_fixed = rng.exponential()
    exact = choose_widths(variance, seconds, t_fixed)
    brute = min(np.ndindex(*(choices,) * layers), key=lambda p: objective(variance, seconds, t_fixed, p))
    assert objective(variance, seconds, t_fixed, exact) == pytest.approx(objective(variance, seconds, t_fixed, brute))
    searched = choose_widths(variance, seconds, t_fixed, exhaustive_limit=1)
    # The Lagrangian points and coordinate descent: optimal on these instances, never better than exact.
    assert objective(variance, seconds, t_fixed, searched) == pytest.approx(objective(variance, seconds, t_fixed, exact))


def test_ties_go_to_the_wider_width_and_no_variance_means_the_fastest():
    assert choose_widths(np.zeros((2, 3)), np.ones((2, 3)), 1.0) == [2, 2]
    assert choose_widths(np.zeros((2, 3)), np.array([[3.0, 2, 1], [1, 2, 3]]), 1.0) == [2, 0]
    assert choose_widths(np.zeros((2, 3)), np.ones((2, 3)), 1.0, exhaustive_limit=1) == [2, 2]


def test_state_dict_round_trip_gives_the_same_decisions():
    grads = gradients((1.0, 3.0))
    whole = get_policy({"id": "progress", "interval": 4}, n_layers=2, seed=4)
    expected = drive(whole, 300.0, grads, iterations=40)
    first = get_policy({"id": "progress", "interval": 4}, n_layers=2, seed=4)
    head = drive(first, 300.0, grads, iterations=17)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = get_policy({"id": "progress", "interval": 4}, n_layers=2, seed=4)
    resumed.load_state_dict(state)
    tail = drive(resumed, 300.0, grads, iterations=23, start=17, bits=head[-1])
    assert head + tail == expected
    assert len(set(expected)) > 1   # it decided something worth resuming
    with pytest.raises(PolicyError, match="checkpoint was written with config"):
        get_policy({"id": "progress", "interval": 5}, n_layers=2).load_state_dict(state)
    with pytest.raises(PolicyError, match="do not fit"):
        get_policy({"id": "progress", "interval": 4}, n_layers=2).load_state_dict({**state, "bits": [9, 2]})


def test_out_of_order_iterations_are_refused():
    policy = get_policy({"id": "progress"}, n_layers=1)
    policy.decide(Observation(0, 2.3, 0.0, codec=CODEC))
    with pytest.raises(PolicyError, match="expected iteration 1, got 2"):
        policy.decide(Observation(2, 2.3, 1.0))


@pytest.mark.parametrize("options, fragment", [
    ({"min_bits": 6, "max_bits": 4}, "bits range is empty (min_bits=6 > max_bits=4)"),
    ({"interval": 0}, "interval must be an integer >= 1, got 0"),
    ({"smoothing": 0.0}, "smoothing must be a number > 0.0 and <= 1.0, got 0.0"),
    ({"smoothing": 1.5}, "smoothing must be a number > 0.0 and <= 1.0, got 1.5"),
    ({"variance_weight": -1}, "variance_weight must be a number >= 0.0, got -1"),
    ({"sample_size": 8}, "sample_size must be 0 (whole layers) or >= 16, got 8"),
    ({"cost_model": "/nonexistent/model.json"}, "/nonexistent/model.json"),
    ({"cost_model": 3}, "cost_model must be 'default', 'none' or a file, got 3"),
    ({"bandwidth": "10MB/s"}, "bandwidth"),
])
def test_bad_options_are_refused_in_one_line(options, fragment):
    with pytest.raises(PolicyError) as info:
        get_policy({"id": "progress", **options}, n_layers=2)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_it_reads_only_what_a_running_system_measures():
    """No option names the network, and the module imports nothing that knows the configured
    bandwidth or a schedule: only the policy API, the error measurement and the cost model."""
    assert not {"bandwidth", "schedule", "latency"} & set(policy_options("progress"))
    tree = ast.parse(inspect.getsource(progress))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "typing", "costmodel", "adaptive", "base"}
    source = inspect.getsource(progress.ProgressPolicy)
    for name in ("config", "clockmodel", "LinkModel", "runtime", "schedule"):
        assert f"{name}." not in source and f"import {name}" not in source


# ---- a real run -----------------------------------------------------------------------

ITERATIONS = 60
DROP_AT = 0.6   # seconds on the simulated clock
DROP = f"200MB/s@0s,2MB/s@{DROP_AT:g}s"


@pytest.mark.mpi
def test_under_mpiexec_it_trains_logs_its_decisions_and_follows_a_slow_network(tmp_path, mpi_env):
    """Fast first, then 100x slower: what the policy measures (ms per byte) follows the
    schedule it never reads, and the widths fall once the network is slow."""
    trace = tmp_path / "progress.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", str(ITERATIONS),
                         "--seed", "1", "--compute-time", "20ms", "--bandwidth", DROP, "--policy", "progress",
                         "--policy-opt", "interval=5"], mpi_env)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and tr.label == "Progress"
    rows = tr.policy
    n_layers = int(rows["layer"].max()) + 1
    assert n_layers >= 2 and len(rows) % n_layers == 0
    start = np.concatenate([[0.0], tr.steps["sim_time"].to_numpy()[:-1]])
    bits = tr.steps["bits"].to_numpy()
    assert bits[0] == 8
    fast = rows[start[rows["iteration"].to_numpy()] < DROP_AT]
    slow = rows[start[rows["iteration"].to_numpy()] > DROP_AT + 0.3]
    assert len(fast) and len(slow)
    assert slow["ms_per_byte"].min() > 10 * fast["ms_per_byte"].max()
    assert slow["bits"].mean() < fast["bits"].mean()
    variance = rows[[f"variance_{k}" for k in range(7)]].to_numpy()
    assert np.isfinite(variance).all() and (variance[:, 0] > 10 * variance[:, -1]).all()
    # (not monotone between neighbours: round-to-nearest at 4 bits can beat 5 on a layer)
    assert (rows["copies"] > 0).all()
