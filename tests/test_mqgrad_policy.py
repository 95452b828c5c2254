"""MQGrad's MDP checked by hand (Eq. 1-3, epsilon-greedy, SARSA) and on the simulated run."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from mpigrad.policies import Observation, PolicyError, get_policy
from mpigrad.policies.mqgrad import least_squares_slope, mdp_reward, smooth_losses
from mpigrad.policies.qnet import QNetwork
from mpigrad.policies.simenv import SimEnv, compare, summarise


def drive(policy, losses, durations):
    """decide() over iterations 0..len(losses)-1; durations[m] is iteration m's length in ms."""
    bits = []
    for m, loss in enumerate(losses):
        bits.append(policy.decide(Observation(m, loss, 0.0 if m == 0 else durations[m - 1])))
    return bits


def steady(policy_config, steps, loss=1.0, n_layers=1, seed=0):
    policy = get_policy(policy_config, n_layers=n_layers, seed=seed)
    T = policy.T
    drive(policy, [loss] * (steps * T), [10.0] * (steps * T))
    return policy, policy.drain_records()


def set_preference(policy, raise_bits: bool):
    """Make every agent's Q strictly increasing (raise) or decreasing (keep) in the bit level."""
    for agent in policy.agents:
        levels = agent.net.b2.size
        agent.net.W2[:] = 0.0
        agent.net.b2[:] = np.arange(levels) if raise_bits else -np.arange(levels)


# ---- Eq. 1, the slope, Eq. 2 -------------------------------------------------------

def test_eq1_smoothing_by_hand():
    assert smooth_losses([1.0, 2.0, 3.0], 0.5, 0.1) == pytest.approx([0.55, 0.695, 0.9255])
    assert smooth_losses([4.0, 4.0], 4.0, 0.01) == pytest.approx([4.0, 4.0])


def test_eq1_in_the_policy_seeds_with_the_first_loss_and_carries_the_last_value():
    policy = get_policy({"id": "mqgrad", "T": 3, "alpha": 0.1})
    drive(policy, [2.0, 1.0, 4.0, 2.0, 0.0, 0.0, 0.0], [100.0, 200.0, 300.0, 5.0, 5.0, 5.0])
    rows = policy.drain_records()
    assert [r["iteration"] for r in rows] == [0, 3, 6] and [r["t"] for r in rows] == [0, 1, 2]
    assert rows[0]["smoothed_loss"] == pytest.approx([2.0, 2.0, 2.0])
    assert rows[1]["smoothed_loss"] == pytest.approx([1.9, 2.11, 2.099])
    assert rows[2]["smoothed_loss"] == pytest.approx([1.8891, 1.70019, 1.530171])


def test_least_squares_slope():
    assert least_squares_slope(np.array([1.0, 3.0, 5.0, 7.0, 9.0])) == pytest.approx(2.0)
    assert least_squares_slope(np.array([4.0, 4.0, 4.0])) == 0.0
    values = np.random.default_rng(0).standard_normal(5)
    assert least_squares_slope(values) == pytest.approx(np.polyfit(np.arange(1, 6), values, 1)[0])


def test_eq2_reward_by_hand_and_in_the_policy():
    assert mdp_reward(-0.002, 4000.0, 300.0) == pytest.approx(1.5e-4)
    assert mdp_reward(0.001, 500.0, 300.0) == pytest.approx(-6e-4)
    policy = get_policy({"id": "mqgrad", "T": 3, "alpha": 0.1, "gamma": 300.0})
    drive(policy, [2.0, 1.0, 4.0, 2.0], [100.0, 200.0, 300.0])
    step0, step1 = policy.drain_records()
    assert math.isnan(step0["reward"]) and math.isnan(step0["c_ms"]) and math.isnan(step0["td_error"])
    beta = (2.099 - 1.9) / 2          # slope of [1.9, 2.11, 2.099] against i = 1, 2, 3
    assert step1["beta"] == pytest.approx(beta)
    assert step1["c_ms"] == 600.0     # iterations 0, 1, 2
    assert step1["reward"] == pytest.approx(-beta * 300.0 / 600.0)


def test_every_reward_can_be_recomputed_from_the_trace_rows_alone():
    rng = np.random.default_rng(4)
    losses = 2.0 * np.exp(-np.arange(300) / 150) + 0.05 * rng.standard_normal(300)
    durations = rng.uniform(50.0, 150.0, 300)
    policy = get_policy({"id": "mqgrad"}, n_layers=2, seed=9)
    drive(policy, losses, durations)
    rows = policy.drain_records()
    assert len(rows) == 60
    for row in rows[1:]:
        slope = np.polyfit(np.arange(1, 6), row["smoothed_loss"], 1)[0]
        assert row["reward"] == pytest.approx(-slope * row["gamma"] / row["c_ms"], rel=1e-9)
        m = row["iteration"]
        assert row["c_ms"] == pytest.approx(durations[m - 5:m].sum())
        assert row["bits"] == row["n"] + row["action"]
        assert row["exploratory"] == (row["action"] != row["greedy_action"])


# ---- Eq. 3 and the action space ----------------------------------------------------

def test_greedy_raise_climbs_one_bit_per_step_and_keeps_at_the_top():
    policy = get_policy({"id": "mqgrad", "epsilon": 0.0, "eta": 1e-9})
    set_preference(policy, raise_bits=True)
    bits = drive(policy, [1.0] * 45, [10.0] * 45)
    assert bits[::5] == [(b,) for b in (3, 4, 5, 6, 7, 8, 8, 8, 8)]
    assert all(bits[m] == bits[m - m % 5] for m in range(45))   # bits change only when m % T == 0
    rows = policy.drain_records()
    assert [r["n"] for r in rows] == [2, 3, 4, 5, 6, 7, 8, 8, 8]
    assert [r["action"] for r in rows] == [1] * 6 + [0] * 3


def test_eq3_exploration_does_not_move_the_state_bits():
    """Eq. 3: n_t = n_{t-1} + argmax_a Q(s_{t-1}, a), so a non-greedy +1 lasts one step."""
    policy = get_policy({"id": "mqgrad", "epsilon": 1.0, "eta": 1e-9})
    set_preference(policy, raise_bits=False)
    bits = drive(policy, [1.0] * 30, [10.0] * 30)
    rows = policy.drain_records()
    assert set(bits) == {(3,)} and {r["n"] for r in rows} == {2}
    assert all(r["exploratory"] and r["action"] == 1 and r["greedy_action"] == 0 for r in rows)


def test_transition_taken_moves_the_state_bits_with_the_action():
    policy = get_policy({"id": "mqgrad", "epsilon": 1.0, "eta": 1e-9, "transition": "taken"})
    set_preference(policy, raise_bits=False)
    drive(policy, [1.0] * 45, [10.0] * 45)
    rows = policy.drain_records()
    assert [r["n"] for r in rows] == [2, 3, 4, 5, 6, 7, 8, 8, 8]
    assert [r["exploratory"] for r in rows] == [True] * 6 + [False] * 3   # only "keep" at the top


def test_initial_state_and_q_indexing_by_bit_level():
    policy = get_policy({"id": "mqgrad", "initial_bits": 4, "output_init": "uniform"}, seed=2)
    drive(policy, [3.0], [])
    (row,) = policy.drain_records()
    q = policy.agents[0].net.values(np.ones(5))       # input_norm first_loss: L0 / L0
    assert np.allclose(row["q_values"], q) and row["q_values"].shape == (7,)
    assert row["n"] == 4 and row["greedy_action"] == int(q[3] > q[2])
    assert row["smoothed_loss"] == pytest.approx([3.0] * 5)


# ---- epsilon-greedy ------------------------------------------------------------------

@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3, 1.0])
def test_epsilon_greedy_explores_with_probability_epsilon(epsilon):
    _, rows = steady({"id": "mqgrad", "epsilon": epsilon}, steps=3000, seed=11)
    assert {r["n"] for r in rows} == {2} and {r["greedy_action"] for r in rows} == {0}   # ties keep
    explored = sum(r["exploratory"] for r in rows)
    sd = math.sqrt(3000 * epsilon * (1 - epsilon))
    assert abs(explored - 3000 * epsilon) <= 4 * sd
    assert explored == sum(r["action"] for r in rows)


def test_exploration_is_seeded():
    def actions(seed):
        return [r["action"] for r in steady({"id": "mqgrad", "epsilon": 0.5}, 200, seed=seed)[1]]
    assert actions(1) == actions(1) != actions(2)


# ---- the SARSA update ------------------------------------------------------------------

def finite_difference_gradient(net: QNetwork, x: np.ndarray, k: int, h: float = 1e-6):
    grads = []
    for param in net.params:
        grad = np.zeros_like(param)
        for index in np.ndindex(param.shape):
            saved = param[index]
            param[index] = saved + h
            up = net.values(x)[k]
            param[index] = saved - h
            down = net.values(x)[k]
            param[index] = saved
            grad[index] = (up - down) / (2 * h)
        grads.append(grad)
    return grads


def test_qnetwork_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    net = QNetwork(5, 10, 7, rng, "uniform")
    for _ in range(3):
        x, k = rng.uniform(0.2, 2.0, 5), int(rng.integers(7))
        for exact, numeric in zip(net.gradient(x, k), finite_difference_gradient(net, x, k)):
            assert np.allclose(exact, numeric, rtol=1e-6, atol=1e-8)


def test_sarsa_update_is_eta_td_error_times_the_finite_difference_gradient():
    config = {"id": "mqgrad", "T": 2, "epsilon": 0.0, "eta": 0.1, "discount": 0.5,
              "output_init": "uniform", "initial_bits": 3}
    policy = get_policy(config, seed=3)
    net = policy.agents[0].net
    drive(policy, [2.0, 1.5], [400.0])                   # step t = 0 at m = 0
    (row0,) = policy.drain_records()
    before = copy.deepcopy(net)
    policy.decide(Observation(2, 1.0, 300.0))            # step t = 1: reward, choice, update
    (row1,) = policy.drain_records()
    x_prev, x_now = row0["smoothed_loss"] / 2.0, row1["smoothed_loss"] / 2.0
    k_prev, k_now = row0["bits"] - 2, row1["bits"] - 2
    assert row1["reward"] == pytest.approx(-row1["beta"] * 300.0 / 700.0)
    td = row1["reward"] + 0.5 * before.values(x_now)[k_now] - before.values(x_prev)[k_prev]
    assert row1["td_error"] == pytest.approx(td, rel=1e-12)
    assert np.allclose(row1["q_values"], before.values(x_now))
    for new, old, grad in zip(net.params, before.params, finite_difference_gradient(before, x_prev, k_prev)):
        assert np.allclose(new, old + 0.1 * td * grad, rtol=1e-7, atol=1e-10)
    assert any(not np.array_equal(new, old) for new, old in zip(net.params, before.params))


# ---- records, layers, checkpoints, errors ----------------------------------------------

def test_records_match_the_declared_columns():
    policy = get_policy({"id": "mqgrad", "T": 4}, n_layers=2, seed=1)
    drive(policy, np.linspace(2, 1, 40), [20.0] * 40)
    columns = policy.record_columns()
    rows = policy.drain_records()
    assert len(rows) == 10 and policy.drain_records() == []
    for row in rows:
        assert set(row) == set(columns) and row["layer"] == -1
        for name, (dtype, shape) in columns.items():
            assert np.asarray(row[name]).shape == shape
            np.array(row[name], dtype=dtype)


def test_rewards_recomputed_from_an_hdf5_trace_file(tmp_path):
    h5py = pytest.importorskip("h5py")
    from mpigrad.trace.writer import TraceWriter
    policy = get_policy({"id": "mqgrad"}, n_layers=2, seed=4)
    drive(policy, np.linspace(2.0, 1.0, 60) ** 2, np.linspace(80.0, 120.0, 60))
    path = tmp_path / "policy.h5"
    with TraceWriter(path, config={"policy": policy.get_config()},
                     tables={"policy": policy.record_columns()}, flush_every=5) as writer:
        for row in policy.drain_records():
            writer.append("policy", row)
    with h5py.File(path, "r") as f:
        table = {name: f["policy"][name][...] for name in policy.record_columns()}
    assert len(table["t"]) == 12 and table["smoothed_loss"].shape == (12, 5)
    slopes = np.polyfit(np.arange(1, 6), table["smoothed_loss"][1:].T, 1)[0]
    assert np.allclose(table["reward"][1:], -slopes * table["gamma"][1:] / table["c_ms"][1:], rtol=1e-9)
    assert np.isnan(table["reward"][0]) and table["exploratory"].dtype == bool


def test_per_layer_agents_decide_separately():
    policy = get_policy({"id": "mqgrad", "per_layer": True, "epsilon": 0.5}, n_layers=3, seed=5)
    bits = drive(policy, np.linspace(2, 1, 100), [30.0] * 100)
    rows = policy.drain_records()
    assert [r["layer"] for r in rows[:6]] == [0, 1, 2, 0, 1, 2] and len(rows) == 60
    for m in range(0, 100, 5):
        step_rows = [r for r in rows if r["iteration"] == m]
        assert bits[m] == tuple(r["bits"] for r in step_rows)
    columns = [[r["action"] for r in rows if r["layer"] == layer] for layer in range(3)]
    assert columns[0] != columns[1] != columns[2]
    assert not np.array_equal(policy.agents[0].net.W1, policy.agents[1].net.W1)
    assert len(set(bits)) > 1


def test_state_dict_resumes_with_the_same_decisions():
    rng = np.random.default_rng(8)
    losses = 2.0 * np.exp(-np.arange(400) / 100) + 0.05 * rng.standard_normal(400)
    durations = 100.0 + 20.0 * rng.random(400)
    config = {"id": "mqgrad", "per_layer": True, "epsilon": 0.3}
    first = get_policy(config, n_layers=2, seed=21)
    drive(first, losses[:137], durations)                # stop in the middle of an MDP step
    state = pickle.loads(pickle.dumps(first.state_dict()))
    first.drain_records()
    second = get_policy(config, n_layers=2, seed=21)
    second.load_state_dict(state)
    for m in range(137, 400):
        obs = Observation(m, losses[m], durations[m - 1])
        assert first.decide(obs) == second.decide(obs)
    a, b = first.drain_records(), second.drain_records()
    assert len(a) == len(b) == 2 * 52
    for x, y in zip(a, b):
        for name in x:
            assert np.array_equal(x[name], y[name], equal_nan=True), name
    with pytest.raises(PolicyError, match="checkpoint was written with config"):
        get_policy({**config, "epsilon": 0.2}, n_layers=2, seed=21).load_state_dict(state)


@pytest.mark.parametrize("calls, fragment", [
    ([(0, 1.0, 0.0), (2, 1.0, 1.0)], "expected iteration 1, got 2"),
    ([(3, 1.0, 1.0)], "expected iteration 0, got 3"),
    ([(0, float("nan"), 0.0)], "global loss at iteration 0 is nan"),
    ([(0, 1.0, 0.0)] + [(m, 1.0, 0.0) for m in range(1, 6)], "iterations 0..4 took 0.0 ms"),
    ([(0, 0.0, 0.0)], "input_norm='first_loss' needs a positive first loss"),
])
def test_bad_observations_stop_the_policy_with_a_clear_message(calls, fragment):
    policy = get_policy({"id": "mqgrad"})
    with pytest.raises(PolicyError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        for m, loss, ms in calls:
            policy.decide(Observation(m, loss, ms))


def test_a_diverging_q_network_is_reported():
    policy = get_policy({"id": "mqgrad", "eta": 1e6, "input_norm": "none", "epsilon": 0.5}, seed=1)
    losses = 1e3 * (1 + 0.5 * np.random.default_rng(0).standard_normal(2000))
    with pytest.raises(PolicyError, match="the Q-network diverged"):
        drive(policy, np.abs(losses), [1.0] * 2000)


# ---- the simulated training run ---------------------------------------------------------

def test_mqgrad_learns_to_raise_bits_and_beats_the_fixed_baselines():
    fixed = {f"fixed-{b}": {"id": "fixed", "bits": b} for b in (2, 4, 8)}
    results = compare(SimEnv(), {**fixed, "mqgrad": {"id": "mqgrad"}}, range(8))
    summary = {name: summarise(episodes) for name, episodes in results.items()}
    mq = summary["mqgrad"]
    assert summary["fixed-2"]["reached"] == 0.0 and mq["reached"] == 1.0
    assert mq["median_time_s"] < 0.9 * min(summary[name]["median_time_s"] for name in fixed)
    assert mq["bits_q1"] < 3.5 and mq["bits_q4"] > mq["bits_q1"] + 1.0
    assert mq["bits_q1"] < mq["bits_q2"] < mq["bits_q3"] < mq["bits_q4"]


def test_simulated_run_is_reproducible_and_per_layer_works():
    env = SimEnv(max_iterations=600)
    runs = [compare(env, {"mq": {"id": "mqgrad", "per_layer": True}}, [3])["mq"][0] for _ in range(2)]
    assert np.array_equal(runs[0].bits, runs[1].bits)
    assert runs[0].bits.shape == (600, 2)
    assert np.array_equal(runs[0].true_loss, runs[1].true_loss)


def test_simenv_command_prints_the_comparison(capsys):
    from mpigrad.policies.simenv import main
    assert main(["--seeds", "1", "--policy", 'five={"id": "fixed", "bits": 5}']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["fixed-2", "fixed-4", "fixed-8", "adaptive",
                                                       "mqgrad", "five"]
    assert lines[1].split()[1:3] == ["inf", "0%"]
