"""DDP's runs (``mpigrad bench peers``) on mpigrad's simulated network: a model, not a measurement.

``bench peers`` trains torch DDP (fp32, the fp16 hook, PowerSGD) on the task of an mpigrad
config and writes one mpigrad-format trace per run, timed on the wire it ran on (loopback, or
a network lab). To put those runs beside mpigrad's runs on the simulated clock (``trace
compare --peers``, examples/map), each DDP trace is re-timed here, at the mpigrad runs'
network, by a model of DDP's iteration:

    seconds(m) = local(m) + max(NIC(m), intra(m))
    NIC(m)     = A(m) x 2 (P - 1) x latency + nic_bytes(m) / bandwidth
    intra(m)   = A(m) x 2 (P - 1) x intra_latency + ring_bytes(m) / intra_bandwidth   (L > 1 only)

- ``nic_bytes(m)``: what each node's NIC sends in iteration m (and as much comes in: full
  duplex, so the sent bytes set the time), :func:`nic_bytes_per_node`. A ring all-reduce of
  G bytes over P ranks in node order (``bench peers`` starts DDP's ranks so: node k holds
  ranks kL..kL+L-1) sends 2 (P - 1) / P x G from every rank to the next, and of a node's L
  ranks only the last sends to another node (the first of the next): each NIC carries
  2 (P - 1) / P x G out and in, one rank's ring bytes, not L times them, whatever L. That is
  (bytes_up + bytes_down) / P of the trace, as the bench counted it for what each hook
  all-reduces (docs/peers.rst, "Bytes per node"), on N = P / L >= 2 nodes; on one node
  nothing crosses a NIC (NIC(m) = 0).
- ``A(m)``: the all-reduces of the iteration, each 2 (P - 1) ring steps paying the latency:
  1 for fp32 and fp16 (one per DDP bucket in truth; the default buckets are not recorded, a
  few latencies of 0.5 ms each), 3 for PowerSGD from its start (uncompressed tensors, P
  factors, Q factors), 1 before it;
- ``intra(m)``: on nodes of L > 1 workers (the mpigrad runs' ``ranks_per_node``), the ring's
  other L - 1 hops in each node go over the links inside it (``intra_bandwidth``,
  ``intra_latency``), each carrying a rank's ring bytes, ``ring_bytes(m)`` = (bytes_up +
  bytes_down) / P (what ``nic_bytes(m)`` is on two nodes or more), in the same ring steps as
  the NIC's hop, each step as slow as its slower hop: exact where one kind of hop is the
  slower in every step (with the defaults, 10 GB/s and 5 us, the NIC's, as with one rank per
  node), a lower bound otherwise;
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
draws from the DDP run's seed); mpigrad models nodes of several workers at a constant rate
only, so the intra-node term never meets a schedule.
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
from .labels import NODE_KEYS, trace_ranks_per_node
from .tables import AnalysisError

__all__ = ["load_peer_runs", "is_peer", "model_peer_trace", "model_peers_at", "networks_of", "nic_bytes_per_node",
           "MODELLED_MARK", "NODE_NETWORK_KEYS"]

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


def _workers(trace: Trace) -> int:
    return int(trace.attrs.get("workers") or len(trace.workers.filter(like="loss_").columns) or 1)


def nic_bytes_per_node(trace: Trace, ranks_per_node: int | None = None) -> np.ndarray | None:
    """Per iteration, the bytes out of each node's NIC (as many come in), by the model:

    - a DDP trace of P ranks on nodes of L (``ranks_per_node``, default the trace's own), its
      ring in node order: one rank's ring bytes, (bytes_up + bytes_down) / P, on N = P / L
      >= 2 nodes (the module docstring), 0 on one node; AnalysisError (one line) where L
      does not divide P;
    - an mpigrad trace with ``steps/bytes_nic`` (nodes of several workers; every message
      across a NIC once): bytes_nic / N, the mean over its nodes (the hierarchical exchange
      loads them evenly);
    - an mpigrad trace of colocated servers, one worker per node: a worker's node sends
      (bytes_up + bytes_down) / P (its frames and P - 1 copies of its average);
    - None for separate servers on nodes of their own, whose server nodes carry P times a
      worker's: no one figure per node."""
    steps = trace.steps
    workers = _workers(trace)
    up, down = steps["bytes_up"].to_numpy(float), steps["bytes_down"].to_numpy(float)
    if is_peer(trace):
        L = trace_ranks_per_node(trace.config) if ranks_per_node is None else int(ranks_per_node)
        if L < 1 or workers % L:
            raise AnalysisError(f"{trace.path}: a DDP run of {workers} ranks cannot sit on nodes of {L}: "
                                "L must divide the ranks")
        return (up + down) / workers if workers // L > 1 else np.zeros(len(steps))
    L = trace_ranks_per_node(trace.config)
    if "bytes_nic" in steps.columns and workers % L == 0:
        return steps["bytes_nic"].to_numpy(float) / (workers // L)
    if trace.config.get("servers") == "colocated" and L == 1:
        return (up + down) / workers
    return None


def _allreduces(trace: Trace, iterations: np.ndarray) -> np.ndarray:
    peer = trace.config["peer"]
    if peer.get("hook") == "powersgd" and peer.get("start_powerSGD_iter") is not None:
        return np.where(iterations >= int(peer["start_powerSGD_iter"]), 3, 1)
    return np.ones(len(iterations), dtype=int)


def model_peer_trace(trace: Trace, bandwidth: float | str, latency: float | str,
                     compute_time: float | None, ranks_per_node: int = 1, intra_bandwidth: float | None = None,
                     intra_latency: float = 0.0) -> Trace:
    """A copy of the DDP ``trace`` whose ``steps/sim_time`` (and ``t_comm``) follow the model
    of the module docstring at ``bandwidth`` (bytes/s or a schedule as ``config.parse_bandwidth``
    keeps it) and ``latency``, with ``compute_time`` (s) as each iteration's local work, None
    for the run's own measured iteration times, on nodes of ``ranks_per_node`` ranks (the
    bandwidth and latency then each node's NIC's; ``intra_bandwidth`` bytes/s and
    ``intra_latency`` s the links inside a node, None: no intra-node term); its config says so
    (``bandwidth``, ``latency``, ``compute_time``, ``ranks_per_node``, ``net_mode =
    "virtual"``, ``modelled``) and its label ends in " (modelled)". AnalysisError (one line)
    where ``ranks_per_node`` does not divide the run's ranks."""
    if not is_peer(trace):
        raise AnalysisError(f"{trace.path}: not a DDP run of bench peers")
    try:
        network = network_from(bandwidth, latency, {}, int(trace.config.get("seed", 0)))
    except UsageError as exc:
        raise AnalysisError(str(exc)) from None
    rate = network.bandwidth if network is not None else Constant(bandwidth)
    delay = network.latency if network is not None else Constant(latency)
    steps = trace.steps
    workers = _workers(trace)
    iterations = steps["iteration"].to_numpy(int)
    L = int(ranks_per_node)
    per_node = nic_bytes_per_node(trace, L)
    ring = (steps["bytes_up"].to_numpy(float) + steps["bytes_down"].to_numpy(float)) / workers  # each rank's
    rounds = _allreduces(trace, iterations) * 2 * (workers - 1)
    across = workers // L > 1           # on one node nothing crosses a NIC
    intra = L > 1 and intra_bandwidth is not None
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
        nic = (0.0 if rounds[m] == 0 or not across else   # P = 1 or one node: nothing on a NIC
               transfer_seconds(per_node[m], start, rate, delay) + (rounds[m] - 1) * delay.at(start))
        inside = rounds[m] * intra_latency + ring[m] / intra_bandwidth if intra and rounds[m] else 0.0
        t_comm[m] = max(nic, inside)
        sim = start + t_comm[m]
        sim_time[m] = sim
    new_steps = steps.copy()
    new_steps["sim_time"], new_steps["t_comm"] = sim_time, t_comm
    arrays = {table: dict(columns) for table, columns in trace.arrays.items()}
    arrays["steps"] = {**arrays["steps"], "sim_time": sim_time, "t_comm": t_comm}
    config = {**trace.config, "bandwidth": bandwidth, "latency": latency, "compute_time": compute_time,
              "ranks_per_node": L, "net_mode": "virtual", "modelled": True,
              "label": str(trace.config.get("label") or trace.label) + MODELLED_MARK}
    return dataclasses.replace(trace, config=config, tables={**trace.tables, "steps": new_steps}, arrays=arrays)


def model_peers_at(peers: Sequence[Trace], networks: Sequence[dict[str, Any]]) -> list[Trace]:
    """Every DDP run of ``peers`` modelled at each network of ``networks`` (dicts with
    ``bandwidth``, ``latency``, ``compute_time`` as in an mpigrad config, and for nodes of
    several workers :data:`NODE_NETWORK_KEYS` and the runs' ``labels.NODE_KEYS``). A
    modelled run's config takes the network's ``labels.NODE_KEYS`` (its nodes, and the
    exchange and precision of the mpigrad runs on them), so that ``trace compare``, whose
    ratios compare runs on the same nodes, finds it beside them: DDP's ring does not depend
    on mpigrad's exchange, and a network of runs on both exchanges models it once for each."""
    modelled = []
    for net in networks:
        for trace in peers:
            model = model_peer_trace(trace, net["bandwidth"], net["latency"], net.get("compute_time"),
                                     int(net.get("ranks_per_node") or 1), net.get("intra_bandwidth"),
                                     float(net.get("intra_latency") or 0.0))
            nodes = {key: net[key] for key in NODE_KEYS if key in net}
            modelled.append(dataclasses.replace(model, config={**model.config, **nodes}) if nodes else model)
    return modelled


#: The keys of a network of nodes of several workers (``networks_of``), beside the bandwidth
#: (each NIC's), latency and compute charge.
NODE_NETWORK_KEYS = ("ranks_per_node", "intra_bandwidth", "intra_latency")


def networks_of(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    """The distinct simulated networks (``bandwidth``, ``latency``, ``compute_time``, and for
    a run on nodes of several workers :data:`NODE_NETWORK_KEYS`: its nodes, whose NICs the
    bandwidth and latency are, and ``labels.NODE_KEYS``: the exchange the runs took on them,
    which ``trace compare`` groups by) of mpigrad's runs among ``traces``, in the order first
    seen; peer runs and runs with ``net_mode = "off"`` are left out."""
    seen: dict[str, dict[str, Any]] = {}
    for trace in traces:
        config = trace.config
        if is_peer(trace) or not isinstance(config, dict) or config.get("net_mode", "virtual") == "off":
            continue
        if "bandwidth" not in config or "latency" not in config:
            continue
        net = {key: config.get(key) for key in ("bandwidth", "latency", "compute_time")}
        if trace_ranks_per_node(config) > 1:
            defaults = _node_defaults()
            net.update({key: config.get(key, defaults[key]) for key in (*NODE_NETWORK_KEYS, *NODE_KEYS)})
        seen.setdefault(json.dumps(net, sort_keys=True), net)
    return list(seen.values())


def _node_defaults() -> dict[str, Any]:
    """The config's defaults of :data:`NODE_NETWORK_KEYS` and ``labels.NODE_KEYS`` (for a
    trace that lacks one)."""
    from ..config import RunConfig

    defaults = RunConfig()
    return {key: getattr(defaults, key) for key in (*NODE_NETWORK_KEYS, *NODE_KEYS)}
