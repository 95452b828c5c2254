"""PowerSGD's two rounds on the hierarchical exchange (issue 62): each node's local rank j
computes the factors of its slice's whole layers from its node's mean, the rounds run among
the workers of local rank j, and the all-gather brings the node's other layers. With menus
(``ranks``/``widths``) and ``--policy lgreco`` each worker measures its slice's layers.

Mean-linear as PowerSGD is (the average P is (mean M) Q, the error memories' mean follows
the same recurrence whether kept per worker or per node), the hierarchical run with float32
factors trains as the flat one to float32 rounding, while only the node's slices cross its NIC."""

from __future__ import annotations

import numpy as np
import pytest

from mpigrad.config import RunConfig
from mpigrad.runtime.exchange.build import base_codec, build_replica, build_shards, load_data, shard_chunks
from mpigrad.runtime.plan.layout import Chunks
from mpigrad.trace import load
from conftest import run_mpi
from test_exchanges import run

POWERSGD = dict(servers="colocated", policy="fixed", codec="powersgd", codec_opts={"start": 2, "rank": 2},
                iterations=6)


def _run(tmp_path, name, **options):
    folder = tmp_path / name
    folder.mkdir()
    codes, errors, config = run(folder, {**POWERSGD, **options}, workers=4)
    assert not errors, errors
    assert codes[0] == 0
    trace = load(config.trace)
    assert trace.complete and len(trace.steps) == config.iterations
    return trace, config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hierarchical-powersgd")
    return {name: _run(tmp, name, **options) for name, options in {
        "flat 2x2": dict(ranks_per_node=2, exchange="flat"),
        "hierarchical": dict(ranks_per_node=2, exchange="hierarchical"),
        "hierarchical 8-bit factors bf16": dict(ranks_per_node=2, exchange="hierarchical", intra_codec="bf16",
                                                codec_opts={"start": 2, "rank": 2, "factor_bits": 8}),
    }.items()}


def test_the_slices_are_whole_layers():
    """Under the hierarchical exchange a two-round codec's shards keep whole layers (its
    factor shards), whatever --shard-chunk says; flat, they are cut as before."""
    hierarchical = RunConfig(**{**POWERSGD, "ranks_per_node": 2, "exchange": "hierarchical", "shard_chunk": 1000})
    flat = RunConfig(**{**POWERSGD, "ranks_per_node": 2, "shard_chunk": 1000})
    replica = build_replica(flat, load_data(flat))
    assert shard_chunks(hierarchical, replica.layout, 4) == Chunks()
    assert shard_chunks(flat, replica.layout, 4) == Chunks(1000, 1000)
    shards = build_shards(hierarchical, replica.layout, base_codec(hierarchical), 4)
    sizes = {segment.name: segment.size for segment in replica.layout.quantized}
    pieces = [piece for shard in shards for piece in shard.pieces if piece.quantized]
    assert sorted(p.size for p in pieces) == sorted(sizes.values())  # one piece per layer


def test_hierarchical_powersgd_trains_as_the_flat_one(runs):
    """Float32 factors: the same iterates to float32 rounding (every run checked its
    replicas every iteration: a worker that differed would have ended it)."""
    flat, hierarchical = runs["flat 2x2"][0], runs["hierarchical"][0]
    assert hierarchical.config["exchange"] == "hierarchical" and hierarchical.config["checksum_every"] == 1
    np.testing.assert_allclose(hierarchical.steps["loss"], flat.steps["loss"], rtol=1e-5)
    assert not np.isclose(flat.steps["loss"].iloc[0], flat.steps["loss"].iloc[-1], rtol=1e-3)  # it trained
    quantized = runs["hierarchical 8-bit factors bf16"][0]
    np.testing.assert_allclose(quantized.steps["loss"], flat.steps["loss"], rtol=1e-2)


def test_only_the_slices_factors_cross_a_nic(runs):
    """From the start iteration on, worker w sends factor frames only to the shards of its
    local rank; the NIC then carries fewer bytes than the flat exchange's, and the slices
    inside the nodes are charged once each way per iteration, not once per round."""
    trace, config = runs["hierarchical"]
    frames = trace.array("servers", "frame_bytes")  # [row, shard s, worker w]
    for s in range(4):
        for w in range(4):
            if w % 2 != s % 2:
                assert (frames[:, s, w] == 0).all(), (s, w)
    flat = runs["flat 2x2"][0].steps
    steps = trace.steps
    compressed = steps["iteration"] >= 2
    assert (steps["bytes_nic"][compressed] < flat["bytes_nic"][compressed]).all()
    slices = trace.attrs["shards"]["slice_bytes"]
    assert (steps["bytes_intra"] == 2 * 2 * 1 * sum(slices)).all()


def test_the_slices_inside_a_node_are_charged_once_per_iteration(runs):
    """The reduce-scatter before round 1 and the all-gather after round 2: the intra-node
    seconds of a two-round iteration are a one-round iteration's (before ``start``), and
    the model's for the slices' bytes."""
    trace, config = runs["hierarchical"]
    steps = trace.steps
    one_round, two_rounds = steps["iteration"] < 2, steps["iteration"] >= 2
    assert steps["t_intra"][one_round].nunique() == 1
    assert steps["t_intra"][two_rounds].unique().tolist() == steps["t_intra"][one_round].unique().tolist()
    slices = tuple(trace.attrs["shards"]["slice_bytes"])
    expected = 2 * config.link_model().node_intra(slices, 4).seconds
    np.testing.assert_allclose(steps["t_intra"], expected, rtol=1e-12)


MENUS = dict(codec_opts={"rank": 2, "ranks": [1, 2, 4], "widths": [2, 4, 8], "start": 1}, policy="lgreco",
             policy_opts={"interval": 3}, min_quantize_size=None, iterations=10)


def test_lgreco_chooses_each_layers_setting_on_the_hierarchical_exchange(tmp_path, monkeypatch):
    """PowerSGD's menus with ``--policy lgreco`` on 2 x 2: each worker measures the setting
    errors of its slice's layers alone (on its node's M, the matrix that crosses the NIC),
    rank 0 averages each layer over the nodes and the policy decides from that mean; the
    settings move (widths and other ranks), every replica agrees every iteration, and the NIC
    carries about half the flat exchange's bytes."""
    from mpigrad.runtime.exchange.lowrank import LowRank

    measured, real = [], LowRank.setting_errors

    def recording(self):
        errors = real(self)
        measured.append((self.owned, errors.copy()))
        return errors

    monkeypatch.setattr(LowRank, "setting_errors", recording)
    hierarchical, config = _run(tmp_path, "lgreco", ranks_per_node=2, exchange="hierarchical", **MENUS)
    settings = hierarchical.steps.filter(like="setting_layers").to_numpy()
    assert (settings[:2] == 2).all() and len({tuple(row) for row in settings}) > 2
    assert (settings < 0).any() and (settings == 1).any()
    first = measured[:4]  # iteration 1's four workers, before the decision of iteration 2
    layers = settings.shape[1]
    for layer in range(layers):
        owners = [errors[layer] for owned, errors in first if layer in owned]
        assert len(owners) == 2  # one worker per node: the slice's local rank
        assert not any(errors[layer].any() for owned, errors in first if layer not in owned)
        decided = hierarchical.policy[(hierarchical.policy["iteration"] == 2) & (hierarchical.policy["layer"] == layer)]
        np.testing.assert_allclose(decided.filter(regex="^error_").to_numpy()[0], np.mean(owners, axis=0), rtol=1e-12)
    frames = hierarchical.array("servers", "frame_bytes")
    assert all((frames[1:, s, w] == 0).all() for s in range(4) for w in range(4) if w % 2 != s % 2)
    monkeypatch.setattr(LowRank, "setting_errors", real)
    flat, _ = _run(tmp_path, "lgreco-flat", ranks_per_node=2, exchange="flat", **MENUS)
    ratio = hierarchical.steps["bytes_nic"].iloc[1:] / flat.steps["bytes_nic"].iloc[1:]
    assert ((ratio > 0.4) & (ratio < 0.6)).all(), ratio.tolist()


@pytest.mark.each_mpi
def test_powersgd_on_two_nodes_of_two_under_mpi(tmp_path, mpi_env):
    """A launched 2 x 2 PowerSGD run with menus and ``--policy lgreco``: auto takes the
    hierarchical exchange for it, every replica agrees every iteration, the policy moves the
    settings, and the NICs carry factor frames of the slices only."""
    trace_path = tmp_path / "run.h5"
    result = run_mpi(5, ["train", "--servers", "colocated", "--ranks-per-node", "2", "--codec", "powersgd",
                         "--policy", "lgreco", "--policy-opt", "interval=2", "--codec-opt", "start=2",
                         "--codec-opt", "factor_bits=8", "--codec-opt", "rank=2", "--codec-opt", "ranks=1,2,4", "--codec-opt",
                         "widths=2,4,8",
                         "--iterations", "6", "--batch-size", "8", "--checksum-every", "1", "--trace",
                         str(trace_path), "--model-opt", "fc_sizes=[256,256]", "--eval-every", "10"], mpi_env)
    assert result.returncode == 0, result.stderr + result.stdout[-2000:]
    assert "exchange: hierarchical" in result.stdout
    trace = load(trace_path)
    assert trace.complete and len(trace.steps) == 6 and trace.config["exchange"] == "hierarchical"
    settings = trace.steps.filter(like="setting_layers").to_numpy()
    assert (settings[:3] == 2).all() and len({tuple(row) for row in settings}) > 1, settings.tolist()
    frames = trace.array("servers", "frame_bytes")
    assert all((frames[:, s, w] == 0).all() for s in range(4) for w in range(4) if w % 2 != s % 2)
    assert (trace.steps["bytes_nic"] > 0).all() and (trace.steps["bytes_intra"] > 0).all()
