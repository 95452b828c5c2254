"""`mpigrad trace` and mpigrad.analysis: golden summaries and tables on small traces built here,
plots, CSV export, the error cases, and analysis without MPI."""

from __future__ import annotations

import io
import re
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from mpigrad.analysis import (AnalysisError, compression_ratio, overhead_fraction, parse_points,
                              summarize, time_to_target)
from mpigrad.analysis.tables import Point
from mpigrad.cli import main
from mpigrad.trace import SCHEMA_VERSION, TraceWriter, default_tables, load

FIX2_LOSS = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3, 1.2, 1.1]
MQGRAD_LOSS = [2.0, 1.92, 1.84, 1.76, 1.68, 1.6, 1.52, 1.44, 1.36, 1.28,
               1.2, 1.12, 1.04, 0.96, 0.88, 0.8, 0.72, 0.64, 0.56, 0.6]


def write_run(path: Path, *, config: dict, attrs: dict, loss: list[float], wall_step: float,
              bits, bytes_each_way, t_encode: float, t_decode: float, t_policy: float,
              evals: dict[int, tuple[float, float]]) -> Path:
    """A 2-worker run whose iteration i ends at sim_time (i + 1) * 1800 s (half an hour)."""
    writer = TraceWriter(path, config=config, attrs=attrs, tables=default_tables(2), flush_every=8)
    for i, value in enumerate(loss):
        sim, wall = (i + 1) * 1800.0, (i + 1) * wall_step
        writer.append("steps", {"iteration": i, "wall_time": wall, "sim_time": sim, "loss": value,
                                "bits": bits(i), "bytes_up": bytes_each_way(i), "bytes_down": bytes_each_way(i),
                                "t_compute": 1.0, "t_encode": t_encode, "t_decode": t_decode,
                                "t_comm": 10.0, "t_policy": t_policy})
        writer.append("workers", {"iteration": i, "loss": [value, value], "t_compute": [1.0, 1.0],
                                  "bytes_sent": [bytes_each_way(i) // 2] * 2})
        if i in evals:
            test_loss, accuracy = evals[i]
            writer.append("eval", {"iteration": i, "wall_time": wall, "sim_time": sim,
                                   "test_loss": test_loss, "test_accuracy": accuracy})
    writer.close()
    return path


def write_sample_runs(folder: Path) -> dict[str, Path]:
    """fix2.h5 and mqgrad.h5, the two runs docs/trace.rst shows the commands' outputs for."""
    fix2 = write_run(folder / "fix2.h5",
                     config={"codec": {"id": "uniform", "bits": 2}, "policy": {"id": "fixed", "bits": 2},
                             "workers": 2},
                     attrs={"float32_bytes_per_iteration": 800_000, "argv": "mpigrad train --bits 2",
                            "seed": 3},
                     loss=FIX2_LOSS, wall_step=100.0, bits=lambda i: 2, bytes_each_way=lambda i: 100_000,
                     t_encode=27.0, t_decode=9.0, t_policy=0.0, evals={4: (1.0, 0.5), 9: (0.9, 0.6)})
    mqgrad = write_run(folder / "mqgrad.h5",
                       config={"codec": {"id": "uniform", "bits": 2}, "policy": {"id": "mqgrad"}, "workers": 2},
                       attrs={}, loss=MQGRAD_LOSS, wall_step=200.0, bits=lambda i: 2 + i // 5,
                       bytes_each_way=lambda i: 50_000 * (2 + i // 5), t_encode=9.0, t_decode=9.0,
                       t_policy=36.0, evals={4: (1.2, 0.45), 9: (1.0, 0.55), 14: (0.8, 0.65), 19: (0.7, 0.70)})
    return {"fix2": fix2, "mqgrad": mqgrad}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("runs")
    samples = write_sample_runs(folder)
    empty_path = folder / "empty.h5"
    TraceWriter(empty_path, config={"policy": {"id": "adaptive"}}, tables=default_tables(2)).close()
    return {**samples, "empty": empty_path}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["trace", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- summary ---------------------------------------------------------------------------------------
SUMMARY_GOLDEN = """\
run     method       status    iterations  final_loss  best_loss  best_acc_%  total_MB  ratio_vs_fp32  sim_time_s  wall_time_s  sim_s_to_1.5  wall_s_to_1.5  quant_%_sim
fix2    Fix (2-bit)  complete          10         1.1        1.1        60.0       2.0           4.00     18000.0       1000.0       10800.0          600.0         2.00
mqgrad  MQGrad       complete          20         0.6       0.56        70.0       7.0            N/A     36000.0       4000.0       14400.0         1600.0         3.00
"""


def test_summary_golden(runs, capsys):
    code, out, err = cli(capsys, "summary", runs["fix2"], runs["mqgrad"], "--target-loss", "1.5")
    assert (code, err) == (0, "")
    assert out == SUMMARY_GOLDEN


def test_summary_csv_markdown_and_wall_clock(runs, capsys):
    code, out, _ = cli(capsys, "summary", runs["fix2"], runs["mqgrad"], "--format", "csv", "--clock", "wall")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("run,method,status,iterations,final_loss,best_loss,best_acc_%,total_MB,ratio_vs_fp32,"
                        "sim_time_s,wall_time_s,quant_%_wall")
    assert lines[1] == "fix2,Fix (2-bit),complete,10,1.1,1.1,60.0,2.0,4.0,18000.0,1000.0,36.0"
    assert lines[2].startswith("mqgrad,MQGrad,complete,20,0.6,0.56")  # full precision in CSV
    assert lines[2].endswith(",N/A,36000.0,4000.0,27.0")
    frame = pd.read_csv(io.StringIO(out))
    assert frame["ratio_vs_fp32"].isna().tolist() == [False, True]
    code, out, _ = cli(capsys, "summary", runs["fix2"], "--format", "markdown")
    assert out.splitlines()[1] == "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert out.splitlines()[2].startswith("| fix2 | Fix (2-bit) | complete | 10 | 1.1 |")


def test_summary_functions(runs):
    fix2, mqgrad = load(runs["fix2"]), load(runs["mqgrad"])
    assert compression_ratio(fix2) == 4.0 and compression_ratio(mqgrad) is None
    assert overhead_fraction(fix2, "sim") == pytest.approx(0.02)
    assert overhead_fraction(mqgrad, "wall") == pytest.approx(1080 / 4000)
    assert time_to_target(mqgrad, 1.5, "sim") == 14400.0
    assert time_to_target(mqgrad, 0.1, "sim") is None
    # A 3-iteration trailing mean reaches 1.5 later: mean(1.6, 1.52, 1.44) = 1.52, mean(1.52, 1.44, 1.36) = 1.44.
    assert time_to_target(mqgrad, 1.5, "sim", smooth=3) == 9 * 1800.0
    row = summarize(mqgrad, smooth=2)
    assert row["final_loss"] == pytest.approx(0.58) and row["best_loss"] == pytest.approx(0.58)
    with pytest.raises(AnalysisError, match="at least 1"):
        summarize(mqgrad, smooth=0)


def test_duplicate_labels_get_the_run_name(runs, tmp_path, capsys):
    copy = tmp_path / "fix2-seed1.h5"
    shutil.copyfile(runs["fix2"], copy)
    code, out, _ = cli(capsys, "table", runs["fix2"], copy, "--at", "5h")
    assert code == 0
    assert out.splitlines()[1:-1] == ["Fix (2-bit) (fix2)        60.0", "Fix (2-bit) (fix2-seed1)  60.0"]


# ---- tables ----------------------------------------------------------------------------------------
TABLE_GOLDEN = """\
method       1h    5h    8h  12h
Fix (2-bit)   -  60.0   N/A  N/A
MQGrad        -  55.0  65.0  N/A
cells: the test accuracy (%) of the last evaluation at or before each point on the simulated clock; \
-: not evaluated yet; N/A: past the run's end
"""


def test_table_golden_like_the_papers_tables(runs, capsys):
    code, out, err = cli(capsys, "table", runs["fix2"], runs["mqgrad"], "--at", "1h,5h,8h,12h")
    assert (code, err) == (0, "")
    assert out == TABLE_GOLDEN


@pytest.mark.parametrize("args, expected", [
    (["--at", "5,15"], ["Fix (2-bit)  50.0    N/A", "MQGrad       45.0   65.0"]),
    (["--at", "5,15", "--iterations"], ["Fix (2-bit)  50.0    N/A", "MQGrad       45.0   65.0"]),
    (["--at", "10m,30m", "--clock", "wall"], ["Fix (2-bit)  50.0   N/A", "MQGrad          -  45.0"]),
    (["--at", "5h", "--metric", "loss"], ["Fix (2-bit)  0.9", "MQGrad         1"]),
    (["--at", "18000s,300min,0.25d"], ["Fix (2-bit)    60.0    60.0    N/A", "MQGrad         55.0    55.0   55.0"]),
])
def test_table_points_clocks_and_metrics(runs, capsys, args, expected):
    code, out, _ = cli(capsys, "table", runs["fix2"], runs["mqgrad"], *args)
    assert code == 0
    assert out.splitlines()[1:-1] == expected
    assert out.splitlines()[-1].startswith("cells: the test ")


def test_table_csv_and_markdown(runs, capsys):
    _, out, _ = cli(capsys, "table", runs["fix2"], runs["mqgrad"], "--at", "1h,5h,12h", "--format", "csv")
    assert out == "method,1h,5h,12h\nFix (2-bit),-,60.0,N/A\nMQGrad,-,55.00000000000001,N/A\n"
    _, out, _ = cli(capsys, "table", runs["fix2"], runs["mqgrad"], "--at", "5h", "--format", "markdown")
    assert out == "| method | 5h |\n|---|---:|\n| Fix (2-bit) | 60.0 |\n| MQGrad | 55.0 |\n"


def test_parse_points():
    assert parse_points("5h, 90m,30s,1.5d") == [Point("5h", 18000.0, False), Point("90m", 5400.0, False),
                                                Point("30s", 30.0, False), Point("1.5d", 129600.0, False)]
    assert parse_points("100,500") == [Point("it 100", 100.0, True), Point("it 500", 500.0, True)]
    for bad, message in [("5x", "bad point"), ("5h,100", "mixes"), ("", "empty entry"), ("5h,", "empty"),
                         ("-5h", "bad point")]:
        with pytest.raises(AnalysisError, match=message):
            parse_points(bad)
    with pytest.raises(AnalysisError, match="iteration number"):
        parse_points("5h", iterations=True)


# ---- info, export ----------------------------------------------------------------------------------
def test_info(runs, capsys):
    code, out, _ = cli(capsys, "info", runs["fix2"])
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(" "))
    assert fields["method"] == "Fix (2-bit)" and fields["status"].startswith("complete")
    assert fields["recipe"] == "sgd"  # a config without the recipe's keys: the paper's plain SGD
    assert fields["iterations"] == "10 (iteration 0 to 9)"
    assert fields["duration"] == "18000.0 s simulated, 1000.0 s wall clock"
    assert fields["argv"] == "mpigrad train --bits 2" and fields["seed"] == "3"
    assert fields["tables"] == "steps 10 rows, workers 10 rows, eval 2 rows"
    assert re.search(r'^config +codec=\{"bits": 2, "id": "uniform"\}  policy=\{"bits": 2, "id": "fixed"\}', out, re.M), out
    code, full, _ = cli(capsys, "info", runs["fix2"], "--full")
    assert code == 0 and '"policy": {' in full and '"bits": 2' in full
    code, out, _ = cli(capsys, "info", runs["empty"])  # an empty run is described, not refused
    assert code == 0 and "0 (no rows were flushed)" in out and "Adaptive" in out


def test_info_is_a_screenful_and_full_prints_every_value_whole(runs, tmp_path, capsys):
    """A long attribute (a cost model's JSON), a value of several lines (an MPI library's
    banner) and a long config value are summarised, saying so; ``--full`` prints them."""
    import h5py

    long = tmp_path / "long.h5"
    shutil.copyfile(runs["fix2"], long)
    model = {f"codec{k}": {"seconds_per_element": [1e-9 * k] * 40} for k in range(60)}
    banner = "MPICH Version: 5.0.2\n" + "\n".join(f"MPICH line {k}" for k in range(10))
    error = "rank 2 failed at iteration 13: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)"
    with h5py.File(long, "r+") as f:
        f.attrs["cost_model"] = json.dumps(model)
        f.attrs["mpi_library"] = banner
        f.attrs["status"], f.attrs["error"] = "failed", error
    code, out, _ = cli(capsys, "info", long)
    assert f"failed: {error}" in out  # what the run died of is never cut
    assert max(len(line) for line in out.splitlines() if not line.startswith("status")) <= 29 + 110, out
    assert len(out.splitlines()) < 60
    assert re.search(r"^cost_model +\{codec0, codec1, .*\}: 60 keys, \d+ characters \(--full prints them\)$", out, re.M)
    assert re.search(r"^mpi_library +MPICH Version: 5.0.2 \(and 10 more lines: --full\)$", out, re.M)
    code, full, _ = cli(capsys, "info", long, "--full")
    assert code == 0 and json.dumps(model) in full and "MPICH line 9" in full


def test_export_csv(runs, tmp_path, capsys):
    out_dir = tmp_path / "csv"
    code, out, _ = cli(capsys, "export", runs["mqgrad"], "--csv", out_dir)
    assert code == 0 and out.count("wrote") == 4
    trace = load(runs["mqgrad"])
    for table in ("steps", "workers", "eval"):
        pd.testing.assert_frame_equal(pd.read_csv(out_dir / f"{table}.csv"), trace.tables[table],
                                      check_dtype=False)
    assert json.loads((out_dir / "attrs.json").read_text())["config"]["policy"] == {"id": "mqgrad"}
    before = (out_dir / "steps.csv").read_text()
    (out_dir / "steps.csv").write_text("precious")
    code, _, err = cli(capsys, "export", runs["mqgrad"], "--csv", out_dir)
    assert code == 2 and "exists; pass --force" in err
    assert (out_dir / "steps.csv").read_text() == "precious"
    assert cli(capsys, "export", runs["mqgrad"], "--csv", out_dir, "--force")[0] == 0
    assert (out_dir / "steps.csv").read_text() == before


# ---- plots -----------------------------------------------------------------------------------------
def test_plot_png_and_pdf(runs, tmp_path, capsys):
    import matplotlib.image

    png = tmp_path / "curves.png"
    code, out, _ = cli(capsys, "plot", runs["fix2"], runs["mqgrad"], "-o", png, "--title", "12 workers")
    assert code == 0 and out == f"wrote {png}\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[1] == 960 and image.shape[0] > 900  # 6.4 in at 150 dpi, three panels
    assert image[..., :3].std() > 0.05  # something is drawn
    short = tmp_path / "short.png"
    assert cli(capsys, "plot", runs["fix2"], "-o", short, "--no-accuracy", "--x", "iteration")[0] == 0
    assert matplotlib.image.imread(short).shape[0] < image.shape[0]  # no accuracy panel
    pdf = tmp_path / "curves.pdf"
    assert cli(capsys, "plot", runs["fix2"], runs["mqgrad"], "-o", pdf, "--x", "wall", "--smooth", "3")[0] == 0
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5000


# ---- errors: exit code 2, one line, no traceback -----------------------------------------------------
@pytest.fixture(scope="module")
def bad_files(runs, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    text = folder / "notes.h5"
    text.write_text("not HDF5 at all\n")
    other = folder / "other.h5"
    with h5py.File(other, "w") as h5file:
        h5file["x"] = np.arange(4)
    newer = folder / "newer.h5"
    shutil.copyfile(runs["fix2"], newer)
    with h5py.File(newer, "r+") as h5file:
        h5file.attrs["schema_version"] = SCHEMA_VERSION + 1
    truncated = folder / "truncated.h5"
    shutil.copyfile(runs["mqgrad"], truncated)
    os.truncate(truncated, truncated.stat().st_size * 2 // 3)
    return {"missing": folder / "missing.h5", "text": text, "other": other, "newer": newer,
            "truncated": truncated, "empty": runs["empty"]}


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file"), ("text", "not an HDF5 file"), ("other", "not an mpigrad trace"),
    ("newer", "newer than this mpigrad reads"), ("truncated", "truncated"),
    ("empty", "the run recorded no iterations"),
])
@pytest.mark.parametrize("action", ["summary", "table", "plot", "export", "compare"])
def test_a_bad_file_alone_exits_2_with_one_line(bad_files, tmp_path, capsys, kind, message, action):
    extra = {"summary": [], "table": ["--at", "5h"], "plot": ["-o", tmp_path / "x.png"],
             "export": ["--csv", tmp_path / "out"], "compare": ["--target-loss", "1"]}[action]
    code, out, err = cli(capsys, action, bad_files[kind], *extra)
    assert code == 2 and out == ""
    assert err.startswith(f"mpigrad trace: error: {bad_files[kind]}") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file"), ("text", "not an HDF5 file"), ("truncated", "truncated"),
    ("empty", "the run recorded no iterations"),
])
@pytest.mark.parametrize("action", ["summary", "table", "plot", "compare"])
def test_a_bad_file_among_many_is_reported_and_the_rest_go_on(bad_files, runs, tmp_path, capsys, kind,
                                                               message, action):
    extra = {"summary": [], "table": ["--at", "5h"], "plot": ["-o", tmp_path / "x.png"],
             "compare": ["--target-loss", "1.5"]}[action]
    code, out, err = cli(capsys, action, runs["fix2"], bad_files[kind], runs["mqgrad"], *extra)
    assert code == 1, err
    assert err.startswith(f"mpigrad trace: error: {bad_files[kind]}") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    if action == "plot":
        assert (tmp_path / "x.png").stat().st_size > 0
    else:
        assert "Fix (2-bit)" in out and "MQGrad" in out


@pytest.mark.parametrize("args, message", [
    (["table", "{fix2}", "--at", "5x"], "bad point '5x'"),
    (["table", "{fix2}", "--at", "5h", "--iterations"], "expected an iteration number"),
    (["summary", "{fix2}", "--smooth", "0"], "at least 1 iteration"),
    (["plot", "{fix2}", "-o", "{tmp}/out.txt"], "must end in .png, .pdf, .svg"),
    (["plot", "{fix2}", "-o", "{tmp}/nowhere/out.png"], "does not exist"),
    (["info", "{tmp}"], "is a directory"),
])
def test_bad_options_exit_2_with_one_line(runs, tmp_path, capsys, args, message):
    args = [a.format(fix2=runs["fix2"], tmp=tmp_path) for a in args]
    code, out, err = cli(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_argparse_errors_exit_2(runs, capsys):
    for args in (["table", str(runs["fix2"])], ["plot", str(runs["fix2"])], ["nope"], []):
        with pytest.raises(SystemExit) as info:
            main(["trace", *args])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("mpigrad trace") and "error:" in err and err.count("\n") == 1, err


# ---- analysis on a machine without MPI -----------------------------------------------------------------
def test_analysis_runs_without_mpi4py_torch_or_numba(runs, tmp_path):
    """Blocks mpi4py, torch and numba imports, then runs every action in a fresh interpreter."""
    script = f"""
import sys
for name in ("mpi4py", "torch", "numba"):
    sys.modules[name] = None  # any import of them now raises ImportError
from mpigrad.cli import main
files = {[str(runs['fix2']), str(runs['mqgrad'])]!r}
assert main(["trace", "summary", *files]) == 0
assert main(["trace", "table", *files, "--at", "5h"]) == 0
assert main(["trace", "info", files[0]]) == 0
assert main(["trace", "export", files[0], "--csv", {str(tmp_path / "csv")!r}]) == 0
assert "matplotlib" not in sys.modules, "matplotlib imported before plot"
assert main(["trace", "plot", *files, "-o", {str(tmp_path / "p.png")!r}]) == 0
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("OK\n") and (tmp_path / "p.png").stat().st_size > 10_000


def test_table_at_iterations_counts_like_the_progress_line(runs, capsys):
    # fix2 ran 10 iterations (rows 0..9, evaluated after rows 4 and 9): its progress line
    # ended "iter 10/10", so --at 10 is its final accuracy, and --at 11 is past its end.
    code, out, _ = cli(capsys, "table", runs["fix2"], "--at", "4,5,10,11")
    assert code == 0
    assert out.splitlines()[1].split()[2:] == ["-", "50.0", "60.0", "N/A"]


def test_unfinished_runs_are_marked_in_info_summary_table_and_plot(runs, tmp_path, capsys):
    from mpigrad.trace import repair

    killed = tmp_path / "killed.h5"
    shutil.copyfile(runs["mqgrad"], killed)
    import h5py
    with h5py.File(killed, "r+") as f:  # as a killed writer leaves it: still "running"
        f.attrs["status"] = "running"
        f.attrs["complete"] = False
    repair(killed, error="rank 2 died at iteration 20")
    code, out, _ = cli(capsys, "info", killed)
    assert "failed: rank 2 died at iteration 20 (last complete iteration 19)" in out
    code, out, _ = cli(capsys, "summary", runs["fix2"], killed)
    assert out.splitlines()[2].split()[2] == "failed"
    code, out, _ = cli(capsys, "table", runs["fix2"], killed, "--at", "5h")
    assert "MQGrad [failed]" in out and "Fix (2-bit) [" not in out
