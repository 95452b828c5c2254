"""The map over bandwidths (examples/map/run.py, mpigrad/analysis/maps.py): crossovers and
ratios on synthetic tables, the runner's plan, resume and skip logic, and its smoke end to end."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, load_script
from mpigrad.analysis.compare import student_t95
from mpigrad.analysis.maps import Cell, congestion_rows, crossover, crossovers, map_pivot, map_rows, none_beats
from mpigrad.trace import TraceWriter, default_tables

SCRIPT = REPO / "examples" / "map" / "run.py"
MB = 1e6


def load_run_py():
    return load_script(SCRIPT, "map_run")


# ---- crossovers and ratios on synthetic tables ----------------------------------------------
def test_crossover_kinds_and_the_interpolated_crossing():
    assert crossover([(1 * MB, 0.5), (10 * MB, 0.8)])["kind"] == "all"
    assert crossover([(1 * MB, 1.5), (10 * MB, 1.0)])["kind"] == "none"   # 1.0 is a tie, not a win
    assert crossover([(1 * MB, None)])["kind"] == "unknown"
    assert crossover([(1 * MB, 0.5), (10 * MB, 1.2), (100 * MB, 0.9)])["kind"] == "mixed"
    # log ratio goes from log 0.5 at 10 MB/s to log 2 at 1000 MB/s: 0 halfway in log bandwidth
    result = crossover([(1000 * MB, 2.0), (10 * MB, 0.5), (1 * MB, 0.25), (100 * MB, None)])
    assert result["kind"] == "below" and result["between"] == (10 * MB, 1000 * MB)
    assert result["at"] == pytest.approx(100 * MB) and result["wins"] == [1 * MB, 10 * MB]
    above = crossover([(1 * MB, 4.0), (10 * MB, 0.25)])
    assert above["kind"] == "above" and above["at"] == pytest.approx(math.sqrt(10) * 1 * MB)


def cell(method, network, kind=None, **by_lr):
    """by_lr: lr0_02=[t_seed1, t_seed2, ...] (None: that seed never reached the target)."""
    times = {float(k[2:].replace("_", ".")): {s + 1: t for s, t in enumerate(v)} for k, v in by_lr.items()}
    return Cell(method, network, times, kind)


def test_map_rows_take_each_best_rate_and_pair_ratios_by_seed():
    cells = [cell("FP32", 10 * MB, "fp32", lr0_01=[100, 120, 110], lr0_02=[90, 100, 95]),
             # lr 0.04 is faster on average but one seed missed: not eligible
             cell("Fix (2-bit)", 10 * MB, "fixed", lr0_02=[45, 50, 57], lr0_04=[10, None, 10]),
             cell("DDP fp32 (modelled)", 10 * MB, "ddp", lr0_02=[60, 60, 60]),
             cell("MQGrad", 10 * MB, None, lr0_02=[None, None, 30]),
             cell("Fix (4-bit)", 10 * MB, "fixed", lr0_02=[60, 70, 65]),
             cell("Adaptive", 10 * MB, None, lr0_02=[50, 55, 57]),
             cell("FP32", 100 * MB, "fp32", lr0_02=[10, 10, 10]),
             cell("Fix (2-bit)", 100 * MB, "fixed", lr0_02=[12, 12, 15])]
    rows = {(r["method"], r["bandwidth"]): r for r in map_rows(cells)}
    fix = rows["Fix (2-bit)", 10 * MB]
    assert fix["best_lr"] == 0.02 and fix["reached"] == "3/3" and fix["time_mean"] == pytest.approx(152 / 3)
    per_seed = [45 / 90, 50 / 100, 57 / 95]
    mean = sum(per_seed) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_seed) / 2)
    assert fix["vs_fp32"] == pytest.approx(mean) and fix["vs_fp32_ci"] == pytest.approx(student_t95(2) * sd / math.sqrt(3))
    assert fix["vs_ddp"] == pytest.approx((152 / 3) / 60)
    # the best fixed width is the fixed cell of least mean time (Fix 2 at its 0.02, not Fix 4)
    adaptive = rows["Adaptive", 10 * MB]
    assert adaptive["best_fixed"] == "Fix (2-bit)" and fix["vs_best_fixed"] == 1.0
    assert adaptive["vs_best_fixed"] == pytest.approx((50 / 45 + 55 / 50 + 57 / 57) / 3)
    assert rows["MQGrad", 10 * MB]["vs_best_fixed"] is None
    table, columns = map_pivot(list(rows.values()), "vs_best_fixed")
    assert [c.header for c in columns] == ["method", "10MB/s", "100MB/s"]
    pivot = {r["method"]: r for r in table}
    assert pivot["Adaptive"]["10MB/s"] == f"{adaptive['vs_best_fixed']:.3f} +- {adaptive['vs_best_fixed_ci']:.3f}"
    assert pivot["Adaptive"]["100MB/s"] == "-" and pivot["MQGrad"]["10MB/s"] == "-"
    assert rows["FP32", 10 * MB]["best_lr"] == 0.02 and rows["FP32", 10 * MB]["vs_fp32"] == 1.0
    assert rows["MQGrad", 10 * MB]["best_lr"] is None and rows["MQGrad", 10 * MB]["vs_fp32"] is None
    assert rows["MQGrad", 10 * MB]["reached"] == "1/3"
    assert rows["Fix (2-bit)", 100 * MB]["vs_fp32"] == pytest.approx(1.3)
    assert rows["Fix (2-bit)", 100 * MB]["vs_ddp"] is None      # no DDP at 100 MB/s
    entries = {e["method"]: e for e in crossovers(list(rows.values()))}
    assert entries["Fix (2-bit)"]["vs_fp32"]["kind"] == "below"
    assert entries["Fix (2-bit)"]["vs_fp32_text"].startswith("Fix (2-bit) beats FP32 below about ")
    assert "vs_ddp" not in entries["DDP fp32 (modelled)"]          # DDP is not compared with itself
    assert none_beats(list(rows.values())) == [100 * MB]


def test_a_rate_run_on_fewer_seeds_is_not_compared_with_one_run_on_all():
    # 0.1's one seed is faster than 0.2's mean only because 0.2 also ran the slow seed 3
    partial = cell("Progress", 1 * MB, None, lr0_2=[80, 100, 120])
    partial.times[0.1] = {1: 85.0}
    assert partial.best_lr() == 0.2
    partial.times[0.1].update({2: 90.0, 3: 100.0})    # run on every seed, it competes
    assert partial.best_lr() == 0.1
    partial.times[0.2][3] = None                      # the full rate missed once: no best rate
    partial.times[0.1].pop(3)
    assert partial.best_lr() is None


def test_congestion_rows_say_whether_a_policy_beats_the_best_fixed_width():
    sched = "markov:10MB/s,1GB/s,dwell=30s,30s"
    cells = [cell("Fix (2-bit)", sched, "fixed", lr0_02=[100, 110, 120]),
             cell("Fix (4-bit)", sched, "fixed", lr0_02=[130, 140, 150]),
             cell("AIMD", sched, None, lr0_02=[80, 88, 96]),         # 0.8 every seed: interval 0
             cell("MQGrad", sched, None, lr0_02=[50, 220, 120]),      # spans 1
             cell("FP32", sched, "fp32", lr0_02=[300, 330, 360])]
    rows = {r["method"]: r for r in congestion_rows(cells)}
    assert {r["best_fixed"] for r in rows.values()} == {"Fix (2-bit)"}
    assert rows["AIMD"]["vs_best_fixed"] == pytest.approx(0.8) and rows["AIMD"]["beats"] == "yes"
    assert rows["MQGrad"]["beats"] == "not resolved"
    assert rows["FP32"]["beats"] == "no" and rows["Fix (2-bit)"]["beats"] == "-"


# ---- the runner: plan, resume, skip ----------------------------------------------------------
def write_trace(path: Path, iterations: int, status: str = "complete") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = TraceWriter(path, config={"iterations": iterations, "lr": 0.02, "seed": 1}, attrs={"seed": 1},
                         tables=default_tables(2), force=True)
    writer.append("steps", {"iteration": 0, "wall_time": 1.0, "sim_time": 1.0, "loss": 2.0, "bits": 2,
                            "bytes_up": 10, "bytes_down": 10, "t_compute": 0.0, "t_encode": 0.0, "t_decode": 0.0,
                            "t_comm": 1.0, "t_policy": 0.0})
    writer.close(status)
    return path


def test_the_plan_retimes_what_it_can_and_runs_the_rest_at_each_bandwidth(tmp_path, monkeypatch):
    run = load_run_py()
    s = run.Settings()
    steps = run.plan(tmp_path, "bandwidths", s)
    kinds = pd.Series([(st.kind, st.method) for st in steps]).value_counts()
    grid = len(run.LRS) * len(run.SEEDS)
    assert len(run.LRS) >= 3 and len(run.SEEDS) >= 3 and len(run.BANDWIDTHS) >= 4
    for method in ("fp32", "fp16", "fix2", "fix4", "fix8", "adaptive", "accordion", "lgreco"):
        assert kinds[("train", method)] == grid and kinds[("retime", method)] == grid * len(run.BANDWIDTHS)
    for method in ("mqgrad", "aimd", "lowrank"):        # clock readers, and two rounds
        assert kinds[("train", method)] == grid * len(run.BANDWIDTHS) and ("retime", method) not in kinds
    assert kinds[("peers", "ddp")] == len(run.LRS)
    assert not any(st.method == "progress" for st in steps) == (not run.CONFIGS["progress"].exists())
    # every retime reads the base run that the plan trains, at the configs' bandwidth
    trained = {st.trace for st in steps if st.kind == "train"}
    assert all(st.source in trained for st in steps if st.kind == "retime")
    assert {st.bandwidth for st in steps if st.kind == "train" and st.method in ("fix2", "fp32")} == {None}
    # a slot for the controller of item 6: planned at each bandwidth once its policy exists
    progress = tmp_path / "progress.toml"
    progress.write_text((run.CONFIGS["aimd"]).read_text())
    monkeypatch.setitem(run.CONFIGS, "progress", progress)
    with_progress = run.plan(tmp_path, "bandwidths", s)
    assert sum(st.method == "progress" for st in with_progress) == grid * len(run.BANDWIDTHS)
    assert len(set(st.trace for st in with_progress)) == len(with_progress)   # no two steps share a trace


def test_the_hard_setup_runs_the_same_methods_on_the_teacher_task(tmp_path):
    """--setup hard: a config per method in examples/hard, each the method of the digits map
    (codec, policy, their options) on the teacher task (everything else as examples/hard's
    fix2.toml), planned like the digits map at its own rates, length and target."""
    import tomllib

    run = load_run_py()
    method_keys = ("codec", "policy", "bits", "codec_opts", "policy_opts")

    def toml(path):
        with open(path, "rb") as f:
            return tomllib.load(f)

    task = {k: v for k, v in toml(REPO / "examples" / "hard" / "fix2.toml").items() if k not in method_keys}
    hard = run.SETUPS["hard"]
    assert set(hard.configs) == set(run.CONFIGS) and len(hard.lrs) >= 3
    for method, path in hard.configs.items():
        mine = toml(path)
        if method == "lowrank":   # powersgd chooses its layers itself: the CLI refuses min_quantize_size
            assert "min_quantize_size" not in mine
            mine = {**mine, "min_quantize_size": task["min_quantize_size"]}
        assert {k: v for k, v in mine.items() if k not in method_keys} == task, method
        ours, theirs = (run._config(p).to_dict() for p in (path, run.CONFIGS[method]))
        assert {k: ours[k] for k in method_keys} == {k: theirs[k] for k in method_keys}, method
        assert f"--config examples/hard/{method}.toml" in path.read_text() and "\n# ranks: 3\n" in path.read_text()
    s = run.settings_for("hard")
    assert (s.iterations, s.target_loss, s.lrs) == (500, hard.target_loss, hard.lrs)
    steps = run.plan(tmp_path, "bandwidths", s)
    assert {st.config.parent.name for st in steps} == {"hard"}
    assert len(steps) == len(run.plan(tmp_path, "bandwidths", run.settings_for("digits")))
    peers = [st for st in steps if st.kind == "peers"]
    assert run.command(peers[0], s)[run.command(peers[0], s).index("--config") + 1].endswith("hard/fp32.toml")
    train = next(st for st in steps if st.kind == "train")
    assert "--iterations" not in run.command(train, s)     # the configs' own 500
    assert "--iterations" in run.command(train, run.settings_for("hard", smoke=True))


def test_resume_skips_complete_traces_of_the_planned_length_only(tmp_path):
    run = load_run_py()
    s = run.Settings(methods=("fix2",), lrs=(0.02,), seeds=(1,), bandwidths=("10MB/s",), peers=False)
    train, retime = run.plan(tmp_path, "bandwidths", s)
    assert (train.kind, retime.kind) == ("train", "retime") and not run.done(train)
    write_trace(train.trace, iterations=12)                  # a smoke's trace: not the plan's 400
    assert not run.done(train) and run.done(train, 12)
    write_trace(train.trace, iterations=400, status="failed")
    assert not run.done(train)
    write_trace(train.trace, iterations=400)
    assert run.done(train) and not run.done(retime)
    # the congestion part needs the bandwidths part's best rates
    with pytest.raises(SystemExit) as stop:
        run.plan(tmp_path / "empty", "congestion", s)
    assert stop.value.code == 2
    # --task prints a step to run, nothing for a done one or a re-timing
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--part", "bandwidths", "--task", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[0] == "train"


@pytest.mark.mpi
@pytest.mark.slow
def test_the_smoke_runs_both_parts_resumes_and_estimates(tmp_path, mpi_env, world_relay):
    out = tmp_path / "map"
    env = world_relay(mpi_env)  # its runs in this worker's world

    def script(*args):
        return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], env=env,
                              capture_output=True, text=True, timeout=600)

    first = script("--smoke")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count(": train") == 2 and first.stdout.count(": retime") == 6
    table = pd.read_csv(out / "map.csv")
    assert set(table["method"]) == {"FP32", "Fix (2-bit)"} and set(table["bandwidth"]) == {"10MB/s", "1GB/s"}
    fix = table[table["method"] == "Fix (2-bit)"]
    assert (fix["vs_fp32"].astype(float) < 1).all()          # 2 bits against 32 on the same losses' clock
    assert "Fix (2-bit) beats FP32" in (out / "crossovers.md").read_text()
    assert (out / "map.png").stat().st_size > 10000
    congestion = pd.read_csv(out / "congestion.csv")
    assert congestion["best_fixed"].tolist() == ["Fix (2-bit)", "Fix (2-bit)"]
    note = (out / "congestion.txt").read_text()     # neither reference counts as a winner
    assert "(moving bits) whose 95 % interval of the ratio to the best fixed width lies below 1: none" in note
    assert "baselines (fp16, low rank, DDP) whose interval lies below 1: none" in note
    # another target re-reports the same traces into a folder of its own, the first report untouched
    before = (out / "map.csv").read_text()
    other = script("--smoke", "--report", "--target-loss", "4.5")
    assert other.returncode == 0 and ": train" not in other.stdout, other.stdout + other.stderr
    assert "sim_s_to_4.5" in pd.read_csv(out / "target-4.5" / "map.csv").columns
    assert (out / "target-4.5" / "congestion.csv").exists() and (out / "map.csv").read_text() == before
    assert script("--smoke", "--target-loss", "4.5").returncode == 2     # a target changes reports only
    # a second call skips every complete trace; --list estimates the full plan from the smoke
    second = script("--smoke")
    assert second.returncode == 0 and ": train" not in second.stdout and ": retime" not in second.stdout
    listed = script("--part", "bandwidths", "--list")
    assert listed.returncode == 0 and "measured runs in" in listed.stdout.splitlines()[-1]


def test_the_array_script_reads_what_task_prints(tmp_path):
    import shutil

    sbatch = SCRIPT.parent / "array.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    if shutil.which("shellcheck"):
        done = subprocess.run(["shellcheck", "-x", str(sbatch)], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
    text = sbatch.read_text()
    assert "read -r kind config seed lr trace bandwidth _" in text and "#SBATCH --ntasks=3\n" in text
    run = load_run_py()
    step = run.plan(tmp_path, "bandwidths", run.Settings(methods=("mqgrad",), lrs=(0.02,), seeds=(1,),
                                                         bandwidths=("1MB/s",), peers=False))[0]
    kind, config, seed, lr, trace, bandwidth, source = step.line().split()
    assert (kind, seed, lr, bandwidth, source) == ("train", "1", "0.02", "1MB/s", "-") and config.endswith("mqgrad.toml")
