"""`mpigrad trace compare` and the labelling rule shared by every `mpigrad trace` action."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import pytest

from mpigrad.analysis.compare import mean_ci, student_t95
from mpigrad.analysis.labels import group_labels
from mpigrad.cli import main
from mpigrad.trace import TraceWriter, default_tables


def write(path: Path, *, policy="fixed", bits=2, lr=0.01, seed=0, slope=0.1, status="complete",
          seconds_per_iteration=10.0, iterations=20, bytes_per_iteration=1000, machine=None, codec="uniform",
          network=None) -> Path:
    """A run whose loss falls linearly from 2.0 by ``slope`` per iteration, one iteration per
    ``seconds_per_iteration`` simulated seconds, evaluated every 5 iterations (``network``:
    config keys such as bandwidth, latency, compute_time)."""
    config = {"policy": policy, "bits": bits, "lr": lr, "seed": seed, "codec": codec,
              "trace": str(path), "policy_opts": {} if policy == "fixed" else {"T": 5}, **(network or {})}
    writer = TraceWriter(path, config=config, attrs={"seed": seed, **(machine or {})}, tables=default_tables(2),
                         flush_every=50)
    for i in range(iterations):
        sim = (i + 1) * seconds_per_iteration
        loss = 2.0 - slope * (i + 1)
        writer.append("steps", {"iteration": i, "wall_time": sim, "sim_time": sim, "loss": loss, "bits": bits,
                                "bytes_up": bytes_per_iteration, "bytes_down": bytes_per_iteration,
                                "t_compute": 0.0, "t_encode": 0.0, "t_decode": 0.0, "t_comm": 1.0,
                                "t_policy": 0.0})
        writer.append("workers", {"iteration": i, "loss": [loss, loss], "t_compute": [0.0, 0.0],
                                  "bytes_sent": [bytes_per_iteration // 2] * 2})
        if i % 5 == 4:
            writer.append("eval", {"iteration": i, "wall_time": sim, "sim_time": sim, "test_loss": loss,
                                   "test_accuracy": 0.5 + 0.01 * i})
    writer.close(status)
    return path


def cli(capsys, *args):
    code = main(["trace", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_student_t_and_confidence_interval():
    assert student_t95(2) == 4.303 and student_t95(30) == 2.042
    assert abs(student_t95(31) - 2.0395) < 2e-4 and abs(student_t95(1000) - 1.9623) < 2e-4
    mean, half = mean_ci([10.0, 12.0, 14.0])
    assert mean == 12.0 and half == pytest.approx(4.303 * 2.0 / math.sqrt(3))
    assert mean_ci([5.0]) == (5.0, None) and mean_ci([]) == (None, None)


@pytest.fixture()
def grid(tmp_path) -> dict[str, list[Path]]:
    # Fix 2: loss 2 - 0.1 (i+1) reaches 1.0 at iteration 9 (t = 100 s) for every seed, but
    # its seconds per iteration differ by seed: 10, 11, 12 -> 100, 110, 120 s.
    fix2 = [write(tmp_path / f"fix2-s{s}.h5", seed=s, seconds_per_iteration=10.0 + s) for s in range(3)]
    # Fix 4: slower iterations, 20 s: reaches 1.0 at 200 s; seed 2 failed half-way.
    fix4 = [write(tmp_path / f"fix4-s{s}.h5", bits=4, seed=s, seconds_per_iteration=20.0, bytes_per_iteration=2000)
            for s in range(2)]
    fix4.append(write(tmp_path / "fix4-s2.h5", bits=4, seed=2, status="failed", iterations=8))
    # MQGrad: seed 1 never gets below 1.2.
    mq = [write(tmp_path / "mq-s0.h5", policy="mqgrad", seed=0, seconds_per_iteration=8.0),
          write(tmp_path / "mq-s1.h5", policy="mqgrad", seed=1, slope=0.04, seconds_per_iteration=8.0)]
    return {"fix2": fix2, "fix4": fix4, "mq": mq}


def test_compare_groups_seeds_and_reports_time_to_target(grid, capsys):
    files = grid["fix2"] + grid["fix4"] + grid["mq"]
    code, out, err = cli(capsys, "compare", *files, "--target-loss", "1.0", "--format", "csv", "--at", "50s")
    assert (code, err) == (0, "")
    table = pd.read_csv(io.StringIO(out), keep_default_na=False).set_index("method")
    assert list(table.index) == ["Fix (2-bit)", "Fix (4-bit)", "MQGrad"]
    fix2, fix4, mq = table.loc["Fix (2-bit)"], table.loc["Fix (4-bit)"], table.loc["MQGrad"]
    assert (fix2["runs"], fix2["reached"]) == ("3/3", "3/3")
    assert float(fix2["sim_s_to_1"]) == pytest.approx(110.0)
    assert float(fix2["ci95_s"]) == pytest.approx(4.303 * 10.0 / math.sqrt(3))
    # The failed run is flagged and left out; the two complete ones reach 1.0 at 200 s.
    assert (fix4["runs"], fix4["reached"], fix4["excluded"]) == ("2/3", "2/2", "fix4-s2 (failed)")
    assert float(fix4["sim_s_to_1"]) == 200.0 and float(fix4["vs_best_fixed"]) == pytest.approx(200 / 110)
    assert float(fix2["vs_best_fixed"]) == 1.0
    # MQGrad's seed 1 never reaches the target: counted, and no ratio from one lucky seed.
    assert mq["reached"] == "1/2" and float(mq["sim_s_to_1"]) == 80.0 and mq["vs_best_fixed"] == "N/A"
    assert float(fix2["sent_MB"]) == pytest.approx(20 * 2000 / 1e6)
    # Loss at 50 s: Fix 2 seeds at iterations 4, 3, 3 (ends at 50, 44, 48 s): 1.5, 1.6, 1.6.
    assert float(fix2["loss@50s"]) == pytest.approx((1.5 + 1.6 + 1.6) / 3)
    assert float(fix2["acc%@50s"]) == pytest.approx(54.0)     # the evaluation at iteration 4 (50 s)


def test_compare_text_notes_partial_means_and_plots(grid, tmp_path, capsys):
    files = grid["fix2"] + grid["mq"]
    png = tmp_path / "cmp.png"
    code, out, _ = cli(capsys, "compare", *files, "--target-loss", "1.0", "--plot", png)
    assert code == 0
    assert "some runs never reached the target" in out and "MQGrad" in out.splitlines()[-2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    code, out, _ = cli(capsys, "compare", *files, "--target-loss", "1.0", "--format", "markdown")
    assert out.splitlines()[0].startswith("| method | runs | reached |")


def test_compare_of_mixed_runs_fits_a_terminal_and_its_plot_shows_everything(tmp_path, capsys, monkeypatch):
    """Long group labels: the text table fits COLUMNS, with the labels in a key below it; the
    plot's legend and loss axis label lie inside the figure, and runs evaluated once, at their
    end, are dots in the accuracy panel."""
    from mpigrad.analysis import plots

    networks = [{"bandwidth": "10MB/s@0s,100MB/s@30s", "servers": "colocated", "pipeline": True, "shard_chunk": 0},
                {"bandwidth": "10MB/s", "servers": 1, "pipeline": False, "shard_chunk": 0},
                {"bandwidth": "10MB/s", "servers": "colocated", "pipeline": False, "shard_chunk": 32768},
                {"bandwidth": "10MB/s", "servers": 1, "pipeline": False, "shard_chunk": 0, "net_mode": "off"}]
    runs = [write(tmp_path / f"r{k}.h5", bits=2 + 2 * (k == 3), iterations=5, network=net)  # evaluated at its end
            for k, net in enumerate(networks)]
    figures = []
    monkeypatch.setattr(plots, "finish", lambda figure, *args, finish=plots.finish: figures.append(figure)
                        or finish(figure, *args))
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli(capsys, "compare", *runs, "--target-loss", "1.0", "--smooth", "5", "--plot", tmp_path / "c.png")
    table = [line for line in out.splitlines() if not line.startswith("wrote ")]  # a path stays whole
    assert code == 0 and max(map(len, table)) <= 80, out
    assert out.splitlines()[1].startswith("Fix (2-bit) [1] ") and "[1] Fix (2-bit) bandwidth=10MB/s@0s,100MB/s@30s" in out
    figure, = figures
    renderer = figure.canvas.get_renderer()
    loss, accuracy = figure.axes
    target, = [line for line in loss.get_lines() if line.get_label() == "target loss 1"]
    assert set(target.get_ydata()) == {1.0}      # --target-loss drawn across the loss panel
    curves = [line for line in loss.get_lines() if line is not target]
    assert len({str(line._unscaled_dash_pattern) for line in curves}) == min(len(curves), 4)  # equal curves show
    for text in (figure.legends[0], loss.yaxis.label):
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= figure.bbox.width and 0 <= box.y0 and box.y1 <= figure.bbox.height
    panel, label = loss.get_window_extent(renderer), loss.yaxis.label.get_window_extent(renderer)
    assert panel.y0 <= label.y0 and label.y1 <= panel.y1       # the loss axis label along its panel, whole
    dots = [line for line in accuracy.get_lines() if line.get_marker() == "o"]
    assert [len(line.get_xdata()) for line in dots] == [1, 1, 1, 1]
    assert [line.get_ydata()[0] for line in dots] == pytest.approx([54.0] * 4)   # 100 * (0.5 + 0.01 * 4)
    # one run had no network model (net_mode off): its time is the wall clock's, and both say so
    assert accuracy.get_xlabel() == "Time (simulated or wall clock) (s)"
    assert "sim_s_to_1" not in out
    assert "some groups were timed by the simulated clock and some by the wall clock" in " ".join(out.split())


def test_runs_without_a_network_model_are_timed_by_the_wall_clock_everywhere(tmp_path, capsys, monkeypatch):
    """net_mode off (bench peers' DDP runs, lab runs timed by the wire): sim_time is the wall
    clock, and compare's column, its plot's axis and trace info call it that."""
    from mpigrad.analysis import plots

    runs = [write(tmp_path / f"w{b}.h5", bits=b, iterations=5, network={"net_mode": "off"}) for b in (2, 4)]
    figures = []
    monkeypatch.setattr(plots, "finish", lambda figure, *args, finish=plots.finish: figures.append(figure)
                        or finish(figure, *args))
    code, out, _ = cli(capsys, "compare", *runs, "--target-loss", "1.9", "--plot", tmp_path / "w.png")
    assert code == 0 and "wall_s_to_1.9" in out.splitlines()[0] and "sim_s_to" not in out, out
    assert "simulated" not in out
    assert figures[0].axes[-1].get_xlabel() == "Wall-clock time (s)"
    code, out, _ = cli(capsys, "info", runs[0])
    duration, = [line for line in out.splitlines() if line.startswith("duration")]
    assert code == 0 and duration.split(None, 1)[1] == "50.0 s wall clock (no network model: net_mode off)"
    code, out, _ = cli(capsys, "info", write(tmp_path / "sim.h5", iterations=5))
    duration, = [line for line in out.splitlines() if line.startswith("duration")]
    assert duration.split(None, 1)[1] == "50.0 s simulated, 50.0 s wall clock"


def test_compare_warns_once_per_group_that_mixes_cpus_or_library_versions(tmp_path, capsys):
    epyc = {"cpu": "AMD EPYC", "torch_cpu_capability": "AVX512", "torch": "2.13.0+cpu"}
    xeon = {**epyc, "cpu": "Intel(R) Xeon(R) Gold 6248", "torch_cpu_capability": "AVX2"}
    same = [write(tmp_path / f"a{s}.h5", seed=s, machine=epyc) for s in range(2)]
    mixed = [write(tmp_path / "b0.h5", bits=4, seed=0, machine=epyc),
             write(tmp_path / "b1.h5", bits=4, seed=1, machine=xeon),
             write(tmp_path / "b2.h5", bits=4, seed=2)]                 # an older trace: cpu not recorded
    code, out, err = cli(capsys, "compare", *same, *mixed, "--target-loss", "1.0", "--format", "csv")
    assert code == 0 and len(pd.read_csv(io.StringIO(out))) == 2
    assert err.splitlines() == [
        "warning: Fix (4-bit): runs from different machines or libraries (cpu AMD EPYC / Intel(R) Xeon(R) "
        "Gold 6248; torch_cpu_capability AVX2 / AVX512): the same seed agrees only within float noise across them"]


def test_compare_by_key_and_lr_labels(tmp_path, capsys):
    files = [write(tmp_path / f"lr{lr}-s{s}.h5", lr=lr, seed=s, slope=lr * 10) for lr in (0.01, 0.02) for s in (0, 1)]
    code, out, _ = cli(capsys, "compare", *files, "--target-loss", "1.0", "--format", "csv")
    methods = pd.read_csv(io.StringIO(out))["method"].tolist()
    assert methods == ["Fix (2-bit) lr=0.01", "Fix (2-bit) lr=0.02"]
    code, out, _ = cli(capsys, "compare", *files, "--target-loss", "1.0", "--by", "seed", "--format", "csv")
    table = pd.read_csv(io.StringIO(out))
    assert table["method"].tolist() == ["Fix (2-bit) seed=0", "Fix (2-bit) seed=1"]
    assert table["runs"].tolist() == ["2/2", "2/2"]
    code, _, err = cli(capsys, "compare", *files, "--target-loss", "1.0", "--by", "nope")
    assert code == 2 and "--by nope" in err


def test_runs_with_different_configs_get_different_labels_everywhere(tmp_path, capsys):
    a = write(tmp_path / "a.h5", lr=0.01, seed=1)
    b = write(tmp_path / "b.h5", lr=0.05, seed=1)
    c = write(tmp_path / "c.h5", lr=0.05, seed=2)
    code, out, _ = cli(capsys, "summary", a, b, c, "--format", "csv")
    assert pd.read_csv(io.StringIO(out))["method"].tolist() == [
        "Fix (2-bit) lr=0.01", "Fix (2-bit) lr=0.05 seed=1", "Fix (2-bit) lr=0.05 seed=2"]
    code, out, _ = cli(capsys, "table", a, b, "--at", "50s")
    assert [line.split("  ")[0] for line in out.splitlines()[1:-1]] == ["Fix (2-bit) lr=0.01", "Fix (2-bit) lr=0.05"]
    # Method options show only where the labels would clash.
    configs = [{"policy": "mqgrad", "policy_opts": {"epsilon": e}} for e in (0.1, 0.2)]
    assert group_labels(configs) == ["MQGrad policy_opts.epsilon=0.1", "MQGrad policy_opts.epsilon=0.2"]
    assert group_labels([{"policy": "mqgrad", "policy_opts": {"T": 5}}, {"policy": "fixed", "bits": 4}]) == \
        ["MQGrad", "Fix (4-bit)"]


def test_a_key_an_older_trace_lacks_takes_its_default():
    """Traces written before ``servers`` and ``shard_chunk`` existed group with new traces of
    the same config (the defaults keep the old behaviour); an explicit other value does not."""
    from mpigrad.analysis.labels import differing_keys
    old = {"policy": "fixed", "bits": 2, "lr": 0.04, "seed": 1}
    new = {**old, "servers": 1, "shard_chunk": 0, "seed": 2}
    assert differing_keys([old, new]) == []
    assert len(set(group_labels([old, new]))) == 1
    assert differing_keys([old, {**new, "servers": 2}]) == ["servers", "shard_chunk"]
    # shard_chunk's default became auto, which keeps whole layers with one server as 0 did:
    # a one-server trace written with 0 groups with one written with auto; with two it does not
    assert differing_keys([{**new, "shard_chunk": "auto"}, new]) == []
    two = {**new, "servers": 2}
    assert differing_keys([two, {**two, "shard_chunk": "auto"}]) == ["shard_chunk"]


def test_configs_not_written_by_train_are_taken_as_written():
    from mpigrad.analysis.labels import flat_config
    api = {"codec": {"id": "uniform", "bits": 2}, "note": "TraceWriter API"}
    assert flat_config(api) == {"codec.id": "uniform", "codec.bits": 2, "note": "TraceWriter API"}
    assert flat_config({"lr": 0.1})["servers"] == 1


def test_compare_ratios_to_fp32_and_to_the_best_fixed_width(grid, tmp_path, capsys):
    """FP32 is vs_fp32's reference; FP32, FP16 and low rank are baselines, never the best
    fixed width, even when faster than every width."""
    fp32 = [write(tmp_path / f"fp32-s{s}.h5", codec="fp32", bits=32, seed=s, seconds_per_iteration=20.0 + s)
            for s in range(3)]
    fp16 = [write(tmp_path / f"fp16-s{s}.h5", codec="fp16", bits=16, seed=s, seconds_per_iteration=5.0)
            for s in range(3)]
    files = grid["fix2"] + grid["fix4"][:2] + fp32 + fp16
    code, out, _ = cli(capsys, "compare", *files, "--target-loss", "1.0", "--format", "csv")
    table = pd.read_csv(io.StringIO(out), keep_default_na=False).set_index("method")
    assert code == 0 and list(table.columns[:9]) == ["runs", "reached", "sim_s_to_1", "ci95_s", "vs_fp32",
                                                     "vs_best_fixed", "vs_best_ddp", "sent_MB", "excluded"]
    assert float(table.loc["FP32", "sim_s_to_1"]) == pytest.approx(210.0)
    assert float(table.loc["Fix (2-bit)", "vs_fp32"]) == pytest.approx(110 / 210)
    assert float(table.loc["FP16", "vs_fp32"]) == pytest.approx(50 / 210)
    assert float(table.loc["FP16", "vs_best_fixed"]) == pytest.approx(50 / 110)   # not itself the reference
    assert float(table.loc["Fix (2-bit)", "vs_best_fixed"]) == 1.0
    assert set(table["vs_best_ddp"]) == {"N/A"}                                   # no DDP runs given
