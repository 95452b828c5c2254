"""examples/nodes/run.py end to end, small (--smoke: Fix 2 and FP32, one seed, 6 iterations):
one world of 5 ranks runs the 4 x 1 and 2 x 2 hierarchical runs, the 2 x 2 flat traces are the
4 x 1 ones re-timed on nodes of 2, and the report groups them by nodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from mpigrad.trace import load

REPO = Path(__file__).resolve().parents[1]


def test_the_nodes_example_runs_retimes_and_reports(tmp_path, mpi_env, world_relay):
    out = tmp_path / "nodes"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "nodes" / "run.py"), "--out", str(out), "--smoke"],
                            env=world_relay(mpi_env), capture_output=True, text=True, timeout=300)  # its sweep in the world
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in out.glob("*.h5"))
    assert names == sorted(f"{m}-{layout}-s1.h5" for m in ("fix2", "fp32") for layout in ("4x1", "2x2-flat", "2x2-hier"))
    flat1, flat2 = load(out / "fix2-4x1-s1.h5"), load(out / "fix2-2x2-flat-s1.h5")
    assert flat2.config["retimed"] and flat2.config["ranks_per_node"] == 2
    np.testing.assert_array_equal(flat2.steps["loss"], flat1.steps["loss"])
    assert flat2.steps["sim_time"].iloc[-1] > flat1.steps["sim_time"].iloc[-1]  # two workers share a NIC
    hier = load(out / "fix2-2x2-hier-s1.h5")
    assert hier.config["exchange"] == "hierarchical" and hier.attrs["topology"]["nodes"] == 2
    assert (hier.steps["bytes_nic"] * 2 == flat2.steps["bytes_nic"]).all()
    report = (out / "nodes.txt").read_text()
    for label in ("Fix (2-bit) nodes=2x2 hier", "Fix (2-bit) (retimed) nodes=2x2 flat", "FP32 nodes=one per node"):
        assert label in report
    assert (out / "nodes.png").stat().st_size > 0 and (out / "nodes.md").exists()
