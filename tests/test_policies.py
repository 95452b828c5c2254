"""Policy registry, option checks, fixed, schedule and adaptive (no MPI)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from mpigrad.codecs import get_codec
from mpigrad.config import parse_assignments
from mpigrad.policies import Observation, PolicyError, available, get_policy, policy_options
from mpigrad.policies.adaptive import quantization_error, strided_sample

NON_DEFAULT_CONFIGS = [
    {"id": "fixed", "bits": 8},
    {"id": "schedule", "schedule": "0:3,10:5,20:7", "min_bits": 3, "max_bits": 7},
    {"id": "adaptive", "threshold": 0.05, "error": "mse", "interval": 3, "sample_size": 128,
     "min_bits": 3, "max_bits": 6, "initial_bits": 4, "per_layer": True},
    {"id": "mqgrad", "T": 4, "alpha": 0.05, "gamma": 100.0, "discount": 0.8, "epsilon": 0.2,
     "eta": 0.05, "hidden": 6, "min_bits": 3, "max_bits": 7, "initial_bits": 4,
     "transition": "taken", "input_norm": "none", "output_init": "uniform", "per_layer": True},
]


def uniform_codec(bits: int = 8):
    return get_codec({"id": "uniform", "bits": bits})


def minmax_relative_error(x: np.ndarray, bits: int) -> float:
    """NumPy reference of the uniform codec's nearest rounding: q = round((x-lo)*R/(hi-lo))."""
    x64 = x.astype(np.float64)
    lo, hi = x64.min(), x64.max()
    levels = 2**bits - 1
    y = lo + np.round((x64 - lo) * levels / (hi - lo)) * (hi - lo) / levels
    return float(np.sum((y - x64) ** 2) / np.sum(x64**2))


def assert_records_match_columns(policy, records):
    columns = policy.record_columns()
    assert "layer" in columns
    for row in records:
        assert set(row) == set(columns)
        for name, (dtype, shape) in columns.items():
            value = np.asarray(row[name])
            assert value.shape == shape, name
            assert np.can_cast(value.dtype, np.dtype(dtype), "same_kind") or value.dtype.kind == "b", name


# ---- registry and options ------------------------------------------------------------

def test_registry_lists_the_four_policies():
    assert {"fixed", "schedule", "adaptive", "mqgrad"} <= set(available())


@pytest.mark.parametrize("config", NON_DEFAULT_CONFIGS, ids=lambda c: c["id"])
def test_config_round_trips_through_json(config):
    policy = get_policy(config, n_layers=2, seed=5)
    assert policy.get_config() == config
    again = get_policy(json.loads(json.dumps(policy.get_config())), n_layers=2, seed=5)
    assert again == policy and hash(again) == hash(policy)
    assert get_policy(config, n_layers=3, seed=5) != policy


@pytest.mark.parametrize("policy_id", ["fixed", "schedule", "adaptive", "mqgrad"])
def test_defaults_round_trip_and_decide_one_value_per_layer(policy_id):
    policy = get_policy({"id": policy_id}, n_layers=3, seed=1)
    assert get_policy(policy.get_config(), n_layers=3, seed=1) == policy
    bits = policy.decide(Observation(0, 2.3, 0.0))
    assert isinstance(bits, tuple) and len(bits) == 3 and all(type(b) is int for b in bits)
    lo, hi = policy.bits_range()
    assert all(lo <= b <= hi for b in bits)


@pytest.mark.parametrize("config, fragment", [
    ({"id": "nope"}, "unknown policy 'nope'; available: accordion, adaptive, aimd, fixed, lgreco, mqgrad, progress, schedule"),
    ({"bits": 4}, "must be a dict with an 'id' key"),
    ({"id": "fixed", "bitz": 4}, "unknown option(s) bitz; valid: bits"),
    ({"id": "mqgrad", "n_layers": 2}, "unknown option(s) n_layers"),
    ({"id": "fixed", "bits": 0}, "bits must be an integer in [1, 32], got 0"),
    ({"id": "fixed", "bits": 4.0}, "bits must be an integer"),
    ({"id": "fixed", "bits": True}, "bits must be an integer"),
    ({"id": "mqgrad", "min_bits": 6, "max_bits": 4}, "bits range is empty (min_bits=6 > max_bits=4)"),
    ({"id": "adaptive", "min_bits": 9, "max_bits": 8}, "bits range is empty"),
    ({"id": "mqgrad", "T": 1}, "T must be an integer >= 2, got 1"),
    ({"id": "mqgrad", "epsilon": 1.5}, "epsilon must be a number >= 0.0 and <= 1.0, got 1.5"),
    ({"id": "mqgrad", "epsilon": -0.1}, "epsilon must be a number"),
    ({"id": "mqgrad", "alpha": 0.0}, "alpha must be a number > 0.0 and <= 1.0"),
    ({"id": "mqgrad", "gamma": float("nan")}, "gamma must be a number > 0.0"),
    ({"id": "mqgrad", "discount": 1.1}, "discount must be a number >= 0.0 and <= 1.0"),
    ({"id": "mqgrad", "eta": 0}, "eta must be a number > 0.0"),
    ({"id": "mqgrad", "initial_bits": 9}, "initial_bits must be an integer in [2, 8], got 9"),
    ({"id": "mqgrad", "transition": "sideways"}, "transition must be one of 'greedy', 'taken'"),
    ({"id": "mqgrad", "per_layer": "yes"}, "per_layer must be true or false"),
    ({"id": "adaptive", "error": "l1"}, "error must be one of 'relative', 'mse'"),
    ({"id": "adaptive", "threshold": 0}, "threshold must be a number > 0.0"),
    ({"id": "adaptive", "interval": 0}, "interval must be an integer >= 1"),
    ({"id": "schedule", "schedule": "5:2"}, "schedule must start at iteration 0"),
    ({"id": "schedule", "schedule": "0:2,100:4,100:6"}, "must strictly increase (100 then 100)"),
    ({"id": "schedule", "schedule": "0:2,x:4"}, "schedule entry 'x:4' is not ITERATION:BITS"),
    ({"id": "schedule", "schedule": "0:2,10:9"}, "gives 9 bits at iteration 10, outside"),
    ({"id": "schedule", "schedule": 3}, "schedule must be a string"),
])
def test_bad_configs_are_rejected_with_one_line(config, fragment):
    with pytest.raises(PolicyError) as info:
        get_policy(config, n_layers=2)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_run_arguments_are_rejected():
    with pytest.raises(PolicyError, match="n_layers must be an integer >= 1"):
        get_policy({"id": "fixed"}, n_layers=0)
    with pytest.raises(PolicyError, match="seed must be an integer"):
        get_policy({"id": "mqgrad"}, seed=-1)


def test_policy_options_and_parsing_from_the_command_line():
    """``--policy-opt`` goes through the one KEY=VALUE parser; get_policy checks the types."""
    assert policy_options("fixed") == {"bits": 4}
    assert list(policy_options("mqgrad"))[:3] == ["T", "alpha", "gamma"]
    parsed = parse_assignments(["T=7", "epsilon=0.25", "per_layer=true", "transition=taken"], "--policy-opt")
    assert parsed == {"T": 7, "epsilon": 0.25, "per_layer": True, "transition": "taken"}
    assert get_policy({"id": "mqgrad", **parsed}).T == 7
    assert get_policy({"id": "adaptive", **parse_assignments(["initial_bits=null"], "--policy-opt")}).initial_bits is None
    with pytest.raises(PolicyError, match="T must be an integer >= 2, got 2.5"):
        get_policy({"id": "mqgrad", **parse_assignments(["T=2.5"], "--policy-opt")})
    with pytest.raises(PolicyError, match="unknown option"):
        get_policy({"id": "mqgrad", **parse_assignments(["Tee=3"], "--policy-opt")})
    with pytest.raises(PolicyError, match="per_layer"):
        get_policy({"id": "mqgrad", **parse_assignments(["per_layer=maybe"], "--policy-opt")})


@pytest.mark.parametrize("kwargs, fragment", [
    ({"iteration": -1, "loss": 1.0, "last_iteration_ms": 0.0}, "iteration must be an integer >= 0"),
    ({"iteration": 1.0, "loss": 1.0, "last_iteration_ms": 0.0}, "iteration must be an integer"),
    ({"iteration": 1, "loss": 1.0, "last_iteration_ms": -3.0}, "last_iteration_ms must be finite and >= 0"),
    ({"iteration": 1, "loss": 1.0, "last_iteration_ms": float("inf")}, "last_iteration_ms must be finite"),
])
def test_bad_observations_are_rejected(kwargs, fragment):
    with pytest.raises(PolicyError, match=fragment):
        Observation(**kwargs)


def test_check_codec_catches_bits_the_codec_cannot_take():
    get_policy({"id": "mqgrad"}).check_codec(uniform_codec())
    with pytest.raises(PolicyError, match="may choose 9 bits, which codec 'uniform' rejects"):
        get_policy({"id": "adaptive", "max_bits": 9}).check_codec(uniform_codec())
    with pytest.raises(PolicyError, match="codec 'fp32' has no 'bits' option"):
        get_policy({"id": "fixed", "bits": 4}).check_codec(get_codec({"id": "fp32"}))


# ---- fixed and schedule ------------------------------------------------------------

def test_fixed_gives_the_same_bits_everywhere_and_is_stateless():
    policy = get_policy({"id": "fixed", "bits": 6}, n_layers=2)
    assert [policy.decide(Observation(m, 1.0, 5.0)) for m in (0, 1, 99)] == [(6, 6)] * 3
    assert policy.bits_range() == (6, 6)
    assert policy.drain_records() == [] and policy.state_dict() == {}
    policy.load_state_dict({})
    with pytest.raises(PolicyError, match="stateless"):
        policy.load_state_dict({"bits": 3})


def test_schedule_switches_at_the_given_iterations():
    policy = get_policy({"id": "schedule", "schedule": "0:2, 500:4 ,2000:8"}, n_layers=2)
    expected = {0: 2, 499: 2, 500: 4, 1999: 4, 2000: 8, 10**9: 8}
    for m, bits in expected.items():
        assert policy.decide(Observation(m, 1.0, 0.0)) == (bits, bits)
    assert policy.get_config()["schedule"] == "0:2,500:4,2000:8"
    assert policy.bits_range() == (2, 8)


def test_schedule_accepts_pairs_and_may_go_down():
    policy = get_policy({"id": "schedule", "schedule": [[0, 8], [3, 2]]})
    assert policy.get_config()["schedule"] == "0:8,3:2"
    assert [policy.bits_at(m) for m in range(5)] == [8, 8, 8, 2, 2]


# ---- adaptive ------------------------------------------------------------------------

def gaussian(n, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_quantization_error_matches_a_numpy_min_max_quantizer():
    x = gaussian(4096)
    for bits in range(2, 9):
        measured = quantization_error(uniform_codec().with_bits(bits), x, "relative")
        assert measured == pytest.approx(minmax_relative_error(x, bits), rel=1e-3)
    mse = quantization_error(uniform_codec().with_bits(3), x, "mse")
    assert mse == pytest.approx(minmax_relative_error(x, 3) * float(np.mean(x.astype(np.float64) ** 2)),
                                rel=1e-3)
    assert quantization_error(uniform_codec(), np.zeros(16, np.float32), "relative") == 0.0


def test_strided_sample_takes_every_kth_element_from_a_moving_offset():
    x = np.arange(100, dtype=np.float32)
    assert np.array_equal(strided_sample(x, 10, 0), np.arange(0, 100, 10))
    assert np.array_equal(strided_sample(x, 10, 13), np.arange(3, 100, 10))
    assert np.array_equal(strided_sample(x, 30, 1), np.arange(1, 91, 3))
    assert np.array_equal(strided_sample(x, 0, 5), x)
    assert np.array_equal(strided_sample(x, 200, 5), x)
    out = np.full(12, -1.0, np.float32)
    assert np.array_equal(strided_sample(x.astype(np.float64), 10, 2, out), np.arange(2, 100, 10))


def test_adaptive_chooses_the_fewest_bits_under_the_threshold():
    g = gaussian(4096)
    errors = {b: minmax_relative_error(g, b) for b in range(2, 9)}
    cases = {errors[4] * 1.01: 4, errors[4] * 0.99: 5, errors[2] * 1.01: 2, errors[8] * 0.5: 8}
    for threshold, expected in cases.items():
        policy = get_policy({"id": "adaptive", "threshold": threshold, "sample_size": 0})
        assert policy.decide(Observation(1, 1.0, 5.0, (g,), uniform_codec())) == (expected,)
        (row,) = policy.drain_records()
        assert row["layer_bits"] == expected and row["bits"] == expected
        measured = row["error"][:expected - 1]
        assert np.all(measured[:-1] > threshold) and measured[-1] <= threshold or expected == 8
        assert np.all(np.isnan(row["error"][expected - 1:])) or expected == 8


def test_adaptive_global_takes_the_largest_layer_choice_per_layer_keeps_each():
    rng = np.random.default_rng(3)
    smooth = gaussian(8192, seed=1)
    spiky = smooth.copy()
    spiky[rng.integers(0, spiky.size, 8)] = 60.0   # outliers stretch the min/max range
    grads, codec = (smooth, spiky), uniform_codec()
    per_layer = get_policy({"id": "adaptive", "per_layer": True}, n_layers=2)
    bits = per_layer.decide(Observation(1, 1.0, 1.0, grads, codec))
    assert bits[1] > bits[0]
    both = get_policy({"id": "adaptive"}, n_layers=2)
    assert both.decide(Observation(1, 1.0, 1.0, grads, codec)) == (bits[1], bits[1])
    rows = both.drain_records()
    assert [r["layer"] for r in rows] == [0, 1] and [r["layer_bits"] for r in rows] == list(bits)
    assert_records_match_columns(both, rows)


def test_adaptive_mse_reading_wants_more_bits_for_larger_gradients():
    codec = uniform_codec()
    picks = {}
    for scale in (1.0, 30.0):
        g = gaussian(4096, scale=scale)
        for error in ("relative", "mse"):
            policy = get_policy({"id": "adaptive", "error": error, "threshold": 0.01})
            picks[error, scale] = policy.decide(Observation(1, 1.0, 1.0, (g,), codec))[0]
    assert picks["relative", 1.0] == picks["relative", 30.0]
    assert picks["mse", 30.0] > picks["mse", 1.0]


def test_adaptive_decides_every_interval_and_starts_at_initial_bits():
    codec, g = uniform_codec(), gaussian(1000)
    policy = get_policy({"id": "adaptive", "interval": 4, "initial_bits": 7, "sample_size": 256})
    decided = []
    for m in range(12):
        bits = policy.decide(Observation(m, 1.0, 1.0, () if m == 0 else (g,), codec))
        decided += [r["iteration"] for r in policy.drain_records()]
        if m == 0:
            assert bits == (7,)
    assert decided == [1, 5, 9]
    assert get_policy({"id": "adaptive"}).decide(Observation(0, 1.0, 0.0)) == (8,)


def test_adaptive_subsamples_large_layers():
    policy = get_policy({"id": "adaptive", "sample_size": 512})
    policy.decide(Observation(1, 1.0, 1.0, (gaussian(10_000),), uniform_codec()))
    (row,) = policy.drain_records()
    assert row["sample_size"] == 512


def test_adaptive_state_dict_resumes_the_same_decisions():
    codec = uniform_codec()
    grads = [(gaussian(3000, seed=m, scale=1.0 + m),) for m in range(20)]
    first = get_policy({"id": "adaptive", "interval": 3, "sample_size": 500, "error": "mse",
                        "threshold": 1e-3})
    for m in range(8):
        first.decide(Observation(m, 1.0, 1.0, grads[m], codec))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    second = get_policy(first.get_config())
    second.load_state_dict(state)
    first.drain_records()
    for m in range(8, 20):
        assert first.decide(Observation(m, 1.0, 1.0, grads[m], codec)) == \
            second.decide(Observation(m, 1.0, 1.0, grads[m], codec))
    a, b = first.drain_records(), second.drain_records()
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == [9, 12, 15, 18]
    assert all(np.array_equal(x["error"], y["error"], equal_nan=True) for x, y in zip(a, b))


@pytest.mark.parametrize("obs_kwargs, fragment", [
    ({"gradients": (np.ones(10, np.float32),), "codec": None}, "needs the run's codec"),
    ({"gradients": (np.ones(10, np.float32),), "codec": get_codec({"id": "fp16"})}, "needs the run's codec"),
    ({"gradients": (np.ones(10, np.float32),) * 2, "codec": "uniform"}, "got 2 gradients for 1"),
    ({"gradients": (np.ones((2, 5), np.float32),), "codec": "uniform"}, "must be a 1-D float array"),
    ({"gradients": (np.array([1.0, np.nan], np.float32),), "codec": "uniform"}, "layer 0 at 2 bits: uniform"),
])
def test_adaptive_rejects_bad_observations(obs_kwargs, fragment):
    if obs_kwargs["codec"] == "uniform":
        obs_kwargs = {**obs_kwargs, "codec": uniform_codec()}
    with pytest.raises(PolicyError, match=fragment):
        get_policy({"id": "adaptive"}).decide(Observation(1, 1.0, 1.0, **obs_kwargs))
