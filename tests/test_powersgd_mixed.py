"""``--codec powersgd`` with menus (``ranks``/``widths``) and ``--policy lgreco``: each
low-rank layer's setting, a rank or a width, chosen per layer (runtime/exchange/lowrank.py,
policies/lgreco.py). The codec and the setting codes, the errors the workers measure against
a NumPy twin, the policy under a tight and a loose budget, loopback runs (S = 1, 2 and
colocated give the same run; stop and resume the straight one) and a real mpiexec run.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import run_mpi
from mpigrad.codecs import CodecError, get_codec
from mpigrad.codecs.powersgd import setting_code, setting_label, setting_of
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.policies import PolicyError, SettingCosts, get_policy
from mpigrad.policies.base import Observation
from mpigrad.runtime.plan.checks import check_options
from mpigrad.trace import load
from test_powersgd_quantized import lowrank_of, twin_uniform
from test_runtime_loopback import run, straight_and_resumed

MENUS = {"rank": 2, "ranks": [1, 2, 4], "widths": [2, 4, 8]}
MIXED = dict(codec="powersgd", codec_opts={**MENUS, "start": 1}, policy="lgreco", policy_opts={"interval": 3},
             min_quantize_size=None)


# ---- the codec's menus and the setting codes ---------------------------------------------------
def test_menus_round_trip_and_are_refused_in_one_line():
    codec = get_codec({"id": "powersgd", **MENUS, "factor_bits": 8})
    assert get_codec(codec.get_config()) == codec and codec.mixed
    assert codec.get_config()["ranks"] == [1, 2, 4] and codec.get_config()["widths"] == [2, 4, 8]
    assert get_codec({"id": "powersgd", "rank": 2, "ranks": "4,1,2", "widths": "8, 2,4"}) == \
        get_codec({"id": "powersgd", **MENUS})  # --codec-opt ranks=4,1,2: sorted
    assert codec.menu == (1, 2, 4, -2, -4, -8) and codec.reference_setting == 2 and codec.max_rank == 4
    plain = get_codec({"id": "powersgd", "rank": 2})
    assert not plain.mixed and "ranks" not in plain.get_config() and plain.menu == (2,)
    for bad, words in [({"rank": 2, "ranks": [1, 4]}, "rank 2 must be one of ranks"),  # rank is the reference
                       ({"rank": 1, "widths": [4]}, "widths needs ranks"),
                       ({"rank": 1, "ranks": [1], "widths": [9]}, "widths entry must be an integer in \\[1, 8\\]"),
                       ({"rank": 1, "ranks": [1, 1]}, "repeats"), ({"rank": 1, "ranks": "1,x"}, "whole numbers"),
                       ({"rank": 1, "ranks": [0, 1]}, "ranks entry"), ({"rank": 1, "ranks": 1.5}, "list")]:
        with pytest.raises(CodecError, match=words) as info:
            get_codec({"id": "powersgd", **bad})
        assert "\n" not in str(info.value)


def test_setting_codes_round_trip_and_the_decoder_checks_them():
    for kind, value, label in [("rank", 1, "r1"), ("rank", 64, "r64"), ("width", 2, "b2"), ("width", 8, "b8")]:
        code = setting_code(kind, value)
        assert setting_of(code) == (kind, value) and setting_label(code) == label
    assert setting_code("width", 4) == -4 and setting_code("rank", 4) == 4  # r > 0, -b: never 0
    codec = get_codec({"id": "powersgd", **MENUS})
    assert codec.check_settings([1, -2, 4, 2, -8, 99], 5) == (1, -2, 4, 2, -8)  # the Control's padding ignored
    for bad in ([1, 2, 3], [0, 1, 1], [1, 1, -3], [1, 1, 8], [1, 1]):  # 3, 0, width 3, rank 8: not on the menu
        with pytest.raises(CodecError, match="not in the menu"):
            codec.check_settings(bad, 3)
    lowrank, _ = lowrank_of(MENUS)
    with pytest.raises(CodecError, match="not in the menu"):
        lowrank.select([3] * len(lowrank.shapes))  # a worker never trusts the wire


@pytest.mark.parametrize("options, words", [
    (dict(policy="fixed", policy_opts={}), "needs a policy that chooses each layer's setting: --policy lgreco"),
    (dict(policy="mqgrad", policy_opts={}), "--policy lgreco, not mqgrad"),
    (dict(codec_opts={"rank": 2}), "give it menus to choose from"),
])
def test_a_bad_combination_is_refused_in_one_line(options, words):
    config = RunConfig(**{**MIXED, **options})
    with pytest.raises(UsageError, match=words) as info:
        check_options(config)
    assert "\n" not in str(info.value)


def test_the_command_line_refuses_menus_without_lgreco_with_exit_2():
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--codec", "powersgd", "--codec-opt", "rank=2",
                           "--codec-opt", "ranks=1,2", "--policy", "fixed"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--policy lgreco" in lines[0], done.stderr


# ---- plans, sizes and the errors the workers measure ---------------------------------------------
def test_a_plan_sends_each_layer_at_its_setting_and_applies_it():
    """Two workers' round 1 and 2 by hand: a width layer goes whole (decoded uniform), a rank
    layer as P^ Q^T; e_i = M_i - applied in both cases; frame sizes from the layout."""
    lowrank, layout = lowrank_of({**MENUS, "factor_bits": 8})
    layers = len(lowrank.shapes)
    codes = [-4, 1, 4, 2, -8][:layers]
    plan = lowrank.select(codes)
    assert [(lay.r, lay.width) for lay in plan.layers][:3] == [(0, 4), (1, 0), (min(lowrank.shapes[2][1:3] + (4,)), 0)]
    assert lowrank.plan(codes) is plan and lowrank.plan(None).layers[0].r == 2  # cached; None: every layer at rank
    sizes1, sizes2 = lowrank.frame_sizes(codes)
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(layout.total).astype(np.float32)
    p1 = lowrank.first_factors(grad).copy()
    frame = plan.compressor1.encode(p1, codes, plan.rounds[0][0])
    assert frame.size == sizes1[0]
    out = np.zeros_like(p1)
    plan.compressor1.decode(frame, plan.rounds[0][0], out)
    offset, n, m, _ = lowrank.shapes[0]
    width_layer = grad[offset:offset + n * m]
    np.testing.assert_array_equal(out[:n * m], twin_uniform(width_layer, 4))  # whole, uniform 4-bit
    lowrank.p_buf[:] = out
    lowrank.orthogonalizer(plan.rounds[0][0])(lowrank.p_buf)
    q = lowrank.second_factors().copy()
    frame2 = plan.compressor2.encode(q, codes, plan.rounds[1][0])
    assert frame2.size == sizes2[0] and len(plan.rounds[1][0].pieces) == sum(c > 0 for c in codes)
    plan.compressor2.decode(frame2, plan.rounds[1][0], lowrank.q_buf)
    update = np.zeros(layout.total, np.float32)
    lowrank.apply(update)
    np.testing.assert_array_equal(update[:n * m], twin_uniform(width_layer, 4))
    np.testing.assert_array_equal(lowrank.error, lowrank.matrix - update[:lowrank.memory_end])


def test_setting_errors_match_a_numpy_twin():
    """Rank r: ||M - P P^T M||^2 with P = orth(M orth(Q[:, :r])) (one power iteration from
    the current Q); width b: uniform's rounding error over the layer."""
    lowrank, layout = lowrank_of(MENUS)
    grad = np.random.default_rng(2).standard_normal(layout.total).astype(np.float32)
    lowrank.select([2] * len(lowrank.shapes))
    lowrank.first_factors(grad)
    errors = lowrank.setting_errors()
    menu = lowrank.codec.menu
    assert errors.shape == (len(lowrank.shapes), len(menu))
    for layer, (offset, n, m, _) in enumerate(lowrank.shapes):
        M = lowrank.matrix[offset:offset + n * m].reshape(n, m).astype(np.float64)
        Q = lowrank._q_memory(layer).numpy().astype(np.float64)
        for k, code in enumerate(menu):
            kind, value = setting_of(code)
            if kind == "rank":
                r = min(n, m, value)
                q, _ = np.linalg.qr(Q[:, :r])
                p, _ = np.linalg.qr(M @ q)
                expected = np.sum((M - p @ (p.T @ M)) ** 2)
                np.testing.assert_allclose(errors[layer, k], expected, rtol=2e-3, atol=1e-3 * np.sum(M ** 2))
            else:
                flat = M.ravel().astype(np.float32)
                expected = np.sum((twin_uniform(flat, value).astype(np.float64) - flat) ** 2)
                np.testing.assert_allclose(errors[layer, k], expected, rtol=1e-6)
        assert errors[layer, 0] >= errors[layer, 2] - 1e-6 * np.sum(M ** 2)  # rank 4 no worse than rank 1
        assert errors[layer, 3] > errors[layer, 5]  # 2 bits worse than 8
    sizes = lowrank.setting_sizes()
    offset, n, m, _ = lowrank.shapes[1]
    assert sizes[1, 1] == 2 * 40 + 4 * (n + m) * min(n, m, 2)  # rank 2, float32 factors: P and Q
    assert sizes[1, 4] == get_codec({"id": "uniform", "bits": 4}).max_encoded_size(n * m)


# ---- the policy: a tight budget against a loose one -------------------------------------------
def settings_observation(errors, sizes, reference, codes=(1, 2, 4, -2, -8)):
    return Observation(iteration=5, loss=1.0, last_iteration_ms=0.0,
                       settings=SettingCosts(codes, np.asarray(errors, float), np.asarray(sizes, float), reference))


def test_lgreco_picks_cheaper_settings_under_a_looser_budget():
    codec_tight = get_codec({"id": "powersgd", "rank": 4, "ranks": [1, 2, 4], "widths": [2, 8]})
    codec_loose = get_codec({"id": "powersgd", "rank": 1, "ranks": [1, 2, 4], "widths": [2, 8]})
    # two layers; columns r1 r2 r4 b2 b8 (layer 0 small: 2 bits whole is its cheapest)
    errors = [[8.0, 4.0, 1.0, 6.0, 0.5], [9.0, 3.0, 0.5, 12.0, 0.2]]
    sizes = [[100, 200, 400, 80, 1200], [100, 200, 400, 300, 1200]]
    picks = {}
    for name, codec in (("tight", codec_tight), ("loose", codec_loose)):
        policy = get_policy({"id": "lgreco", "interval": 10}, n_layers=2)
        policy.setup_codec(codec)
        assert policy.decide(Observation(iteration=0, loss=1.0, last_iteration_ms=0.0)) == \
            (codec.reference_setting,) * 2  # before any measurement: every layer at rank
        assert policy.bits_range() == (-8, 4) and policy.observes(1)
        picks[name] = policy.decide(settings_observation(errors, sizes, codec.reference_setting, codec.menu))
        assert not policy.observes(6) and policy.observes(15)
        rows = policy.drain_records()
        assert [row["bits"] for row in rows] == list(picks[name]) and rows[0]["size"].shape == (5,)
    assert picks["tight"] == (4, 4)  # budget 1.5: only rank 4 (or 8 bits, dearer) fits
    assert picks["loose"] == (-2, 1)  # budget 17: the cheapest pair within it (6 + 9 <= 17, 180 bytes)
    policy = get_policy({"id": "lgreco"}, n_layers=2)
    policy.setup_codec(codec_loose)
    with pytest.raises(PolicyError, match="chooses among settings"):  # another menu
        policy.decide(settings_observation(np.ones((2, 3)), np.ones((2, 3)), 1, (1, 2, 4)))
    with pytest.raises(PolicyError, match="layers x 3 array"):
        settings_observation(errors, sizes, 1, (1, 2, 4))


# ---- loopback runs -----------------------------------------------------------------------
def test_servers_and_colocated_give_the_same_mixed_run(tmp_path):
    options = dict(MIXED, iterations=12, workers=2, eval_every=6)
    runs = {}
    for servers in (1, 2, "colocated"):
        code, errors, config = run(tmp_path, servers=servers, name=f"s{servers}.h5", **options)
        assert code == 0 and not errors, (servers, errors)
        runs[servers] = load(config.trace)
    one = runs[1]
    settings = one.steps.filter(like="setting_layers").to_numpy()
    assert (settings[:2] == 2).all()  # every layer at rank 2 until the first decision (after start)
    assert len({tuple(row) for row in settings}) > 2  # the decisions moved the settings
    assert (settings < 0).any() and (settings == 1).any()  # widths and another rank were chosen
    assert len(one.policy) == 5 * 4  # decisions at 2, 5, 8, 11: one row per layer
    for servers in (2, "colocated"):
        other = runs[servers]
        np.testing.assert_array_equal(one.steps["loss"], other.steps["loss"], err_msg=str(servers))
        np.testing.assert_array_equal(settings, other.steps.filter(like="setting_layers").to_numpy())
        np.testing.assert_array_equal(one.checksums.to_numpy(), other.checksums.to_numpy())
        np.testing.assert_array_equal(one.eval["test_loss"], other.eval["test_loss"])
    # S = 1: a worker's frames are the plan's (the layout and the settings)
    from mpigrad.runtime.exchange.lowrank import LowRank
    codec = get_codec(one.config["codec_opts"] | {"id": "powersgd"})
    lowrank, _ = lowrank_of({k: v for k, v in codec.get_config().items() if k != "id"}, fc_sizes=(64, 64))
    assert isinstance(lowrank, LowRank)
    sent = one.workers.filter(like="bytes_sent").to_numpy()[:, 0]
    for row in range(1, len(sent)):
        sizes1, sizes2 = lowrank.frame_sizes(settings[row])
        assert sent[row] == sizes1[0] + sizes2[0], row
    bits = one.steps.filter(like="bits_layers").to_numpy()
    np.testing.assert_array_equal(bits[1:], np.where(settings[1:] < 0, -settings[1:], 32))
    assert load(one.config["trace"]).label.startswith("PowerSGD L-GreCo r2 (ranks 1,2,4 widths 2,4,8")


def test_a_tight_budget_sends_more_than_a_loose_one(tmp_path):
    """The same menus, the reference (the codec's rank) 4 against 1: the policy's choices
    differ, and the tight run's frames are larger."""
    sent = {}
    for name, rank in (("tight", 4), ("loose", 1)):
        options = dict(MIXED, codec_opts={**MIXED["codec_opts"], "rank": rank}, iterations=6)
        code, errors, config = run(tmp_path, name=f"{name}.h5", **options)
        assert code == 0 and not errors, errors
        tr = load(config.trace)
        sent[name] = tr.workers.filter(like="bytes_sent").to_numpy()[3:, 0]
        sent[name + "_settings"] = tr.steps.filter(like="setting_layers").to_numpy()[3:]
    assert not np.array_equal(sent["tight_settings"], sent["loose_settings"])
    assert (sent["tight"] > sent["loose"]).all()


@pytest.mark.parametrize("servers", [1, "colocated"])
def test_stop_and_resume_keep_the_decisions(tmp_path, servers):
    """Rank 0's measured errors for the next decision travel in the checkpoint too."""
    options = dict(MIXED, iterations=10, servers=servers)
    a, b = straight_and_resumed(tmp_path, 4, **options)
    for column in ("loss", "bytes_up", "bytes_down", "sim_time"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.steps.filter(like="setting_layers"), b.steps.filter(like="setting_layers"))
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    assert len(a.policy) == len(b.policy)


# ---- a real mpiexec run ----------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("servers", [1, "colocated"])
def test_mpiexec_run_chooses_settings_and_trains(tmp_path, mpi_env, servers):
    trace = tmp_path / "mixed.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), "--servers", str(servers),
                         "--model-opt", "fc_sizes=[256,256]", "--codec", "powersgd",
                         "--codec-opt", "rank=2", "--codec-opt", "ranks=1,2,4", "--codec-opt", "widths=2,4,8",
                         "--codec-opt", "start=2", "--codec-opt", "factor_bits=8", "--policy", "lgreco",
                         "--policy-opt", "interval=20", "--iterations", "60", "--lr", "0.1", "--batch-size", "16",
                         "--eval-every", "20", "--compute-time", "50ms"], mpi_env)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and len(tr.steps) == 60
    losses = tr.steps["loss"].to_numpy()
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.1  # measured: 2.65 -> 2.32 (seed 0)
    settings = tr.steps.filter(like="setting_layers").to_numpy()
    assert len({tuple(row) for row in settings}) > 1 and len(tr.policy) > 0
    assert tr.checksums.shape[0] > 0  # the replicas agreed (a mismatch stops the run)
