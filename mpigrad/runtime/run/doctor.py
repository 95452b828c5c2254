"""``mpigrad doctor``: check an MPI launch before spending an allocation on it.

Run it exactly as the training run will be launched::

    srun python -m mpi4py -m mpigrad doctor
    mpiexec -n 4 python -m mpi4py -m mpigrad doctor

Rank 0 gathers from every rank its host, pid, CPU affinity, thread variables, torch and
Numba pool sizes and library versions, and prints one report: the MPI library, world
size, ranks per host, the nodes of MPI's shared-memory split (and Slurm's tasks per node;
with ``--ranks-per-node``, the run's nodes against both), versions, the ``SLURM_NTASKS``
check and oversubscription warnings.
Exit 0 when the launch is usable (warnings included), 2 when the world size does not
match ``SLURM_NTASKS`` or an option or variable is invalid.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from ...config import RunConfig, parse_ranks_per_node, parse_servers
from ...errors import UsageError
from ...machine import mpi_implementation, mpi_library_line, mpi_library_version
from ..plan.gpu import cuda_aware_mpi, node_of, plan_world, visible_devices
from ..plan.nodes import format_counts, slurm_layout, slurm_nodes_notes
from ..plan.topology import resolve_topology
from ..plan.environment import (
                                THREAD_VARIABLES, RankInfo, check_world_size, format_ranks, oversubscription_warnings,
                                probe_rank, ranks_per_host, threads_per_rank,
                                )

_SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_CPUS_PER_TASK",
                    "SLURM_JOB_NUM_NODES", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="threads per rank the run will use "
                             "(default: SLURM_CPUS_PER_TASK if set, else 1)")
    parser.add_argument("--servers", default="1", metavar="S|colocated",
                        help="the run's --servers, for the rank -> GPU map (colocated: rank 0 takes no GPU)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="the run's --share-gpu: GPU ranks may share a device")
    parser.add_argument("--ranks-per-node", default=None, metavar="L|auto",
                        help="the run's --ranks-per-node: its nodes checked against MPI's shared-memory split and "
                             "Slurm's tasks per node (default: the nodes are only reported)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object instead of text")


def library_versions() -> dict[str, str]:
    """Versions of the libraries a training run depends on (the trace's collector, less the
    host-specific platform and MPI strings), plus mpigrad's own."""
    from ... import __version__
    from ...trace import collect_versions

    versions = {k: v for k, v in collect_versions().items() if k not in ("platform", "mpi_library")}
    return {**versions, "mpigrad": __version__}


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        threads, error = threads_per_rank(args.threads), None
    except UsageError as exc:
        threads, error = 1, str(exc)
    if error is None and args.ranks_per_node is not None:
        try:
            parse_ranks_per_node(args.ranks_per_node)
        except UsageError as exc:
            error = str(exc)
    gathered = comm.gather((probe_rank(rank), library_versions(), error), root=0)
    devices = comm.gather((rank, *node_of(comm), *visible_devices()), root=0)
    outcome = None
    if rank == 0:
        report = _report(MPI, gathered, size, threads,
                         gpus=_gpus(devices, args.servers == "colocated", args.share_gpu))
        report["servers"] = args.servers
        report["nodes"] = _nodes(devices, size, args.servers, args.ranks_per_node)
        print(json.dumps(report, indent=1) if args.json else _format(report), flush=True)
        outcome = report["error"]
    outcome = comm.bcast(outcome, root=0)
    if outcome is None:
        return 0
    # Every rank agreed to fail. Finalize first: mpi4py's runner turns a non-zero exit
    # into MPI_Abort, whose banner would follow the one-line error.
    MPI.Finalize()
    if rank == 0:
        raise UsageError(outcome)
    return 2


def _gpus(devices: list, colocated: bool, share: bool) -> dict:
    """The CUDA devices each rank sees, the rank -> GPU map a --device cuda run would take
    (runtime/plan/gpu.py's rule), or why it would be refused; and whether the MPI is CUDA-aware."""
    supported, why = cuda_aware_mpi()
    seen = {rank: count for rank, _, _, _, count in devices}
    report = {"cuda_aware_mpi": supported, "cuda_aware_why": why, "devices_seen": seen,
              "map": None, "refused": None}
    if any(seen.values()):
        try:
            report["map"] = plan_world(devices, colocated, share)
        except UsageError as exc:
            report["refused"] = str(exc)
    return report


def _nodes(devices: list, size: int, servers: str = "1", ranks_per_node: str | None = None,
           environ=os.environ) -> dict:
    """The nodes of the launch from the gathered ``devices`` entries (rank, node, host, ...):
    ``of_rank``, each rank's node as MPI's shared-memory split finds it, numbered from 0 in
    rank order, and ``hosts``, each node's host; ``slurm``, Slurm's tasks per node where its
    variables say them (``plan.nodes.slurm_layout``: ``tasks_per_node``, ``from``; ``error``
    for a value that cannot be read); for the run's ``ranks_per_node`` (``--ranks-per-node``,
    with ``servers``), the nodes the launch would resolve on MPI's
    (``plan.topology.resolve_topology``: ``resolved``, ``exchange``, ``topology``) with the
    notes of that and of Slurm's layout (``plan.nodes.slurm_nodes_notes``), or ``refused``,
    the launch's one line."""
    order: dict = {}
    of_rank, hosts = [], []
    for _, node, host, *_ in sorted(devices, key=lambda entry: entry[0]):
        if node not in order:
            order[node] = len(order)
            hosts.append(host)
        of_rank.append(order[node])
    report = {"of_rank": of_rank, "hosts": hosts, "slurm": None, "ranks_per_node": ranks_per_node,
              "resolved": None, "exchange": None, "topology": None, "notes": [], "refused": None}
    try:
        layout = slurm_layout(environ, size)
        if layout is not None:
            report["slurm"] = {"tasks_per_node": list(layout.counts) or None, "nodes": len(layout.counts)
                               or layout.nodes_only, "from": layout.variable}
    except UsageError as exc:
        report["slurm"] = {"error": str(exc)}
    if ranks_per_node is None:
        return report
    try:
        config = RunConfig(servers=parse_servers(servers), ranks_per_node=parse_ranks_per_node(ranks_per_node))
        if size <= config.non_worker_ranks():
            raise UsageError(f"a world of {size} rank(s) has no workers to put on nodes")
        topology, exchange, notes = resolve_topology(config, size, of_rank)
        notes += slurm_nodes_notes(config, size, topology, environ=environ)
    except UsageError as exc:
        report["refused"] = str(exc)
        return report
    report.update(resolved=topology.describe(config.colocated, config.non_worker_ranks()), exchange=exchange,
                  topology=topology.record(), notes=notes)
    return report


def _report(mpi, gathered: list, size: int, threads: int, gpus: dict | None = None) -> dict:
    ranks = [info for info, _, _ in gathered]
    mismatches = _version_mismatches([versions for _, versions, _ in gathered])
    errors = [error for _, _, error in gathered if error]
    if not errors:
        try:
            check_world_size(size)
        except UsageError as exc:
            errors.append(str(exc))
    library = mpi_library_version(mpi)
    return {
        "mpi_library": library,
        "mpi_implementation": mpi_implementation(library),
        "mpi_standard": "%d.%d" % mpi.Get_version(),
        "world_size": size,
        "threads_per_rank": threads,
        "slurm": {name: os.environ[name] for name in _SLURM_VARIABLES if name in os.environ},
        "versions": gathered[0][1],
        "version_mismatches": mismatches,
        "ranks": [asdict(info) for info in ranks],
        "warnings": _warnings(ranks, size, threads) + [
            f"ranks differ in {name}: {'; '.join(seen)}" for name, seen in mismatches.items()],
        "gpus": gpus,
        "error": errors[0] if errors else None,
    }


def _version_mismatches(per_rank: list[dict[str, str]]) -> dict[str, list[str]]:
    """Libraries whose version differs between ranks -> the distinct versions seen."""
    return {name: sorted({v[name] for v in per_rank})
            for name in per_rank[0] if len({v[name] for v in per_rank}) > 1}


def _warnings(ranks: list[RankInfo], size: int, threads: int) -> list[str]:
    warnings = oversubscription_warnings(ranks, threads)
    if size < 2:
        warnings.append("world size 1: mpigrad train needs at least 2 ranks "
                        "(rank 0 is the scheduler, and the server unless --servers colocated; the others train)")
    capped = [info.rank for info in ranks if info.numba_threads < threads]
    if capped:
        warnings.append(f"Numba runs fewer than {threads} threads on ranks {format_ranks(capped)}: "
                        f"its pool was sized by NUMBA_NUM_THREADS or the CPU count at import")
    return warnings


def _format(report: dict) -> str:
    ranks = [RankInfo(**{**info, "cpus": tuple(info["cpus"])}) for info in report["ranks"]]
    library = mpi_library_line(report["mpi_library"])
    slurm = report["slurm"]
    if "SLURM_NTASKS" not in slurm:
        slurm_line = "not under Slurm (SLURM_NTASKS unset)"
    else:
        verdict = ("matches world size" if slurm["SLURM_NTASKS"].strip() == str(report["world_size"])
                   else "MISMATCH")
        slurm_line = f"job {slurm.get('SLURM_JOB_ID', '?')}, SLURM_NTASKS={slurm['SLURM_NTASKS']} ({verdict})"
    servers = str(report.get("servers", "1"))
    if servers == "colocated":
        workers, role = report["world_size"] - 1, "scheduler, each worker serving a shard"
    elif servers.isdigit() and int(servers) > 1:
        workers = report["world_size"] - int(servers)
        others = int(servers) - 1
        role = f"scheduler and server, rank{'s' * (others > 1)} {format_ranks(range(1, others + 1))} server{'s' * (others > 1)}"
    else:
        workers, role = report["world_size"] - 1, "server"
    lines = [
        "mpigrad doctor",
        f"  MPI library      {report['mpi_implementation']}: {library} (MPI {report['mpi_standard']})",
        f"  world size       {report['world_size']} (rank 0 {role}, {workers} worker{'s' * (workers != 1)})",
        f"  Slurm            {slurm_line}",
        f"  threads/rank     {report['threads_per_rank']}",
        "  versions         " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "hosts",
    ]
    for host, infos in ranks_per_host(ranks).items():
        cpus = set().union(*(info.cpus for info in infos))
        lines.append(f"  {host}: {len(infos)} rank{'s' * (len(infos) != 1)} "
                     f"({format_ranks([i.rank for i in infos])}) on {len(cpus)} CPUs "
                     f"[{format_ranks(sorted(cpus))}]")
    lines.extend(_format_nodes(report.get("nodes")))
    lines.append("ranks")
    lines.append("  rank  host                  pid      cpus          torch  numba  "
                 + "  ".join(name.split("_")[0] for name in THREAD_VARIABLES))
    for info in ranks:
        env = "  ".join(f"{info.thread_env.get(name, '-'):>{len(name.split('_')[0])}}"
                        for name in THREAD_VARIABLES)
        lines.append(f"  {info.rank:>4}  {info.host[:20]:<20}  {info.pid:<7}  "
                     f"{format_ranks(info.cpus)[:12]:<12}  {info.torch_threads:>5}  "
                     f"{info.numba_threads:>5}  {env}")
    lines.extend(_format_gpus(report.get("gpus")))
    lines.extend(f"warning: {text}" for text in report["warnings"])
    if report["error"] is None:
        lines.append("launch OK" + (" (with warnings)" if report["warnings"] else ""))
    return "\n".join(lines)


def _format_nodes(nodes: dict | None) -> list[str]:
    """The report's nodes lines (``_nodes``): MPI's node map (up to 8 nodes listed), Slurm's
    tasks per node, and the run's nodes where ``--ranks-per-node`` was given."""
    if not nodes:
        return []
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes["of_rank"]):
        by_node.setdefault(node, []).append(rank)
    listed = "; ".join(f"node {node} ranks {format_ranks(ranks)} ({nodes['hosts'][node]})"
                       for node, ranks in list(by_node.items())[:8])
    more = f"; ... {len(by_node) - 8} more" if len(by_node) > 8 else ""
    lines = [f"nodes (MPI's shared-memory split): {len(by_node)} node(s): {listed}{more}"]
    slurm = nodes.get("slurm")
    if slurm and "error" in slurm:
        lines.append(f"  Slurm            {slurm['error']}")
    elif slurm and slurm["tasks_per_node"]:
        lines.append(f"  Slurm            {format_counts(slurm['tasks_per_node'])} tasks per node ({slurm['from']})")
    elif slurm:
        lines.append(f"  Slurm            {slurm['nodes']} node(s) ({slurm['from']}), tasks per node not set")
    L = nodes.get("ranks_per_node")
    if nodes.get("refused"):
        lines.append(f"  a run with --ranks-per-node {L} would be refused: {nodes['refused']}")
    elif nodes.get("resolved"):
        lines.append(f"  --ranks-per-node {L}: {nodes['resolved']}; exchange {nodes['exchange']} (--exchange auto)")
    lines.extend(f"  {note}" for note in nodes.get("notes", []))
    return lines


def _format_gpus(gpus: dict | None) -> list[str]:
    if gpus is None:
        return []
    aware = "yes" if gpus["cuda_aware_mpi"] else "no"
    staging = ("it could take device buffers; mpigrad stages them through pinned host memory all the same"
               if gpus["cuda_aware_mpi"] else "device buffers need host staging")
    lines = ["gpus", f"  CUDA-aware MPI   {aware}: {gpus['cuda_aware_why']} ({staging})"]
    if not any(gpus["devices_seen"].values()):
        lines.append("  no rank sees a CUDA device: a --device cuda run would be refused")
    elif gpus["refused"]:
        lines.append(f"  a --device cuda run would be refused: {gpus['refused']}")
    else:
        for rank, index in sorted(gpus["map"].items(), key=lambda item: int(item[0])):
            where = "CPU (takes no GPU)" if index is None else f"cuda:{index}"
            lines.append(f"  rank {rank} -> {where} (sees {gpus['devices_seen'][rank]})")
    return lines
