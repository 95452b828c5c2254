"""Accordion and L-GreCo policies against hand-computed decisions, and in real mpiexec runs."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from conftest import SMALL_RUN, run_mpi
from mpigrad.codecs import get_codec
from mpigrad.policies import Observation, PolicyError, get_policy
from mpigrad.policies.accordion import is_critical
from mpigrad.policies.lgreco import assign_bits
from mpigrad.trace import load


def obs(m, gradients=(), codec=None):
    return Observation(iteration=m, loss=1.0, last_iteration_ms=10.0, gradients=gradients, codec=codec)


# ---- accordion -----------------------------------------------------------------------

def test_critical_regime_test_is_the_relative_change_of_the_norm():
    assert is_critical(float("nan"), 1.0, 0.5)          # first check: critical
    assert is_critical(2.0, 1.0, 0.5)                   # |2 - 1| / 2 = 0.5 >= 0.5
    assert not is_critical(2.0, 1.2, 0.5)               # 0.4
    assert is_critical(1.0, 1.6, 0.5)                   # 0.6
    assert is_critical(0.0, 1.0, 0.5) and not is_critical(0.0, 0.0, 0.5)


def test_accordion_decides_per_layer_from_accumulated_norms():
    policy = get_policy({"id": "accordion", "interval": 2, "low_bits": 2, "high_bits": 6}, n_layers=2)
    ones = np.ones(4, np.float32)
    assert policy.decide(obs(0)) == (6, 6)                      # no gradient yet: high bits
    # Iterations 1-2 feed the first window: layer norms ||2 * ones|| = 4 and ||2 * 3 ones|| = 12.
    assert policy.decide(obs(1, (ones, 3 * ones))) == (6, 6)
    assert policy.decide(obs(2, (ones, 3 * ones))) == (6, 6)    # first check: all critical
    # Second window: layer 0 sums to 2 * 1.1 ones (norm 4.4, change 0.1: not critical),
    # layer 1 to 2 * ones (norm 4, change 8/12 = 0.67: critical).
    policy.decide(obs(3, (1.1 * ones, ones)))
    assert policy.decide(obs(4, (1.1 * ones, ones))) == (2, 6)
    rows = policy.drain_records()
    assert [(r["iteration"], r["layer"], r["bits"], r["critical"]) for r in rows] == [
        (2, 0, 6, True), (2, 1, 6, True), (4, 0, 2, False), (4, 1, 6, True)]
    assert rows[2]["norm"] == pytest.approx(4.4) and rows[2]["change"] == pytest.approx(0.1)
    assert rows[3]["change"] == pytest.approx(2 / 3)


def test_accordion_state_dict_resumes_the_same_decisions():
    config = {"id": "accordion", "interval": 3}
    rng = np.random.default_rng(0)
    grads = [tuple(rng.normal(scale=1 + (m % 7), size=16).astype(np.float32) for _ in range(2))
             for m in range(20)]
    straight = get_policy(config, n_layers=2)
    decisions = [straight.decide(obs(m, grads[m] if m else ())) for m in range(20)]
    first = get_policy(config, n_layers=2)
    for m in range(9):
        first.decide(obs(m, grads[m] if m else ()))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = get_policy(json.loads(json.dumps(first.get_config())), n_layers=2)
    resumed.load_state_dict(state)
    assert [resumed.decide(obs(m, grads[m])) for m in range(9, 20)] == decisions[9:]


# ---- L-GreCo -------------------------------------------------------------------------

def test_dynamic_program_finds_the_cheapest_assignment_within_the_reference_error():
    # Reference column 1: total error 1 + 1 = 2, size 2 + 20 = 22. Hand search: layer 0 at
    # column 2 (error 0.5, size 4) with the big layer 1 at column 0 (error 1.4, size 10) has
    # error 1.9 <= 2 and size 14, the least; every cheaper pair exceeds the error budget.
    errors = [[10.0, 1.0, 0.5], [1.4, 1.0, 0.5]]
    sizes = [[1, 2, 4], [10, 20, 40]]
    assert assign_bits(errors, sizes, reference=1, levels=1000) == [2, 0]
    # Uniform errors: nothing beats the reference.
    assert assign_bits([[4, 1, 0.5], [4, 1, 0.5]], sizes, reference=1, levels=1000) == [1, 1]
    # An exact reference (zero gradient): the cheapest exact candidate.
    assert assign_bits([[0.0, 0.0, 0.0]], [[1, 2, 4]], reference=1, levels=10) == [0]


def test_lgreco_policy_gives_the_big_smooth_layer_fewer_bits():
    codec = get_codec({"id": "uniform", "bits": 4})
    policy = get_policy({"id": "lgreco", "interval": 10, "min_bits": 2, "max_bits": 4,
                         "reference_bits": 3}, n_layers=2)
    rng = np.random.default_rng(1)
    small = rng.normal(size=64).astype(np.float32)
    big = rng.normal(size=4096).astype(np.float32)
    assert policy.decide(obs(0)) == (3, 3)
    bits = policy.decide(obs(1, (small, big), codec))
    rows = policy.drain_records()
    errors = np.array([r["error"] for r in rows])
    sizes = np.array([r["size"] for r in rows])
    # The decision is the DP's over the measured table, and within the reference error.
    assert list(bits) == [2 + k for k in assign_bits(errors, sizes, 1, 1000)]
    chosen_error = sum(errors[layer, b - 2] for layer, b in enumerate(bits))
    assert chosen_error <= errors[:, 1].sum() * (1 + 2 / 1000)
    assert sum(sizes[layer, b - 2] for layer, b in enumerate(bits)) <= sizes[:, 1].sum()
    assert policy.decide(obs(5, (small, big), codec)) == bits   # next decision at iteration 11
    with pytest.raises(PolicyError, match="needs the run's codec"):
        get_policy({"id": "lgreco"}, n_layers=2).decide(obs(1, (small, big)))


# ---- real runs -----------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("policy, options", [
    ("accordion", ["interval=4", "low_bits=2", "high_bits=6"]),
    ("lgreco", ["interval=5", "reference_bits=4"]),
])
def test_per_layer_policy_in_a_real_run(tmp_path, mpi_env, policy, options):
    trace = tmp_path / f"{policy}.h5"
    args = ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", "12", "--policy", policy,
            "--net-mode", "virtual", "--compute-time", "20ms"]
    for option in options:
        args += ["--policy-opt", option]
    result = run_mpi(3, args, mpi_env, timeout=240)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and len(tr.steps) == 12
    layers = tr.array("steps", "bits_layers")
    rows = tr.policy
    assert len(rows) and set(rows["layer"]) == set(range(layers.shape[1]))
    # The bits each decision chose are the bits the next iterations were quantized with.
    for _, row in rows.iterrows():
        m, layer = int(row["iteration"]), int(row["layer"])
        assert layers[m, layer] == row["bits"]
