"""DDP's runs (``mpigrad bench peers``) on mpigrad's simulated network: a model, not a measurement.

``bench peers`` trains torch DDP (fp32, the fp16 hook, PowerSGD) on the task of an mpigrad
config and writes one mpigrad-format trace per run, timed on the wire it ran on (loopback, or
a network lab). To put those runs beside mpigrad's runs on the simulated clock (``trace
compare --peers``, examples/map), each DDP trace is re-timed here, at the mpigrad runs'
network, by a model of DDP's iteration:

    seconds(m) = local(m) + A(m) x 2 (P - 1) x latency + bytes_per_node(m) / bandwidth

- ``bytes_per_node(m)`` = (bytes_up + bytes_down) / P of the trace: what each node of a ring
  all-reduce sends in iteration m, as the bench counted it for what each hook all-reduces
  (docs/peers.rst, "Bytes per node"); a node sends and receives at once (full duplex), so
  the sent bytes set the time;
- ``A(m)``: the all-reduces of the iteration, each 2 (P - 1) ring steps paying the latency:
  1 for fp32 and fp16 (one per DDP bucket in truth; the default buckets are not recorded, a
  few latencies of 0.5 ms each), 3 for PowerSGD from its start (uncompressed tensors, P
  factors, Q factors), 1 before it;
- ``local(m)``: the compute charge of the runs compared with (their ``compute_time``, so
  both sides pay the same fixed compute), or, where those runs measured their compute, the
  DDP run's own measured seconds of iteration m (loopback wall time, whose wire cost is
  small, not nothing).

What the model leaves out, all in DDP's favour: the fp16 casts and PowerSGD's matrix products
and orthogonalisation (mpigrad's codecs are charged by its cost model, DDP's by nothing), and
DDP's overlap of backward with the all-reduce is not modelled either (against DDP: its
communication is charged after the compute, as mpigrad's is). The iterations to a target
are DDP's own (its real losses); only the clock is modelled. A schedule (``10MB/s@0s,...``,
``markov:...``) charges each iteration's bytes from the simulated time it starts
communicating, as mpigrad's clock does (``clockmodel.transfer_seconds``; a Markov schedule
draws from the DDP run's seed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..clockmodel import Constant, transfer_seconds
from ..units import network_from
from ..errors import UsageError
from ..trace import Trace, TraceError, load
from .tables import AnalysisError

__all__ = ["load_peer_runs", "is_peer", "model_peer_trace", "model_peers_at", "networks_of", "MODELLED_MARK"]

#: Appended to a modelled DDP trace's label.
MODELLED_MARK = " (modelled)"


def is_peer(trace: Trace) -> bool:
    """True for a peer system's run (a DDP trace of ``bench peers``)."""
    return isinstance(trace.config, dict) and isinstance(trace.config.get("peer"), dict)


def load_peer_runs(path: str | os.PathLike) -> list[Trace]:
    """The DDP traces that ``bench peers`` listed in ``path`` (its ``peers.json``, or the
    folder holding it), read from beside it; mpigrad's own rows of the bench are left out.
    AnalysisError (one line) when the file or a trace it lists cannot be read."""
    path = Path(path)
    report = path / "peers.json" if path.is_dir() else path
    try:
        document = json.loads(report.read_text())
        rows = document["rows"]
        names = [name for row in rows for name in row["traces"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AnalysisError(f"--peers {path}: not a bench peers result ({type(exc).__name__}: {exc})") from None
    traces = []
    for name in names:
        try:
            trace = load(report.parent / name)
        except TraceError as exc:
            raise AnalysisError(f"--peers {path}: {exc}") from None
        if is_peer(trace):
            traces.append(trace)
    if not traces:
        raise AnalysisError(f"--peers {path}: it lists no DDP runs")
    return traces


def _allreduces(trace: Trace, iterations: np.ndarray) -> np.ndarray:
    peer = trace.config["peer"]
    if peer.get("hook") == "powersgd" and peer.get("start_powerSGD_iter") is not None:
        return np.where(iterations >= int(peer["start_powerSGD_iter"]), 3, 1)
    return np.ones(len(iterations), dtype=int)


def model_peer_trace(trace: Trace, bandwidth: float | str, latency: float | str,
                     compute_time: float | None) -> Trace:
    """A copy of the DDP ``trace`` whose ``steps/sim_time`` (and ``t_comm``) follow the model
    of the module docstring at ``bandwidth`` (bytes/s or a schedule as ``config.parse_bandwidth``
    keeps it) and ``latency``, with ``compute_time`` (s) as each iteration's local work, None
    for the run's own measured iteration times; its config says so (``bandwidth``,
    ``latency``, ``compute_time``, ``net_mode = "virtual"``, ``modelled``) and its label ends
    in " (modelled)"."""
    if not is_peer(trace):
        raise AnalysisError(f"{trace.path}: not a DDP run of bench peers")
    try:
        network = network_from(bandwidth, latency, {}, int(trace.config.get("seed", 0)))
    except UsageError as exc:
        raise AnalysisError(str(exc)) from None
    rate = network.bandwidth if network is not None else Constant(bandwidth)
    delay = network.latency if network is not None else Constant(latency)
    steps = trace.steps
    workers = int(trace.attrs.get("workers") or len(trace.workers.filter(like="loss_").columns) or 1)
    iterations = steps["iteration"].to_numpy(int)
    per_node = (steps["bytes_up"].to_numpy(float) + steps["bytes_down"].to_numpy(float)) / workers
    rounds = _allreduces(trace, iterations) * 2 * (workers - 1)
    wall = steps["wall_time"].to_numpy(float)
    measured = np.diff(np.concatenate([[0.0], wall]))
    local = measured if compute_time is None else np.full(len(wall), float(compute_time))
    t_comm = np.empty(len(wall))
    sim_time = np.empty(len(wall))
    sim = 0.0
    for m in range(len(wall)):
        start = sim + local[m]
        # every ring step pays the latency in force when the iteration starts communicating,
        # the bytes go at the rates in force while they travel
        t_comm[m] = (0.0 if rounds[m] == 0 else   # P = 1: no all-reduce on any wire
                     transfer_seconds(per_node[m], start, rate, delay) + (rounds[m] - 1) * delay.at(start))
        sim = start + t_comm[m]
        sim_time[m] = sim
    new_steps = steps.copy()
    new_steps["sim_time"], new_steps["t_comm"] = sim_time, t_comm
    arrays = {table: dict(columns) for table, columns in trace.arrays.items()}
    arrays["steps"] = {**arrays["steps"], "sim_time": sim_time, "t_comm": t_comm}
    config = {**trace.config, "bandwidth": bandwidth, "latency": latency, "compute_time": compute_time,
              "net_mode": "virtual", "modelled": True,
              "label": str(trace.config.get("label") or trace.label) + MODELLED_MARK}
    return dataclasses.replace(trace, config=config, tables={**trace.tables, "steps": new_steps}, arrays=arrays)


def model_peers_at(peers: Sequence[Trace], networks: Sequence[dict[str, Any]]) -> list[Trace]:
    """Every DDP run of ``peers`` modelled at each network of ``networks`` (dicts with
    ``bandwidth``, ``latency``, ``compute_time`` as in an mpigrad config)."""
    return [model_peer_trace(trace, net["bandwidth"], net["latency"], net.get("compute_time"))
            for net in networks for trace in peers]


def networks_of(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    """The distinct simulated networks (``bandwidth``, ``latency``, ``compute_time``) of
    mpigrad's runs among ``traces``, in the order first seen; peer runs and runs with
    ``net_mode = "off"`` are left out."""
    seen: dict[str, dict[str, Any]] = {}
    for trace in traces:
        config = trace.config
        if is_peer(trace) or not isinstance(config, dict) or config.get("net_mode", "virtual") == "off":
            continue
        if "bandwidth" not in config or "latency" not in config:
            continue
        net = {key: config.get(key) for key in ("bandwidth", "latency", "compute_time")}
        seen.setdefault(json.dumps(net, sort_keys=True), net)
    return list(seen.values())
