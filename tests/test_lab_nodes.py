"""Nodes of several ranks in the network lab (``mpigrad lab --ranks-per-node L``, docs/lab.rst,
"Nodes of several ranks"): L ranks in each node's namespace behind its one shaped link, rank
0 an extra rank in node 0 under ``--launch mpi``; the ranks of a node share memory (MPICH)
or loopback (gloo), and only what crosses nodes goes over the link.

The first tests need no root (the launch plan, the train command's ``--ranks-per-node``, the
refusals); the lab tests need root, ``ip netns`` and tc's tbf, marked and skipped as in
tests/test_lab.py, and check that nothing of their lab is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpigrad.errors import UsageError
from mpigrad.lab.host import unavailable_reason
from mpigrad.lab.launch import (MPICH_NETMOD, MPICH_VARIABLES, Placement, each_plan, mpi_plan, pass_ranks_per_node,
                                rank_environment)
from mpigrad.lab.netns import Topology, namespaces

pytestmark = pytest.mark.lab

REASON = unavailable_reason() if sys.platform.startswith("linux") else "network namespaces need Linux"
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"mpigrad lab cannot run here: {REASON}")
#: Unique per test session, so that parallel sessions on one machine do not meet.
NAME = f"mgn{os.getpid() % 100000}"
PROBE = str(Path(__file__).with_name("lab_node_probe.py"))


def lab_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpigrad", "lab", "--name", NAME, *args]


def assert_nothing_left(marker: str | None = None) -> None:
    """No namespace of this session's labs, and no process whose command line has ``marker``."""
    assert [ns for ns in namespaces() if ns.startswith(f"{NAME}-")] == []
    if marker:
        found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        assert [pid for pid in found if int(pid) != os.getpid()] == [], f"processes left: {found}"


@pytest.fixture
def mpich(tmp_path) -> str:
    """A stand-in mpiexec that says it is MPICH's hydra (the plans only ask it its version)."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    return str(fake)


def segments(argv: list[str]) -> list[list[str]]:
    """An MPMD mpiexec line's segments (after the global options), split at ':'."""
    found, current = [], []
    for word in argv[argv.index("-n"):]:
        if word == ":":
            found.append(current)
            current = []
        else:
            current.append(word)
    return [*found, current]


def env_of(segment: list[str]) -> dict[str, str]:
    """The variables ``env K=V ...`` sets in ``... ip netns exec NS env K=V ... CMD``."""
    words = segment[segment.index("env") + 1:]
    return dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))


# ---- no root needed -------------------------------------------------------------------------
def test_the_placement_puts_rank_0_in_node_0_beside_l_ranks_as_train_places_them():
    from mpigrad.runtime.plan.topology import Topology as RunTopology

    two = Placement.of("mpi", 2, 2)
    assert two.rank_nodes == [0, 0, 0, 1, 1] and two.ranks == 5
    assert [two.node_ranks(k) for k in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert [two.local_rank(r) for r in range(5)] == [0, 1, 2, 0, 1]
    assert two.describe() == "node 0: ranks 0-2; node 1: ranks 3-4"
    for nodes, L in ((2, 2), (3, 2), (2, 3), (3, 1)):
        placement = Placement.of("mpi", nodes, L)
        assert placement.ranks == nodes * L + 1
        assert placement.rank_nodes == RunTopology(nodes * L, L).rank_nodes(colocated=True)
    assert Placement.of("each", 2, 2).rank_nodes == [0, 0, 1, 1]  # DDP peers: no rank 0 of their own
    assert Placement.of("each", 3, 2).node_ranks(2) == [4, 5]
    assert Placement.of("mpi", 3).rank_nodes == Placement.of("each", 3).rank_nodes == [0, 1, 2]  # --nodes N alone
    with pytest.raises(UsageError, match="--ranks-per-node 0: give a whole number"):
        Placement(2, 0)


def test_nodes_alone_launch_as_before_one_rank_per_node_and_no_shared_memory(mpich):
    topology = Topology("mgx", 2, "10.79.0.0/24")
    plan = mpi_plan(topology, ["cmd"], mpich)
    [argv] = plan.commands
    assert argv[:2] == [mpich, "-n"] and "-hosts" not in argv and "-launcher" not in argv
    parts = segments(argv)
    assert [part[:6] for part in parts] == [["-n", "1", "ip", "netns", "exec", f"mgx-{i}"] for i in (0, 1)]
    assert [part[-1] for part in parts] == ["cmd", "cmd"]
    for i, part in enumerate(parts):
        assert env_of(part) == {
            "MPIGRAD_LAB_NODE": str(i), "MPIGRAD_LAB_NODES": "2", "MPIGRAD_LAB_ADDR": f"10.79.0.{i + 1}",
            "MPIGRAD_LAB_MASTER": "10.79.0.1", "MPIGRAD_LAB_IFACE": "lab0", "RANK": str(i), "WORLD_SIZE": "2",
            "MASTER_ADDR": "10.79.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
            "GLOO_SOCKET_IFNAME": "lab0"}
    assert {k: plan.env[k] for k in MPICH_VARIABLES} == MPICH_VARIABLES
    assert MPICH_VARIABLES["MPIR_CVAR_NOLOCAL"] == "1"


def test_nodes_of_several_ranks_are_hydra_hosts_with_a_rank_per_segment(mpich, monkeypatch):
    monkeypatch.delenv("MPIR_CVAR_NOLOCAL", raising=False)
    topology = Topology("mgx", 2, "10.79.0.0/24")
    placement = Placement.of("mpi", 2, 2)
    plan = mpi_plan(topology, ["python", "-m", "mpi4py", "-m", "mpigrad", "train"], mpich, placement)
    [argv] = plan.commands
    # one hydra proxy per node, forked here: its ranks are one node's to MPICH
    assert argv[:5] == [mpich, "-launcher", "fork", "-hosts", "mgx-0:3,mgx-1:2"]
    parts = segments(argv)
    assert [part[:2] for part in parts] == [["-n", "1"]] * 5
    assert [part[part.index("exec") + 1] for part in parts] == ["mgx-0"] * 3 + ["mgx-1"] * 2
    envs = [env_of(part) for part in parts]
    assert [(e["RANK"], e["WORLD_SIZE"], e["MPIGRAD_LAB_NODE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"])
            for e in envs] == [("0", "5", "0", "0", "3"), ("1", "5", "0", "1", "3"), ("2", "5", "0", "2", "3"),
                               ("3", "5", "1", "0", "2"), ("4", "5", "1", "1", "2")]
    assert {e["MPIGRAD_LAB_ADDR"] for e in envs[:3]} == {"10.79.0.1"} and envs[3]["MPIGRAD_LAB_ADDR"] == "10.79.0.2"
    assert {e["MASTER_ADDR"] for e in envs} == {"10.79.0.1"} and {e["MPIGRAD_LAB_RANKS_PER_NODE"] for e in envs} == {"2"}
    assert {k: plan.env[k] for k in MPICH_NETMOD} == MPICH_NETMOD and "MPIR_CVAR_NOLOCAL" not in plan.env
    with pytest.raises(ValueError, match="a placement on 3 nodes for a lab of 2"):
        mpi_plan(topology, ["cmd"], mpich, Placement.of("mpi", 3, 2))


def test_ddp_peers_of_several_per_node_get_torchrun_s_variables():
    topology = Topology("mgx", 2, "10.79.0.0/24")
    plan = each_plan(topology, ["python", "peer.py"], Placement.of("each", 2, 2))
    assert len(plan.commands) == 4
    assert [argv[3] for argv in plan.commands] == ["mgx-0", "mgx-0", "mgx-1", "mgx-1"]
    envs = [env_of(argv) for argv in plan.commands]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["MPIGRAD_LAB_ADDR"]) for e in envs] \
        == [("0", "4", "0", "2", "10.79.0.1"), ("1", "4", "1", "2", "10.79.0.1"),
            ("2", "4", "0", "2", "10.79.0.2"), ("3", "4", "1", "2", "10.79.0.2")]
    assert {(e["MASTER_ADDR"], e["GLOO_SOCKET_IFNAME"]) for e in envs} == {("10.79.0.1", "lab0")}
    # one rank per node, as before: no torchrun variables
    assert "LOCAL_RANK" not in rank_environment(topology, Placement.of("each", 2), 1)


def test_a_train_command_gets_the_lab_s_ranks_per_node_and_a_different_one_is_refused():
    assert pass_ranks_per_node(["train", "--iterations", "3"], 2) == ["train", "--ranks-per-node", "2",
                                                                      "--iterations", "3"]
    full = [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train", "--iterations", "3"]
    assert pass_ranks_per_node(full, 3) == [*full[:6], "--ranks-per-node", "3", *full[6:]]
    for same in (["--ranks-per-node", "2"], ["--ranks-per-node=2"], ["--ranks-per", "2"], ["--ranks-per-node", "auto"]):
        assert pass_ranks_per_node(["train", *same], 2) == ["train", *same]
    assert pass_ranks_per_node(["train", "--ranks", "5"], 2)[:3] == ["train", "--ranks-per-node", "2"]  # another option
    assert pass_ranks_per_node(["train"], None) == ["train"]  # --nodes N alone: unchanged
    assert pass_ranks_per_node(["python", "train.py", "train"], 2) == ["python", "train.py", "train"]
    with pytest.raises(UsageError, match=r"^--ranks-per-node 2 puts 2 rank\(s\) in each node, and the train command "
                                         r"declares --ranks-per-node 3: give both the same L"):
        pass_ranks_per_node(["train", "--ranks-per-node=3"], 2)


@pytest.mark.parametrize("args, message", [
    (["--ranks-per-node", "0"], "--ranks-per-node '0': give a whole number L >= 1 of ranks per node"),
    (["--ranks-per-node", "auto"], "--ranks-per-node 'auto': give a whole number L >= 1"),
    (["--ranks-per-node", "2", "--", "train", "--ranks-per-node", "3"],
     "the train command declares --ranks-per-node 3"),
])
def test_ranks_per_node_usage_errors_are_one_line_and_exit_2(args, message):
    result = subprocess.run(lab_command("--nodes", "2", *args), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_the_help_says_where_the_ranks_go_and_what_train_gets():
    import argparse

    from mpigrad.lab.cli import add_arguments

    parser = argparse.ArgumentParser(prog="mpigrad lab")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for words in ("--ranks-per-node L", "N*L+1 ranks", "--launch each N*L", "node 0 holds ranks 0..L",
                  "shared memory (MPICH) or loopback", "A train command gets --ranks-per-node L added when it has none",
                  "The rate check stays one transfer per link"):
        assert words in text, words


# ---- in a lab -------------------------------------------------------------------------------
def _traffic(stdout: str) -> dict[int, dict[str, float]]:
    """The lab's closing lines ``lab: node K during the command: link A MB out, B MB in;
    loopback C MB``, in bytes."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("lab: node ") and " during the command: " in line:
            node = int(line.split()[2])
            words = line.split(": ", 2)[2].replace(",", "").replace(";", "").split()
            found[node] = {"out": float(words[1]) * 1e6, "in": float(words[4]) * 1e6, "loopback": float(words[8]) * 1e6}
    return found


@needs_lab
@pytest.mark.mpi
@pytest.mark.slow
def test_the_ranks_of_a_node_share_memory_and_only_other_nodes_cross_its_link(mpi_env):
    """2 nodes x 2 ranks at 1 MB/s: MPI's shared-memory split finds the lab's nodes; 20 MB
    between two ranks of one node take milliseconds and put nothing on the node's link nor
    on its loopback (shared memory: at the link's rate they would take 20 s); 400 kB to the
    other node go at the link's rate, over the link. The rate check: one transfer per link."""
    result = subprocess.run(lab_command("--nodes", "2", "--ranks-per-node", "2", "--rate", "1MB/s", "--",
                                        sys.executable, PROBE, "1-2:20000000", "3-4:20000000", "2-3:400000"),
                            env=mpi_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("lab: rate check (mpi)") == 2, result.stdout
    assert "lab: 5 ranks, 2 per node (rank 0: the scheduler): node 0: ranks 0-2; node 1: ranks 3-4" in result.stdout
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("NODEPROBE "))[10:])
    ranks = found["ranks"]
    assert [r["lab_node"] for r in ranks] == [0, 0, 0, 1, 1]
    assert [r["mpi_node"] for r in ranks] == [0, 0, 0, 3, 3], ranks  # MPI's nodes are the lab's
    assert [(r["env_rank"], r["world_size"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 5, 0, 3), (1, 5, 1, 3), (2, 5, 2, 3), (3, 5, 0, 2), (4, 5, 1, 2)]
    inside = [p for p in found["pairs"] if p["bytes"] == 20_000_000]
    for pair in inside:
        print(f"\n[lab] node-local {pair['sender']}->{pair['receiver']}: 20 MB in {pair['seconds'] * 1e3:.1f} ms, "
              f"{pair['link_sent']} B on the link, {pair['loopback_sent']} B on loopback")
        assert pair["link_sent"] < 20_000 and pair["loopback_sent"] < 20_000, pair
        assert pair["seconds"] < 2.0, pair  # 20 s at the link's rate
    [across] = [p for p in found["pairs"] if p["bytes"] == 400_000]
    rate = across["bytes"] / across["seconds"]
    print(f"[lab] across nodes 2->3: 400 kB at {rate / 1e6:.2f} MB/s, {across['link_sent']} B on the link")
    assert 0.7e6 < rate < 1.05e6 and across["link_sent"] > across["bytes"], across
    assert_nothing_left(PROBE)


def _crossing_bytes(trace, node_of: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """(bytes each node's workers sent to other nodes' workers, bytes they sent to workers of
    their own node) in a colocated run's trace: the frames to each shard's server
    (``/servers frame_bytes``) and each server's broadcast to every other worker
    (``bytes_out``)."""
    frames, broadcasts = trace.array("servers", "frame_bytes").sum(0), trace.array("servers", "bytes_out").sum(0)
    across, inside = {}, {}
    workers = range(len(node_of))
    for s in workers:
        for k in workers:
            if s != k:  # worker k's frame to server s, server s's broadcast to worker k
                for sender, sent in ((k, frames[s][k]), (s, broadcasts[s])):
                    into = inside if node_of[s] == node_of[k] else across
                    into[node_of[sender]] = into.get(node_of[sender], 0) + int(sent)
    return across, inside


@needs_lab
@pytest.mark.mpi
@pytest.mark.slow
def test_a_train_run_on_two_nodes_of_two_ranks_sends_only_what_crosses_nodes_over_the_links(tmp_path, mpi_env):
    """mpigrad lab --nodes 2 --ranks-per-node 2 -- train --servers colocated --exchange flat:
    5 ranks (rank 0 and workers 0, 1 in node 0; workers 2, 3 in node 1), the lab adds
    --ranks-per-node 2 to train, MPI agrees (no note that it sees other nodes), and the
    trace is written. Each node's link carries what its workers send to the other node's
    (within headers and rank 0's messages), its loopback nothing: the flat exchange's
    frames and broadcasts between the two workers of a node go through shared memory."""
    from mpigrad.trace import load

    trace = tmp_path / "nodes.h5"
    result = subprocess.run(lab_command(
        "--nodes", "2", "--ranks-per-node", "2", "--rate", "10MB/s", "--check", "none", "--",
        "train", "--servers", "colocated", "--exchange", "flat", "--trace", str(trace), "--iterations", "4",
        "--model-opt", "fc_sizes=[256,256]", "--min-quantize-size", "10000", "--net-mode", "off",
        "--eval-every", "0", "--progress-every", "0"), env=mpi_env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lab: command exited 0" in result.stdout and f"lab: removed {NAME}-hub" in result.stdout
    assert " ranks_per_node=2 " in result.stdout and "MPI sees" not in result.stdout, result.stdout
    loaded = load(trace)
    assert loaded.status == "complete" and len(loaded.steps) == 4
    topology = loaded.attrs["topology"]
    topology = json.loads(topology) if isinstance(topology, str) else topology
    assert (topology["workers"], topology["ranks_per_node"], topology["nodes"]) == (4, 2, 2), topology
    across, inside = _crossing_bytes(loaded, [0, 0, 1, 1])
    counted = _traffic(result.stdout)
    for node in (0, 1):
        print(f"\n[lab] node {node}: link {counted[node]['out'] / 1e6:.3f} MB out for {across[node] / 1e6:.3f} MB "
              f"of frames to the other node; loopback {counted[node]['loopback'] / 1e6:.3f} MB for "
              f"{inside[node] / 1e6:.3f} MB inside the node")
        assert across[node] < counted[node]["out"] < 1.25 * across[node] + 50_000, (node, counted, across)
        assert counted[node]["loopback"] < 0.05 * inside[node], (node, counted, inside)
    assert_nothing_left(str(trace))


GLOO_PEER = r"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.full((250_000,), float(dist.get_rank() + 1))  # 1 MB
dist.all_reduce(x)
line = (f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} in node {os.environ['MPIGRAD_LAB_NODE']} "
        f"local {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']}: {x[0].item():g}\n")
os.write(1, line.encode())  # one write: the peers share the lab's stdout
dist.destroy_process_group()
"""


@needs_lab
@pytest.mark.slow
def test_ddp_peers_of_one_node_talk_over_its_loopback(tmp_path, mpi_env):
    """--launch each --ranks-per-node 2: 4 gloo peers, two per node. gloo has TCP only: the
    peers of a node reach each other's address (the node's own) over its loopback, not the
    link; a ring all-reduce of 1 MB then puts as much on each node's loopback as on its link."""
    script = tmp_path / "peer.py"
    script.write_text(GLOO_PEER)
    result = subprocess.run(lab_command("--nodes", "2", "--ranks-per-node", "2", "--rate", "10MB/s", "--check",
                                        "none", "--launch", "each", "--", sys.executable, str(script)),
                            env=mpi_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 4 in node {r // 2} local {r % 2} of 2: 10" for r in range(4)], result.stdout
    for node, counted in _traffic(result.stdout).items():
        print(f"\n[lab] gloo, node {node}: link {counted['out'] / 1e6:.3f} MB out, loopback "
              f"{counted['loopback'] / 1e6:.3f} MB")
        assert counted["loopback"] > 0.5e6 and counted["out"] > 0.5e6, counted
    assert_nothing_left(str(script))
