"""The cost model of local work (issue 24, item 2): fit, evaluation, calibration, the runtime's
charge on the deterministic clock, ``--cost-model none``, refusals, and retime's re-charge."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import SMALL_RUN, assert_same_trace, run_mpi
from mpigrad.cli import main
from mpigrad.clockmodel import iteration_seconds
from mpigrad.costmodel import (DEFAULT_MODEL_PATH, FORMAT, VERSION, Cost, CostModel, CostModelError, LocalWork,
                               fit_linear, resolve)


def pair(a, b):
    return {"a": a, "b": b}


def document(**codecs) -> dict:
    """A model whose codec entries are ``codec={bits: (encode, decode, accumulate)}``, each a
    pair (a, b); average 0 + 1e-3 n, feedback 0 + 1e-2 n."""
    table = {"fp32": {"32": {"encode": pair(1.0, 0.0), "decode": pair(2.0, 0.0), "accumulate": pair(3.0, 0.0)}}}
    for codec, widths in codecs.items():
        table[codec] = {str(bits): dict(zip(("encode", "decode", "accumulate"), (pair(*p) for p in ops)))
                        for bits, ops in widths.items()}
    return {"format": FORMAT, "version": VERSION, "codecs": table,
            "operations": {"average": pair(0.0, 1e-3), "feedback:residual": pair(0.0, 1e-2),
                           "feedback:accumulate": pair(0.0, 2e-2)}}


# ---- the fit ---------------------------------------------------------------------------------
def test_fit_recovers_a_line_from_exact_timings():
    sizes = [1024, 16384, 262144, 4194304]
    a, b = fit_linear(sizes, [5e-6 + 2e-10 * n for n in sizes])
    assert a == pytest.approx(5e-6, rel=1e-9) and b == pytest.approx(2e-10, rel=1e-9)


def test_fit_weighs_small_sizes_like_large_ones():
    """Noise of 10 % at one size moves the fit by about that much, not by the ratio of sizes."""
    sizes = [1000, 10000, 100000, 1000000]
    times = [1e-5 + 1e-9 * n for n in sizes]
    times[0] *= 1.1
    a, b = fit_linear(sizes, times)
    assert abs(a + b * 1000 - times[0]) / times[0] < 0.1
    assert abs(a + b * 1e6 - times[-1]) / times[-1] < 0.05


def test_fit_keeps_coefficients_non_negative():
    # Per-element time that falls with size (cache effects) would want a < 0 ... or b < 0.
    a, b = fit_linear([1000, 2000, 4000], [1e-6, 3e-6, 7e-6])
    assert a == 0.0 and b > 0
    a, b = fit_linear([1000, 2000, 4000], [3e-6, 2e-6, 1e-6])
    assert b == 0.0 and a > 0
    with pytest.raises(ValueError):
        fit_linear([1000, 1000], [1e-6, 1e-6])


# ---- the model and the charge ------------------------------------------------------------------
def test_a_cost_goes_through_its_measured_points():
    cost = Cost(1.0, 0.5, ((10, 2.0), (20, 4.0), (40, 12.0)))
    assert [cost(n) for n in (10, 15, 20, 30, 40)] == [2.0, 3.0, 4.0, 8.0, 12.0]
    assert cost(50) == 16.0                       # beyond: the last slope
    assert cost(0) == 1.0 and cost(4) == 2.0      # below: the fit, at most the first point
    assert Cost(1.0, 0.5)(4) == 3.0               # nothing measured: the line
    doc = document()
    doc["codecs"]["fp32"]["32"]["encode"]["measured"] = [[10, 2.0], [20, 4.0]]
    assert CostModel.from_dict(doc).seconds("fp32", 32, "encode", 15) == 3.0
    doc["codecs"]["fp32"]["32"]["encode"]["measured"] = [[20, 2.0], [10, 4.0]]
    with pytest.raises(CostModelError, match="measured sizes must increase"):
        CostModel.from_dict(doc)


def test_the_charge_of_a_tiny_iteration_by_hand():
    """2 workers, one server; pieces: layer 0 of 10 elements, layer 1 of 20, float32 rest of 4."""
    model = CostModel.from_dict(document(uniform={2: ((10.0, 1.0), (20.0, 2.0), (30.0, 3.0)),
                                                  4: ((40.0, 4.0), (50.0, 5.0), (60.0, 6.0))}))
    work = LocalWork(2, "uniform", None, "uniform", None, "none", (((0, 10), (1, 20), (-1, 4)),))
    bits = [2, 4]
    worker = (10 + 1 * 10) + (40 + 4 * 20) + 1.0                             # encode: 20 + 120 + 1
    server = ((20 + 2 * 10) + (30 + 3 * 10)                                   # decode + accumulate of layer 0
              + (50 + 5 * 20) + (60 + 6 * 20)                                 # ... of layer 1
              + 2.0 + 3.0                                                     # ... of the float32 rest
              + 1e-3 * (10 + 20 + 4)                                          # average
              + worker)                                                       # re-encode, as the workers'
    broadcast = (20 + 2 * 10) + (50 + 5 * 20) + 2.0                           # decode of the broadcast
    assert work.seconds(model, bits) == pytest.approx(worker + server + broadcast, rel=1e-15)
    # The policy's decision, by the quantized elements (30); one the model lacks costs nothing.
    doc = document(uniform={2: ((10.0, 1.0), (20.0, 2.0), (30.0, 3.0)), 4: ((40.0, 4.0), (50.0, 5.0), (60.0, 6.0))})
    doc["policies"] = {"accordion": pair(7.0, 0.1)}
    with_policy = CostModel.from_dict(doc)
    charged = LocalWork.from_dict({**work.to_dict(), "policy": "accordion"})
    assert charged.seconds(with_policy, bits) == pytest.approx(7.0 + 0.1 * 30 + worker + server + broadcast, rel=1e-15)
    plugin = LocalWork.from_dict({**work.to_dict(), "policy": "mine.module:Policy"})
    assert plugin.seconds(with_policy, bits) == work.seconds(with_policy, bits)
    assert with_policy.charges_policy("accordion") and not with_policy.charges_policy("mine.module:Policy")
    # Fixed widths ignore the policy's bits; a width the model lacks takes the nearest.
    fixed = LocalWork(2, "uniform", 4, "uniform", 4, "none", (((0, 10),),))
    assert fixed.seconds(model, [2]) == fixed.seconds(model, [4]) == fixed.seconds(model, [7])
    assert model.seconds("uniform", 3, "encode", 10) == model.seconds("uniform", 4, "encode", 10)
    assert model.seconds("uniform", 1, "encode", 10) == model.seconds("uniform", 2, "encode", 10)


def test_two_servers_charge_the_slowest_and_feedback_adds_decode_and_memory():
    model = CostModel.from_dict(document(sign={1: ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0))}))
    shards = (((0, 100),), ((1, 10),))
    plain = LocalWork(3, "sign", 1, "sign", 1, "none", shards)
    worker = 110.0
    slowest = 100 + 2 * 100 + 0.1 + 100          # shard 0: decode, 2 accumulates, average, re-encode
    assert plain.seconds(model, [1, 1]) == pytest.approx(worker + slowest + 110, rel=1e-15)
    feedback = LocalWork(3, "sign", 1, "sign", 1, "residual", shards)
    extra = lambda n: n * 1.0 + n * 1e-2  # noqa: E731  (the decode, the memory's update)
    expected = (worker + extra(100) + extra(10)) + (slowest + extra(100)) + 110
    assert feedback.seconds(model, [1, 1]) == pytest.approx(expected, rel=1e-15)
    assert LocalWork.from_dict(json.loads(json.dumps(feedback.to_dict()))) == feedback


def test_the_hierarchical_exchange_charges_each_worker_its_slice():
    """4 workers in nodes of 2 (``slices=2``): local rank j encodes and decodes the shards
    s with s % 2 == j, and adds its node's 2 float32 slices (accumulate, average); a server
    decodes the N = 2 frames of its local rank's workers; with one slice it is the flat charge."""
    model = CostModel.from_dict(document(sign={1: ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0))}))
    shards = (((0, 100),), ((1, 10),), ((2, 40),), ((3, 20),))
    flat = LocalWork(4, "sign", 1, "sign", 1, "none", shards)
    nodes = LocalWork(4, "sign", 1, "sign", 1, "none", shards, slices=2)
    intra = lambda n: 3.0 + 1e-3 * n  # noqa: E731  (one fp32 accumulate at L - 1 = 1, the mean)
    worker = max(100 + intra(100) + 40 + intra(40), 10 + intra(10) + 20 + intra(20))
    server = 100 + 1 * 100 + 0.1 + 100  # shard 0: decode, N - 1 = 1 accumulate, average, re-encode
    broadcast = max(100 + 40, 10 + 20)
    assert nodes.seconds(model, [1] * 4) == pytest.approx(worker + server + broadcast, rel=1e-15)
    assert flat.seconds(model, [1] * 4) == pytest.approx(170 + (100 + 3 * 100 + 0.1 + 100) + 170, rel=1e-15)
    assert LocalWork.from_dict(json.loads(json.dumps(nodes.to_dict()))) == nodes
    old = {key: value for key, value in flat.to_dict().items() if key != "slices"}  # a trace from before
    assert LocalWork.from_dict(old) == flat


def test_none_adds_exactly_nothing():
    """iteration_seconds with no charge is the old compute_time + t_comm, bit for bit."""
    for compute, comm in [(0.02, 0.026240000000000003), (0.1, 1 / 3), (0.0, 0.7)]:
        assert iteration_seconds(comm, compute, 9.0, 9.0, 9.0, 9.0) == compute + comm
        assert iteration_seconds(comm, compute, 9.0, 9.0, 9.0, 9.0, 0.0) == compute + comm


def test_the_package_model_is_valid_and_covers_every_codec():
    from mpigrad.codecs import available, codec_class

    model = resolve("default")
    for codec in available():
        if not codec_class(codec).two_rounds:  # powersgd: its matrix products are not in a cost model
            model.check_codec(codec)
    assert model.document["machine"]["cpu"]
    from mpigrad.policies import available as policies
    assert all(model.charges_policy(p) for p in policies())
    assert resolve("none") is None
    assert model.seconds("uniform", 2, "encode", 10**6) > 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="x"), "not a cost model"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["codecs"].pop("fp32"), "no costs for fp32"),
    (lambda d: d["codecs"]["fp32"]["32"].pop("accumulate"), "must give encode, decode, accumulate"),
    (lambda d: d["codecs"]["fp32"]["32"].update(encode=pair(-1.0, 0.0)), "a must be a finite number >= 0"),
    (lambda d: d["codecs"]["fp32"]["32"].update(encode=pair(0.0, float("nan"))), "b must be a finite"),
    (lambda d: d["codecs"]["fp32"].update(x={}), "width 'x'"),
    (lambda d: d["operations"].pop("average"), "operations lacks average"),
])
def test_malformed_models_are_refused_in_one_line(change, message):
    doc = document(sign={1: ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0))})
    change(doc)
    with pytest.raises(CostModelError, match=message) as info:
        CostModel.from_dict(doc)
    assert "\n" not in str(info.value)


def test_a_checkpoint_from_before_the_option_resumes_with_none():
    from mpigrad.config import RunConfig
    from mpigrad.runtime.measure.checkpoint import identity

    old = RunConfig().to_dict()
    del old["cost_model"]
    assert identity(old, 3) == identity({**old, "cost_model": "none"}, 3)
    assert identity(old, 3) != identity({**old, "cost_model": "default"}, 3)


# ---- calibration ---------------------------------------------------------------------------------
def test_calibrate_writes_a_model_train_reads(tmp_path, capsys):
    out = tmp_path / "costs.json"
    code = main(["bench", "calibrate", "-o", str(out), "--sizes", "256,4096", "--repeat", "1",
                 "--codecs", "sign", "--policies", "fixed,accordion"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "feedback:residual" in printed
    model = CostModel.load(out)
    assert sorted(model.codecs) == ["fp32", "sign"] and list(model.codecs["sign"]) == [1]
    assert model.document["machine"]["cpu"] and model.document["sizes"] == [256, 4096]
    assert sorted(model.policies) == ["accordion", "fixed"] and model.policy("accordion", 4096) > 0
    assert model.seconds("sign", 1, "encode", 4096) == model.document["codecs"]["sign"]["1"]["encode"]["measured"][1][1]
    for op in ("encode", "decode", "accumulate"):
        cost = model.codecs["sign"][1][op]
        assert cost.a >= 0 and cost.b >= 0 and cost(4096) > 0 and len(cost.points) == 2
    assert main(["bench", "calibrate", "-o", str(out), "--sizes", "256,4096"]) == 2  # exists
    assert main(["bench", "calibrate", "-o", str(tmp_path / "x.json"), "--sizes", "256"]) == 2
    assert main(["bench", "calibrate", "-o", str(tmp_path / "x.json"), "--codecs", "nope"]) == 2
    assert main(["bench", "calibrate", "-o", str(tmp_path / "x.json"), "--policies", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 4
    assert main(["bench", "calibrate", "-o", str(tmp_path / "y.json"), "--sizes", "256,1024", "--repeat", "1",
                 "--codecs", "fp32", "--policies", "none"]) == 0
    assert CostModel.load(tmp_path / "y.json").policies == {}


# ---- refusals by mpigrad train (before MPI starts) ---------------------------------------------
def refused(tmp_path, *args) -> str:
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--trace", str(tmp_path / "t.h5"), *args],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_bad_cost_models_are_refused_with_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    (tmp_path / "nosign.json").write_text(json.dumps(document()))
    assert "does not exist" in refused(tmp_path, "--compute-time", "20ms", "--cost-model", "missing.json")
    assert "is not JSON" in refused(tmp_path, "--compute-time", "20ms", "--cost-model", "bad.json")
    assert "not a cost model" in refused(tmp_path, "--compute-time", "20ms", "--cost-model", "other.json")
    line = refused(tmp_path, "--compute-time", "20ms", "--cost-model", "nosign.json", "--codec", "sign",
                   "--policy", "fixed")
    assert "no costs for codec 'sign'" in line and "--cost-model none" in line
    assert "only with --compute-time" in refused(tmp_path, "--cost-model", "nosign.json")


# ---- real runs ---------------------------------------------------------------------------------
RUN = [*SMALL_RUN, "--iterations", "6", "--eval-every", "3", "--policy", "fixed", "--bits", "2", "--seed", "3",
       "--net-mode", "virtual", "--compute-time", "20ms", "--latency", "1ms"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mpi_env):
    tmp = tmp_path_factory.mktemp("costs")
    traces = {}
    for name, extra in [("default", []), ("again", []), ("none", ["--cost-model", "none"])]:
        traces[name] = tmp / f"{name}.h5"
        result = run_mpi(3, ["train", "--trace", str(traces[name]), *RUN, *extra], mpi_env, timeout=180)
        assert result.returncode == 0, result.stderr
    return traces


@pytest.mark.mpi
def test_a_run_charges_the_package_model_and_is_the_same_twice(runs):
    from mpigrad.trace import load, read_raw

    assert_same_trace(load(runs["default"]), load(runs["again"]))
    charged, free = read_raw(runs["default"]), read_raw(runs["none"])
    assert charged.attrs["cost_model"] == json.loads(DEFAULT_MODEL_PATH.read_text())
    assert free.attrs["cost_model"] is None and free.attrs["local_work"] is None
    model = CostModel.from_dict(charged.attrs["cost_model"])
    work = LocalWork.from_dict(charged.attrs["local_work"])
    assert work.workers == 2 and work.codec == "uniform" and len(work.shards) == 1
    steps, free_steps = charged.arrays["steps"], free.arrays["steps"]
    for column in ("loss", "bits", "bytes_up", "bytes_down", "t_comm"):
        assert np.array_equal(steps[column], free_steps[column]), column
    sim = sim_free = 0.0
    for row in range(len(steps["iteration"])):
        t_local = work.seconds(model, steps["bits_layers"][row])
        assert t_local > 0
        sim += iteration_seconds(steps["t_comm"][row], 0.02, math.nan, math.nan, math.nan, math.nan, t_local)
        sim_free += 0.02 + free_steps["t_comm"][row]          # the clock before the cost model
        assert steps["sim_time"][row] == sim
        assert free_steps["sim_time"][row] == sim_free
    evals = charged.arrays["eval"]
    assert list(evals["sim_time"]) == [steps["sim_time"][m] for m in evals["iteration"]]


@pytest.mark.mpi
def test_retime_recharges_with_the_recorded_model(runs, tmp_path, capsys):
    from mpigrad.trace import read_raw

    same = tmp_path / "same.h5"
    assert main(["trace", "retime", str(runs["default"]), "--bandwidth", "10MB/s", "-o", str(same)]) == 0
    assert np.array_equal(read_raw(same).arrays["steps"]["sim_time"],
                          read_raw(runs["default"]).arrays["steps"]["sim_time"])
    assert read_raw(same).attrs["cost_model"] == read_raw(runs["default"]).attrs["cost_model"]
    free = tmp_path / "free.h5"
    assert main(["trace", "retime", str(runs["default"]), "--bandwidth", "10MB/s", "--cost-model", "none",
                 "-o", str(free)]) == 0
    assert np.array_equal(read_raw(free).arrays["steps"]["sim_time"],
                          read_raw(runs["none"]).arrays["steps"]["sim_time"])
    assert read_raw(free).attrs["cost_model"] is None
    # A run charged with none records no local work: no model can be put on it afterwards.
    assert main(["trace", "retime", str(runs["none"]), "--bandwidth", "10MB/s", "--cost-model", "default",
                 "-o", str(tmp_path / "x.h5")]) != 0
    assert "records no local_work" in capsys.readouterr().err


@pytest.mark.mpi
def test_a_stopped_and_resumed_run_charges_as_the_straight_one(runs, tmp_path, mpi_env):
    """The checkpoint carries the model: stopped after iteration 0 (a walltime already past),
    resumed, the trace equals the straight run's."""
    from mpigrad.trace import load, read_raw

    trace = tmp_path / "resumed.h5"
    stopped = run_mpi(3, ["train", "--trace", str(trace), *RUN, "--walltime", "1s"], mpi_env, timeout=180)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    resumed = run_mpi(3, ["train", "--trace", str(trace), *RUN, "--resume"], mpi_env, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_trace(load(runs["default"]), load(trace))
    assert read_raw(trace).attrs["cost_model"] == read_raw(runs["default"]).attrs["cost_model"]


@pytest.mark.mpi
def test_retime_gives_back_the_charge_of_two_servers_feedback_and_another_broadcast_codec(tmp_path, mpi_env):
    """sign's fixed 1 bit up, uniform at the policy's 4 bits down, error feedback, S = 2: the
    runtime's charge and retime's (from the trace's bits_layers, which record sign's 1 bit)
    agree to the last bit."""
    from mpigrad.trace import read_raw

    trace = tmp_path / "sign.h5"
    args = [*RUN, "--codec", "sign", "--bits", "4", "--broadcast-codec", "uniform", "--error-feedback", "residual",
            "--servers", "2", "--shard-chunk", "20000"]
    result = run_mpi(4, ["train", "--trace", str(trace), *args], mpi_env, timeout=180)
    assert result.returncode == 0, result.stderr
    raw = read_raw(trace)
    work = LocalWork.from_dict(raw.attrs["local_work"])
    assert (work.codec, work.codec_bits, work.down_codec, work.down_bits, work.feedback) == \
        ("sign", 1, "uniform", 4, "residual")
    assert len(work.shards) == 2 and all(work.shards)
    again = tmp_path / "again.h5"
    assert main(["trace", "retime", str(trace), "--bandwidth", "10MB/s", "-o", str(again)]) == 0
    assert np.array_equal(read_raw(again).arrays["steps"]["sim_time"], raw.arrays["steps"]["sim_time"])
