"""Where one iteration's time goes, for ``mpigrad bench peers --breakdown``: mpigrad's method
and torch DDP's variants, from the traces and phase logs of the same bench run.

Per method, medians over the steady iterations of every seed's run (each column's own median,
so the parts need not add up to ``s/it`` exactly):

- ``compute``: forward + backward, the slowest worker's in each iteration, wall seconds.
  mpigrad: its workers' ``begin`` phase in the phase log (the trace's ``t_compute`` holds CPU
  seconds where each rank has one thread on the CPU, which leave out the time a rank waits
  for a core); pipelined, where backward runs in ``gradients``, the trace's ``t_compute``. DDP: wall seconds from the forward's start to backward's last parameter
  gradient, less the hook's seconds in between; on a GPU, where the host's clock does not see
  the kernels, a bare forward + backward under ``no_sync()`` after the run, synchronized.
- ``codec``: mpigrad: the slowest worker's encode plus the slowest server's decode and
  re-encode (``t_encode + t_decode``, CPU seconds) and rank 0's policy (``t_policy``). DDP: the
  seconds its comm hook runs before it returns its future (the slowest rank's): the fp16 cast,
  PowerSGD's uncompressed part and P products; the rest of a hook runs in the all-reduce's
  callbacks and falls under ``rest``. Zero for DDP fp32 (no hook).
- ``wire``: the bytes the busiest node sends or receives per iteration at the lab's link rate
  (``--lab``), node by node from the trace's per-server and per-worker bytes
  (:func:`node_bytes`: unequal shards load one node more; on nodes of several workers each
  NIC's bytes, the trace's ``bytes_nic`` / N); ``-`` on loopback, where it is part of ``rest``.
- ``rest``: ``s/it`` minus the others: waiting for messages and for the slowest rank, the
  protocol's own steps, and (DDP) what its all-reduce does not overlap with backward.

Then mpigrad's phases (:mod:`mpigrad.runtime.roles.iteration`, from ``MPIGRAD_PHASE_LOG``): per
phase, the median milliseconds from the end of the phase before to its end on rank 0 and on
the slowest worker, and, where the model is on a GPU, the same span on the device's timeline
(CUDA events, :mod:`mpigrad.runtime.measure.phaselog`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..runtime.roles.iteration import PHASES
from ..trace import TraceError

#: The phases of one iteration in the order a phase log records their ends.
PHASE_ORDER = ("start", "begin", *PHASES, "end")


@dataclass
class BreakdownRow:
    """One method's iteration split into parts (seconds; ``wire`` None on loopback)."""

    method: str
    s_per_iteration: float
    compute: float
    codec: float
    wire: float | None
    rest: float


@dataclass
class PhaseRow:
    """One phase of mpigrad's iteration: median ms on rank 0 and on the slowest worker, host
    (``perf_counter``) and device (CUDA events; None without a GPU)."""

    phase: str
    rank0_ms: float | None
    worker_ms: float | None
    rank0_device_ms: float | None = None
    worker_device_ms: float | None = None


def node_bytes(trace, workers: int, servers: int, symmetric: bool) -> np.ndarray:
    """Per iteration, the bytes the busiest node sends or receives, from the trace's per-server
    and per-worker columns where it has them (mpigrad), node by node:

    - colocated servers, node k serving shard k: it sends its frames to the other shards
      (``bytes_sent[k]``) and P - 1 copies of its average (``bytes_out[k]``), and receives the
      other workers' frames of its shard (``bytes_in[k]``) and every other shard's average;
    - S separate servers: server s receives ``bytes_in[s]`` and sends its broadcast to each of
      the P workers, and to rank 0 (server 0), which decodes every shard and so also receives
      the other servers' broadcasts (a star, as the clock charges it); worker k sends
      ``bytes_sent[k]`` and receives every broadcast.

    Shards of unequal size (a layer too large to share, without ``--shard-chunk``) load one
    node more than the others, and this is what the links see. On nodes of several workers
    (``steps/bytes_nic``): each NIC's bytes, the mean over the nodes
    (``analysis.peers.nic_bytes_per_node``; the hierarchical exchange loads them evenly).
    Without those columns (DDP, whose ring is balanced): every node sends and receives (up +
    down) / P, or with S separate servers each server's link max(up, down) / S."""
    from ..analysis.peers import nic_bytes_per_node

    steps = trace.steps
    if not trace.config.get("peer") and "bytes_nic" in steps.columns:
        nic = nic_bytes_per_node(trace)
        if nic is not None:
            return nic
    up = steps["bytes_up"].to_numpy(float)
    down = steps["bytes_down"].to_numpy(float)
    per_node = None if trace.config.get("peer") else _per_node_bytes(trace, workers, servers, symmetric)
    if per_node is not None:
        return per_node
    if symmetric:
        return (up + down) / workers
    return np.maximum(up, down) / max(servers, 1)


def _per_node_bytes(trace, workers: int, servers: int, colocated: bool) -> np.ndarray | None:
    """:func:`node_bytes` from ``/servers`` and ``/workers``; None where a trace lacks them or
    their rows are not the steps' (a DDP trace, a run cut short)."""
    try:
        bytes_in = trace.array("servers", "bytes_in").astype(float)
        bytes_out = trace.array("servers", "bytes_out").astype(float)
        sent = trace.array("workers", "bytes_sent").astype(float)
    except TraceError:  # a trace without those tables
        return None
    rows = len(trace.steps)
    if not (bytes_in.shape[0] == bytes_out.shape[0] == sent.shape[0] == rows) or rows == 0:
        return None
    if bytes_in.shape[1:] != (servers,) or sent.shape[1:] != (workers,):
        return None
    if colocated:
        if servers != workers:
            return None
        sends = sent + (workers - 1) * bytes_out
        receives = bytes_in + bytes_out.sum(axis=1, keepdims=True) - bytes_out
        return np.maximum(sends, receives).max(axis=1)
    # Rank 0 (server 0) is in every shard's broadcast group: the other servers send P + 1
    # copies, and rank 0 receives their broadcasts besides its own shard's frames.
    copies = workers + (np.arange(servers) > 0)
    received = bytes_in.copy()
    received[:, 0] += bytes_out[:, 1:].sum(axis=1)
    server_link = np.maximum(received, copies * bytes_out).max(axis=1)
    worker_link = np.maximum(sent, bytes_out.sum(axis=1, keepdims=True)).max(axis=1)
    return np.maximum(server_link, worker_link)


def breakdown_row(method: str, traces: Sequence, first: Sequence[int], workers: int,
                  rate: float | None, compute_override: Sequence[np.ndarray | None] | None = None) -> BreakdownRow:
    """The row of one method's traces (``first[i]``: trace i's first steady iteration);
    ``rate``: the link's bytes per second, None on loopback; ``compute_override[i]``: trace
    i's compute per iteration from elsewhere (``worker_compute``), None: its ``t_compute``."""
    walls, compute, codec, wire = [], [], [], []
    for k, (trace, start) in enumerate(zip(traces, first)):
        steps = trace.steps
        peer = trace.config.get("peer")
        symmetric = bool(peer) or trace.config.get("servers") == "colocated"
        servers = int(trace.attrs.get("servers", 1) or 1)
        walls.append(np.diff(np.concatenate([[0.0], steps["wall_time"].to_numpy(float)]))[start:])
        override = compute_override[k] if compute_override is not None else None
        compute.append((override if override is not None else steps["t_compute"].to_numpy(float))[start:])
        parts = [steps[name].to_numpy(float)[start:] for name in ("t_encode", "t_decode", "t_policy")]
        codec.append(sum(np.nan_to_num(part) for part in parts))
        seconds = node_bytes(trace, workers, servers, symmetric)[start:] / rate if rate else np.zeros_like(walls[-1])
        wire.append(seconds)
    wall, comp, cod, wir = (np.concatenate(x) for x in (walls, compute, codec, wire))
    rest = wall - np.nan_to_num(comp) - cod - wir
    return BreakdownRow(method, float(np.median(wall)), float(np.nanmedian(comp)) if np.isfinite(comp).any()
                        else math.nan, float(np.median(cod)), float(np.median(wir)) if rate else None,
                        float(np.median(rest)))


def worker_compute(directory: Path, iterations: int, worker_ranks: Sequence[int]) -> np.ndarray | None:
    """Per iteration 0..iterations-1, the slowest worker's ``begin`` span (forward + backward,
    wall seconds) from a phase log; None when the log lacks an iteration."""
    from ..runtime.measure.phaselog import read

    lines = read(directory)
    spans = []
    for m in range(iterations):
        ranks = lines.get(m, {})
        values = [ranks[r]["t"]["begin"] - ranks[r]["t"]["start"] for r in worker_ranks
                  if r in ranks and {"start", "begin"} <= ranks[r]["t"].keys()]
        if len(values) != len(worker_ranks):
            return None
        spans.append(max(values))
    return np.array(spans)


def phase_rows(directories: Sequence[Path], first: Sequence[int], worker_ranks: Sequence[int]) -> list[PhaseRow]:
    """mpigrad's phases from the phase logs of its runs (one directory per seed), over the
    iterations from ``first[i]`` on."""
    from ..runtime.measure.phaselog import read

    host: dict[str, dict[str, list[float]]] = {p: {"rank0": [], "worker": []} for p in PHASE_ORDER[1:]}
    device: dict[str, dict[str, list[float]]] = {p: {"rank0": [], "worker": []} for p in PHASE_ORDER[1:]}
    for directory, start in zip(directories, first):
        for m, ranks in read(directory).items():
            if m < start:
                continue
            spans = {rank: _spans(line["t"]) for rank, line in ranks.items()}
            for phase in PHASE_ORDER[1:]:
                if 0 in spans and phase in spans[0]:
                    host[phase]["rank0"].append(spans[0][phase])
                    if "d" in ranks[0] and phase in ranks[0]["d"]:
                        device[phase]["rank0"].append(ranks[0]["d"][phase] / 1e3)
                values = [spans[r][phase] for r in worker_ranks if r in spans and phase in spans[r]]
                if values:
                    host[phase]["worker"].append(max(values))
                on_device = [ranks[r]["d"][phase] / 1e3 for r in worker_ranks
                             if r in ranks and phase in ranks[r].get("d", {})]
                if on_device:
                    device[phase]["worker"].append(max(on_device))

    def ms(values: list[float]) -> float | None:
        return float(np.median(values)) * 1e3 if values else None

    return [PhaseRow(phase, ms(host[phase]["rank0"]), ms(host[phase]["worker"]), ms(device[phase]["rank0"]),
                     ms(device[phase]["worker"]))
            for phase in PHASE_ORDER[1:] if host[phase]["rank0"] or host[phase]["worker"]]


def _spans(times: dict[str, float]) -> dict[str, float]:
    """Each logged phase's seconds, from the end of the phase logged before it."""
    spans, before = {}, None
    for phase in PHASE_ORDER:
        if phase not in times:
            continue
        if before is not None:
            spans[phase] = times[phase] - before
        before = times[phase]
    return spans


def _f(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_breakdown(rows: Sequence[BreakdownRow], phases: Sequence[PhaseRow], reference: str | None) -> None:
    """The two tables; ``reference``: the method whose ``s/it`` the ratios divide by."""
    base = next((r.s_per_iteration for r in rows if r.method == reference), None)
    print(f"\nwhere an iteration goes (ms, medians over the steady iterations){':' if not reference else f'; x = s/it over {reference}:'}")
    print(f"{'method':<34} {'ms/it':>8} {'compute':>8} {'codec':>8} {'wire':>8} {'rest':>8} {'x':>6}")
    for r in rows:
        ratio = r.s_per_iteration / base if base else None
        print(f"{r.method:<34} {1e3 * r.s_per_iteration:>8.2f} {_f(1e3 * r.compute, '.2f'):>8} "
              f"{1e3 * r.codec:>8.2f} {_f(None if r.wire is None else 1e3 * r.wire, '.2f'):>8} "
              f"{1e3 * r.rest:>8.2f} {_f(ratio, '.2f'):>6}")
    if phases:
        device = any(p.rank0_device_ms is not None or p.worker_device_ms is not None for p in phases)
        print("\nmpigrad's phases (ms from the end of the phase before, medians; host clock"
              + ("; device: CUDA events on the rank's stream)" if device else ")"))
        print(f"{'phase':<12} {'rank 0':>8} {'worker':>8}" + (f" {'rank 0 dev':>11} {'worker dev':>11}" if device else ""))
        for p in phases:
            line = f"{p.phase:<12} {_f(p.rank0_ms, '.2f'):>8} {_f(p.worker_ms, '.2f'):>8}"
            if device:
                line += f" {_f(p.rank0_device_ms, '.2f'):>11} {_f(p.worker_device_ms, '.2f'):>11}"
            print(line)
    print(flush=True)


def as_data(rows: Sequence[BreakdownRow], phases: Sequence[PhaseRow]) -> dict:
    """The tables as JSON-ready data (``peers.json``'s ``breakdown``)."""
    return {"rows": [dataclasses.asdict(r) for r in rows], "phases": [dataclasses.asdict(p) for p in phases]}
