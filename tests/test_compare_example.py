"""examples/compare/run.py end to end on its tiny version: real mpiexec runs, the report,
and a second call that skips what is complete."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, load_script

SCRIPT = REPO / "examples" / "compare" / "run.py"


def run_script(*args, env, timeout=900):
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"run.py {' '.join(map(str, args))} did not finish within {timeout} s\n{exc.stdout}\n{exc.stderr}")


def load_run_py():
    return load_script(SCRIPT, "compare_run")


def test_the_comparison_configs_differ_only_in_their_method():
    import tomllib

    from mpigrad.config import RunConfig
    from mpigrad.policies import get_policy

    run = load_run_py()
    shared = {}
    for method in run.METHODS:
        path = SCRIPT.parent / f"{method}.toml"
        text = path.read_text()
        assert f"\n# ranks: {run.RANKS}\n" in text
        config = RunConfig.from_sources(str(path), {})
        get_policy(config.policy_config(), n_layers=2, seed=1)
        assert (config.net_mode, config.compute_time, config.lr) == ("virtual", 0.05, run.SHARED_LR)
        assert config.min_quantize_size is None
        assert config.codec == {"fp32": "fp32", "fp16": "fp16", "lowrank": "powersgd"}.get(method, "uniform")
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        shared[method] = {k: v for k, v in raw.items() if k not in ("policy", "bits", "policy_opts", "codec",
                                                                    "codec_opts")}
    assert all(c == shared["fix2"] for c in shared.values()), "methods differ only in how bits are chosen"
    assert set(run.LR_GRID_METHODS) >= {"fix2", "fix4", "fix8", "mqgrad", *run.BASELINES} and len(run.LR_GRID) >= 3
    lowrank = RunConfig.from_sources(str(SCRIPT.parent / "lowrank.toml"), {})
    assert lowrank.codec_opts == {"rank": 2, "factor_bits": 8, "rest_bits": 8, "start": 0}
    sbatch = (SCRIPT.parent / "array.sbatch").read_text()
    assert f"#SBATCH --array=0-{len(run.plan(SCRIPT.parent)) - 1}\n" in sbatch
    assert f"#SBATCH --ntasks={run.RANKS}\n" in sbatch


@pytest.mark.mpi
def test_the_comparison_command_runs_resumes_and_reports(tmp_path, mpi_env, world_relay):
    out = tmp_path / "cmp"
    listed = run_script("--out", out, "--list", env=mpi_env)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 75   # the full plan
    relayed = world_relay(mpi_env)  # the runs in this worker's world: its one sweep, then each run
    first = run_script("--out", out, "--smoke", "--one-world", env=relayed)  # the four in one MPI job
    assert first.returncode == 0, first.stdout + first.stderr
    assert "0 complete, skipped; 4 to run in one world" in first.stdout
    assert first.stdout.count(": exit 0 after") == 4
    traces = sorted(p.name for p in out.glob("*.h5"))
    assert traces == ["fix2-lr0.02-s1.h5", "fix2-lr0.02-s2.h5", "mqgrad-lr0.02-s1.h5", "mqgrad-lr0.02-s2.h5"]
    for name in ("shared-lr", "best-lr"):
        table = pd.read_csv(out / f"{name}.csv")
        assert table["method"].tolist() == ["Fix (2-bit)", "MQGrad"] and table["runs"].tolist() == ["2/2", "2/2"]
        assert (out / f"{name}.png").stat().st_size > 10000 and (out / f"{name}.md").exists()
    assert "acc%@4s" in (out / "shared-lr.txt").read_text()
    # A second call skips complete traces and runs only what is missing.
    (out / "mqgrad-lr0.02-s2.h5").unlink()
    second = run_script("--out", out, "--smoke", env=relayed)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("complete, skipped") == 3 and second.stdout.count(": running") == 1
    # The job-array route: a task prints its run, nothing once complete.
    assert run_script("--out", out, "--smoke", "--task", "0", env=mpi_env).stdout == ""
    task = run_script("--out", tmp_path / "other", "--smoke", "--task", "3", env=mpi_env).stdout.split()
    assert task[0].endswith("mqgrad.toml") and task[1:3] == ["2", "0.02"]
