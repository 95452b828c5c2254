"""What `mpigrad trace` shows a reader: config values in the units a user writes them, legends
that cover no curve, loss axes that say the l2 term is in, and `compare` ratios that never
mix network models without saying so."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pytest

from mpigrad.analysis import compare as compare_module
from mpigrad.analysis import plots
from mpigrad.analysis.labels import group_labels
from mpigrad.cli import main
from mpigrad.trace import TraceWriter, default_tables


def write(path: Path, *, policy="fixed", bits=2, seed=0, seconds_per_iteration=10.0, **config) -> Path:
    """A 20-iteration run whose loss falls from 1.9 by 0.1 per iteration, evaluated every 5."""
    config = {"policy": policy, "bits": bits, "seed": seed, "codec": "uniform", "trace": str(path), **config}
    writer = TraceWriter(path, config=config, attrs={"seed": seed}, tables=default_tables(2), flush_every=50)
    for i in range(20):
        sim, loss = (i + 1) * seconds_per_iteration, 1.9 - 0.1 * i
        writer.append("steps", {"iteration": i, "wall_time": sim, "sim_time": sim, "loss": loss, "bits": bits,
                                "bytes_up": 1000, "bytes_down": 1000, "t_compute": 0.0, "t_encode": 0.0,
                                "t_decode": 0.0, "t_comm": 1.0, "t_policy": 0.0})
        writer.append("workers", {"iteration": i, "loss": [loss, loss], "t_compute": [0.0, 0.0],
                                  "bytes_sent": [500, 500]})
        if i % 5 == 4:
            writer.append("eval", {"iteration": i, "wall_time": sim, "sim_time": sim, "test_loss": loss,
                                   "test_accuracy": 0.5 + 0.01 * i})
    writer.close("complete")
    return path


def cli(capsys, *args):
    code = main(["trace", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_labels_show_rates_and_durations_in_their_units():
    configs = [{"policy": "fixed", "bits": 2, "bandwidth": 1e7, "latency": 5e-4},
               {"policy": "mqgrad", "bandwidth": 1.25e8, "latency": 0.0, "iterations": 300}]
    assert group_labels(configs) == ["Fix (2-bit) bandwidth=10MB/s, latency=0.5ms",
                                     "MQGrad bandwidth=125MB/s, latency=0s"]


def test_summary_names_runs_by_their_rate(tmp_path, capsys):
    a = write(tmp_path / "slow.h5", bandwidth=1e7)
    b = write(tmp_path / "fast.h5", bandwidth=1.25e8)
    code, out, _ = cli(capsys, "summary", a, b, "--format", "csv")
    assert code == 0
    assert pd.read_csv(io.StringIO(out))["method"].tolist() == ["Fix (2-bit) bandwidth=10MB/s",
                                                                "Fix (2-bit) bandwidth=125MB/s"]


def _figures(monkeypatch) -> list:
    """Collects the figures the plots save (plots.finish is where both save)."""
    saved = []
    finish = plots.finish

    def keep(figure, axes, output, title):
        saved.append((figure, list(axes)))
        return finish(figure, axes, output, title)

    monkeypatch.setattr(plots, "finish", keep)
    return saved


def _assert_legends_cover_no_panel(figure, axes):
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = list(figure.legends) + [ax.get_legend() for ax in axes if ax.get_legend()]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_ylabel()


def test_plot_legends_sit_outside_the_panels_and_the_loss_axis_names_l2(tmp_path, capsys, monkeypatch):
    runs = [write(tmp_path / f"run{k}.h5", bits=b, bandwidth=bw) for k, (b, bw) in
            enumerate([(2, 1e7), (4, 1e7), (8, 1e7), (2, 1.25e8)])]
    saved = _figures(monkeypatch)
    assert cli(capsys, "plot", *runs, "-o", tmp_path / "fig.png")[0] == 0
    assert cli(capsys, "compare", *runs, "--target-loss", "1.0", "--plot", tmp_path / "cmp.png")[0] == 0
    assert len(saved) == 2
    for figure, axes in saved:
        _assert_legends_cover_no_panel(figure, axes)
        assert axes[0].get_ylabel() == "Training loss + l2"


def test_compare_ratios_stay_within_one_network_model_and_say_so(tmp_path, capsys):
    runs = [write(tmp_path / "fix2-slow.h5", bandwidth=1e7, seconds_per_iteration=10.0),
            write(tmp_path / "fix2-fast.h5", bandwidth=1.25e8, seconds_per_iteration=2.0),
            write(tmp_path / "mq-slow.h5", policy="mqgrad", bandwidth=1e7, seconds_per_iteration=8.0)]
    code, out, _ = cli(capsys, "compare", *runs, "--target-loss", "1.0", "--format", "csv")
    table = pd.read_csv(io.StringIO(out)).set_index("method")
    # MQGrad at 10 MB/s against Fix 2 at 10 MB/s (80 s / 100 s), not against the 125 MB/s run.
    assert table.loc["MQGrad bandwidth=10MB/s", "vs_best_fixed"] == pytest.approx(0.8)
    assert table.loc["Fix (2-bit) bandwidth=125MB/s", "vs_best_fixed"] == pytest.approx(1.0)
    code, out, _ = cli(capsys, "compare", *runs, "--target-loss", "1.0")
    assert ("* the groups ran on different network models; vs_best_fixed compares each with the best "
            "fixed-bits group on its own (bandwidth=10MB/s | bandwidth=125MB/s)") in out
    code, out, _ = cli(capsys, "compare", *runs[:1], runs[2], "--target-loss", "1.0")
    assert "network models" not in out
    assert compare_module.NETWORK_KEYS[0] == "bandwidth"


def test_a_codec_without_a_width_is_labelled_without_one(tmp_path, capsys):
    """A run of a plugin codec records the config's default bits (2), which it never used:
    ``trace info`` and ``summary`` name it "Fix [TopK]", not "Fix (2-bit) [TopK]"."""
    path = write(tmp_path / "topk.h5", codec="topk:TopK", codec_opts={"ratio": 0.1})
    for action in ("info", "summary"):
        code, out, err = cli(capsys, action, path)
        assert code == 0 and "Fix [TopK]" in out and "2-bit" not in out, out + err
    assert group_labels([{"policy": "fixed", "codec": "sign", "bits": 2}]) == ["Fix [sign]"]
    assert group_labels([{"policy": "fixed", "codec": "qsgd", "bits": 4}]) == ["Fix (4-bit) [qsgd]"]


def test_the_codecs_labelled_by_a_width_are_those_a_policy_sets():
    from mpigrad.codecs import available, codec_class
    from mpigrad.trace.reader import WIDTH_CODECS

    assert WIDTH_CODECS == tuple(sorted(c for c in available() if codec_class(c).accepts_bits))
