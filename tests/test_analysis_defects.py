"""Issue 64's analysis defects: damaged traces in multi-file actions, runs whose losses are
different quantities, compare's key and notes, unique run names, and the plots' readability."""

from __future__ import annotations

import faulthandler
import random
import sys
import types
from pathlib import Path

import pytest

from mpigrad.cli import main
from mpigrad.trace import TraceWriter, default_tables
from test_compare import write


def cli(capsys, *args):
    code = main(["trace", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- item 3: a trace damaged anywhere ---------------------------------------------------------
def test_every_damaged_block_is_one_line_and_the_good_file_goes_on(tmp_path, capsys):
    """Each 256-byte block of a small closed trace overwritten (0xFF, then random bytes): given
    with a good trace, summary and compare either report the damaged file in one stderr line
    and exit 1 with the good run's row, or (a block HDF5 never reads: free space) print what
    they print for the undamaged file. Never a traceback, never a hang (HDF5 loops forever on
    some damaged global heaps: reader._check_global_heaps)."""
    # A regression of the heap check hangs inside HDF5, where no exception reaches: end the
    # process with every thread's traceback instead, so that the run fails and says where.
    faulthandler.dump_traceback_later(600, exit=True, file=sys.__stderr__)
    try:
        _scan_every_block(tmp_path, capsys)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _scan_every_block(tmp_path, capsys):
    good = write(tmp_path / "good.h5", iterations=6, seed=0)
    original = write(tmp_path / "orig.h5", iterations=6, seed=1, bits=4).read_bytes()
    damaged = tmp_path / "damaged.h5"
    actions = {"summary": ["summary"], "compare": ["compare", "--target-loss", "1.5"]}
    damaged.write_bytes(original)
    intact = {name: cli(capsys, *action, damaged, good) for name, action in actions.items()}
    assert all(code == 0 for code, _, _ in intact.values())
    reported = 0
    for fill in ("ff", "random"):
        for offset in range(0, len(original), 256):
            data = bytearray(original)
            size = len(data[offset:offset + 256])
            data[offset:offset + 256] = b"\xff" * size if fill == "ff" else random.Random(offset).randbytes(size)
            damaged.write_bytes(bytes(data))
            for name, action in actions.items():
                code, out, err = cli(capsys, *action, damaged, good)
                if (code, out, err) == intact[name]:
                    continue
                where = f"{fill} block at {offset}, {name}"
                assert code == 1 and len(err.splitlines()) == 1, (where, code, err)
                assert err.startswith("mpigrad trace: error: ") and str(damaged) in err, (where, err)
                assert "Fix (2-bit)" in out or "good" in out, (where, out)   # the good run's row
                assert "Fix (4-bit)" not in out, (where, out)
                reported += 1
    assert reported > len(original) // 256  # most blocks are read, and caught


# ---- item 4: loss quantities --------------------------------------------------------------------
def write_decay(path: Path, weight_decay_in: str, *, slope=0.1, seconds=10.0, seed=0, weight_decay=0.004, **config):
    """A ``write`` run of config ``weight_decay``/``weight_decay_in`` (and ``config``)."""
    writer = TraceWriter(path, config={"policy": "fixed", "bits": 2, "lr": 0.01, "seed": seed, "codec": "uniform",
                                       "weight_decay": weight_decay, "weight_decay_in": weight_decay_in, **config},
                         tables=default_tables(2), flush_every=50)
    for i in range(10):
        loss = 2.0 - slope * (i + 1)
        writer.append("steps", {"iteration": i, "wall_time": seconds * (i + 1), "sim_time": seconds * (i + 1),
                                "loss": loss, "bits": 2, "bytes_up": 10, "bytes_down": 10, "t_compute": 0.0,
                                "t_encode": 0.0, "t_decode": 0.0, "t_comm": 1.0, "t_policy": 0.0})
    writer.close()
    return path


def test_compare_never_ranks_losses_of_different_quantities_on_one_target(tmp_path, capsys):
    l2 = [write_decay(tmp_path / f"l2-{s}.h5", "loss", seed=s, seconds=10.0) for s in range(2)]
    adamw = [write_decay(tmp_path / f"adamw-{s}.h5", "optimizer", seed=s, seconds=20.0, optimizer="adamw")
             for s in range(2)]
    code, out, _ = cli(capsys, "compare", *l2, *adamw, "--target-loss", "1.5")
    assert code == 0
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()[1:3]}
    assert any("[loss+l2]" in label for label in rows) and any("[loss]" in label for label in rows), out
    for line in rows.values():  # each group is its own quantity's best fixed width: 1.00, not 2.00
        assert " 1.00 " in line and " 2.00 " not in line, line
    note, = [line for line in out.splitlines() if "different quantities" in line]
    assert "training loss + l2: " in note and "training loss: " in note
    fastest, = [line for line in out.splitlines() if line.startswith("* fastest")]
    assert fastest.count("simulated s)") == 2   # one per quantity


def test_plot_loss_axis_says_what_the_losses_measure(tmp_path, capsys, monkeypatch):
    from mpigrad.analysis import plots

    figures = []
    monkeypatch.setattr(plots, "finish", lambda figure, *args, finish=plots.finish: figures.append(figure)
                        or finish(figure, *args))
    l2 = write_decay(tmp_path / "l2.h5", "loss")
    adamw = write_decay(tmp_path / "adamw.h5", "optimizer", optimizer="adamw")
    plain = write_decay(tmp_path / "plain.h5", "loss", weight_decay=0.0, seed=1)
    script = write_decay(tmp_path / "script.h5", "loss", weight_decay=0.0, model="script Net", data="script")
    for files, name in (([l2], "Training loss + l2"), ([adamw, plain], "Training loss"),
                        ([script], "Training loss (the script's)"), ([l2, adamw], "differs by run")):
        assert cli(capsys, "plot", *files, "-o", tmp_path / "p.png")[0] == 0
        assert name in figures[-1].axes[0].get_ylabel()
        assert cli(capsys, "compare", *files, "--target-loss", "1.5", "--plot", tmp_path / "c.png")[0] == 0
        assert name in figures[-1].axes[0].get_ylabel()
    legend = [text.get_text() for text in figures[-1].legends[0].get_texts()]
    assert any("[loss+l2]" in text for text in legend) and any("[loss]" in text for text in legend)


@pytest.mark.parametrize("decay, where, script, name", [(0.004, "loss", False, "loss+l2"),
                                                        (0.004, "optimizer", False, "loss"),
                                                        (0.0, "loss", False, "loss"), (0.0, "loss", True, "loss")])
def test_progress_line_names_the_loss_it_shows(decay, where, script, name):
    from mpigrad.config import RunConfig
    from mpigrad.runtime.roles.server import ParameterServer

    config = RunConfig(weight_decay=decay, weight_decay_in=where, iterations=10)
    server = types.SimpleNamespace(config=config, script=script, last_eval=None, bytes_total=0,
                                   _mean_iteration_seconds=lambda done: 1.0,
                                   clock=types.SimpleNamespace(clocks=types.SimpleNamespace(now_wall=lambda: 1.0)))
    record = types.SimpleNamespace(iteration=4, bits=[2], lr=None, loss=1.25, sim_time=3.0)
    line = ParameterServer.progress_line(server, record)
    assert f"  {name} 1.2500  " in line, line


# ---- item 10: compare's key and notes, unique run names ------------------------------------
def test_compare_key_explains_columns_and_says_when_nothing_reached(tmp_path, capsys):
    run = write(tmp_path / "slow.h5", slope=0.01)
    code, out, _ = cli(capsys, "compare", run, "--target-loss", "1.0")
    assert code == 0
    assert "the runs that did" not in out
    assert "* no run reached the target 1, so no time to it; the lowest smoothed loss of their runs: " \
           "Fix (2-bit) (lowest 1.8)" in out
    ci, = [line for line in out.splitlines() if line.startswith("ci95_s: ")]
    assert "fewer than 2 runs" in ci and "one seed" in ci
    assert out.splitlines()[2].startswith("key: runs: ")
    fast = [write(tmp_path / f"fast-{s}.h5", seed=s, bits=4) for s in range(2)]
    out = cli(capsys, "compare", run, *fast, "--target-loss", "1.0")[1]
    assert "* fastest to the target 1 (" in out and ": Fix (4-bit) (100.0 simulated s)" in out
    assert "key:" not in cli(capsys, "compare", run, "--target-loss", "1.0", "--format", "csv")[1]


def test_summary_names_files_of_one_name_by_their_folders(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "ck").mkdir()
    first = write(tmp_path / "runs" / "mqgrad.h5", seed=0)
    second = write(tmp_path / "ck" / "mqgrad.h5", seed=0)
    code, out, _ = cli(capsys, "summary", first, second)
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["runs/mqgrad", "ck/mqgrad"]
    assert "(runs/mqgrad)" in out and "(ck/mqgrad)" in out      # the method labels, too


# ---- item 13: plots and info ----------------------------------------------------------------
def test_plot_has_a_title_integer_bit_ticks_and_distinct_styles(tmp_path, capsys, monkeypatch):
    from mpigrad.analysis import plots

    figures = []
    monkeypatch.setattr(plots, "finish", lambda figure, *args, finish=plots.finish: figures.append(figure)
                        or finish(figure, *args))
    runs = [write(tmp_path / f"r{k}.h5", seed=k) for k in range(3)]   # equal curves, 2 bits each
    assert cli(capsys, "plot", *runs, "-o", tmp_path / "p.png")[0] == 0
    figure, = figures
    assert figure.get_suptitle() == "3 runs"
    loss, accuracy, bits = figure.axes
    ticks = [t for t in bits.get_yticks() if bits.get_ylim()[0] <= t <= bits.get_ylim()[1]]
    assert ticks == [2.0]
    assert len({str(line._unscaled_dash_pattern) for line in loss.get_lines()}) == 3
    assert figure.legends[0].get_texts()[0].get_fontsize() > 9


def test_info_prints_seconds_as_durations(tmp_path, capsys):
    path = tmp_path / "t.h5"
    writer = TraceWriter(path, config={}, attrs={"trace_seconds": 6.450000000324252e-06}, tables=default_tables(2))
    writer.append("steps", {"iteration": 0, "wall_time": 1.0, "sim_time": 1.0, "loss": 1.0, "bits": 2, "bytes_up": 1,
                            "bytes_down": 1, "t_compute": 0.0, "t_encode": 0.0, "t_decode": 0.0, "t_comm": 0.0,
                            "t_policy": 0.0})
    writer.close()
    out = cli(capsys, "info", path)[1]
    line, = [line for line in out.splitlines() if line.startswith("trace_seconds")]
    assert line.split()[-1] == "6.45us"


# ---- item 9: a run that diverges to chance says so --------------------------------------------
def test_an_evaluation_at_chance_past_the_start_warns_once():
    from mpigrad.config import RunConfig
    from mpigrad.runtime.roles.evaluation import not_learning_warning
    from mpigrad.runtime.roles.server import ParameterServer

    config = RunConfig(iterations=300, lr=0.2)
    assert not_learning_warning(49, 0.1, 10, config) is None        # too early: iteration 50
    assert not_learning_warning(99, 0.30, 10, config) is None       # learning
    line = not_learning_warning(99, 0.098, 10, config)
    assert line == ("mpigrad: warning: test accuracy 0.098 after iteration 100 is chance level (10 classes): "
                    "the run is not learning; a lower --lr may help (lr 0.2)")
    assert not_learning_warning(99, 0.098, 10, RunConfig(iterations=1000, lr=0.2)) is None  # a quarter: 250
    logged = []
    clocks = types.SimpleNamespace(pause=lambda: None, resume=lambda: None, now_wall=lambda: 1.0, sim=2.0)
    server = types.SimpleNamespace(config=config, clock=types.SimpleNamespace(clocks=clocks), replica=None,
                                   dataset=types.SimpleNamespace(num_classes=10), warned_not_learning=False,
                                   log=logged.append)
    import mpigrad.runtime.roles.evaluation as evaluation_module

    evaluate = evaluation_module.evaluate
    evaluation_module.evaluate = lambda replica, dataset, config: (2.3, 0.1)
    try:
        for m in (99, 149, 199):
            ParameterServer.evaluate(server, m)
    finally:
        evaluation_module.evaluate = evaluate
    assert logged == [not_learning_warning(99, 0.1, 10, config)]
