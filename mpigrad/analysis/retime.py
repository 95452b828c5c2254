"""`mpigrad trace retime`: a finished run's simulated clock, charged again under another network.

Every iteration's charge is a function of its messages' bytes and its local costs
(:mod:`mpigrad.clockmodel`), and a trace records both: each server's frames from each worker
(``servers/frame_bytes``; with one server, ``workers/bytes_sent``) and its broadcast
(``servers/bytes_out``); the loss report's and the Control's sizes follow from
``steps/bytes_up`` and ``bytes_down``; the local work is ``compute_time`` plus the cost
model's charge (the root attributes ``cost_model`` and ``local_work`` the run recorded, at
each iteration's ``steps/bits_layers``; ``cost_model`` another model's, ``"none"`` none), or
``steps/t_compute + t_encode + t_decode + t_policy``. The re-timed trace keeps every other
column (losses, accuracies, bits, bytes, wall times) and re-charges ``steps/t_comm``,
``steps/sim_time`` and ``eval/sim_time`` with the same code the runtime charged them with.
The new network may be a schedule (``--bandwidth 10MB/s@0s,1GB/s@60s``, ``markov:...``,
``--link-bandwidth RANK=...``): each iteration's messages are then charged from the same
simulated time the runtime would have sent them at (``clockmodel.comm_start``), and a Markov
schedule draws from the run's seed, as a run with that network would.

Nodes (``--ranks-per-node L``): the run's nodes, or others (``ranks_per_node``), with
``intra_bandwidth`` and ``intra_latency`` (default the run's) for the links inside a node; a
flat exchange's messages are the same on any nodes, so it is re-charged on another L; a
hierarchical one's depend on L (its slices, recorded in the ``shards`` attribute, and which
workers exchange frames), so it is re-charged on its own L only.

A pipelined run (``--pipeline``) is re-charged from its ``buckets`` table (when backward
made each bucket ready on each worker, each bucket's frames and average) through
``LinkModel.pipelined_iteration``, the rule its clock charged it with, on its own nodes only.

Refused: a trace that is not complete, one whose network was not modelled (``--net-mode
off``), and one whose policy reads the clock (``Policy.reads_clock``: its bits, hence its
bytes and losses, would differ on another network).
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path

import numpy as np

from .. import options
from ..clockmodel import IterationTraffic, LinkModel, NodeRound, Nodes, PipelinedTraffic, comm_start, iteration_seconds
from ..costmodel import CostModel, CostModelError, LocalWork, resolve
from ..config import BROADCASTS, COLOCATED
from ..units import format_network_value, network_from
from ..errors import UsageError
from ..policies import PolicyError, policy_class
from ..trace import TraceError, read_raw
from ..trace.schema import NODE_COLUMNS, node_step_columns
from ..trace.writer import write_closed
from .labels import flat_config

__all__ = ["retime", "retime_refusal", "recorded_traffic", "recorded_buckets", "local_costs"]

#: The config keys of a run's network (``link_bandwidth`` recorded where it is set).
NETWORK_KEYS = ("bandwidth", "latency", "broadcast", "link_bandwidth")
#: The config keys of a run's nodes, recorded with the network where it had several workers a node.
NODE_KEYS = ("ranks_per_node", "intra_bandwidth", "intra_latency")


def retime(source: str | os.PathLike, output: str | os.PathLike, *, bandwidth: float | str,
           latency: float | str | None = None, broadcast: str | None = None,
           link_bandwidth: dict[str, float | str] | None = None, force: bool = False,
           cost_model: str | None = None, ranks_per_node: int | None = None, intra_bandwidth: float | None = None,
           intra_latency: float | None = None) -> str:
    """Write ``output``: the trace ``source`` re-charged at ``bandwidth`` (bytes/s, or a
    schedule as ``config.parse_bandwidth`` keeps it), ``latency`` (s or a schedule; default
    the run's), ``broadcast`` (default the run's) and ``link_bandwidth`` (rank -> rate or
    schedule; default the run's), its local work by the cost model it recorded
    (``cost_model``: ``"none"``, ``"default"`` or a file instead); return a one-line summary.
    TraceError (one line) for a trace that cannot be re-timed or an output that may not be written."""
    source, output = Path(source), Path(output)
    if not isinstance(bandwidth, str) and not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise TraceError(f"bandwidth must be positive, got {bandwidth!r} bytes/s")
    if latency is not None and not isinstance(latency, str) and not (latency >= 0 and math.isfinite(latency)):
        raise TraceError(f"latency must be >= 0, got {latency!r} s")
    if broadcast is not None and broadcast not in BROADCASTS:
        raise TraceError(f"broadcast must be one of {', '.join(BROADCASTS)}, got {broadcast!r}")
    if output.exists() and output.resolve() == source.resolve():
        raise TraceError(f"{output} is the trace being re-timed; write to another file")
    options.check_overwrite([output], force, error=TraceError)
    raw = read_raw(source)
    config = raw.attrs.get("config")
    _check_retimable(source, raw, config)
    latency = config["latency"] if latency is None else latency
    links = dict(config.get("link_bandwidth") or {}) if link_bandwidth is None else dict(link_bandwidth)
    try:
        network = network_from(bandwidth, latency, links, int(config.get("seed", 0)))
    except UsageError as exc:
        raise TraceError(str(exc)) from None
    broadcast = config["broadcast"] if broadcast is None else broadcast
    nodes, node_keys = _nodes(source, config, ranks_per_node, intra_bandwidth, intra_latency)
    if nodes is not None and (network is not None or broadcast != "star"):
        raise TraceError("nodes of several workers are charged at one constant --bandwidth and --latency, with star "
                         "broadcasts: no schedule, --link-bandwidth or --broadcast tree|mpich with them")
    link = (LinkModel(bandwidth, latency, "virtual", broadcast, nodes=nodes) if network is None else
            LinkModel(network.bandwidth.at(0.0), network.latency.at(0.0), "virtual", broadcast, network))
    arrays = {table: dict(columns) for table, columns in raw.arrays.items()}
    steps = arrays["steps"]
    slice_bytes = (raw.attrs.get("shards") or {}).get("slice_bytes") if config.get("exchange") == "hierarchical" else None
    if config.get("exchange") == "hierarchical" and not slice_bytes:
        raise TraceError(f"{source}: a hierarchical run whose trace records no slices (shards.slice_bytes)")
    traffic = recorded_traffic(source, raw, colocated=flat_config(config).get("servers") == COLOCATED,
                               slice_bytes=slice_bytes or ())
    pipelined = recorded_buckets(source, raw, hierarchical=bool(slice_bytes)) if config.get("pipeline") else None
    if nodes is not None and traffic and traffic[0].workers % nodes.ranks_per_node:
        raise TraceError(f"{source}: {nodes.ranks_per_node} workers per node do not divide its {traffic[0].workers} "
                         "workers")
    compute_time = config.get("compute_time")
    local = local_costs(source, raw.attrs, compute_time, cost_model)
    local_memo: dict[tuple[int, ...], float] = {}
    t_comm = np.empty(len(traffic))
    sim_time = np.empty(len(traffic))
    node_parts = []  # on nodes, each row's (NodeRound): a pipelined one's overlapped schedule, or its rounds'
    sim = 0.0
    for row, iteration_traffic in enumerate(traffic):
        node_round = None
        if pipelined is not None:
            buckets = raw.arrays["buckets"]
            t_comm[row], node_round = link.pipelined_iteration(pipelined[row], sim, compute_time,
                                                               buckets["t_forward"][row], buckets["t_backward"][row])
        else:
            t_comm[row] = link.comm_seconds(iteration_traffic, comm_start(sim, compute_time, steps["t_compute"][row]),
                                            sent=sim)
        if link.nodes is not None:
            node_parts.append(node_round or link.node_breakdown(iteration_traffic))
        t_local = 0.0
        if local:
            bits = tuple(int(b) for b in steps["bits_layers"][row])
            if bits not in local_memo:
                local_memo[bits] = local[1].seconds(local[0], bits)
            t_local = local_memo[bits]
        sim += iteration_seconds(t_comm[row], compute_time, steps["t_compute"][row], steps["t_encode"][row],
                                 steps["t_decode"][row], steps["t_policy"][row], t_local)
        sim_time[row] = sim
    specs = _node_columns(raw.specs, steps, link, node_parts)
    old_end = float(steps["sim_time"][-1])
    steps["t_comm"], steps["sim_time"] = t_comm, sim_time
    if "eval" in arrays:
        arrays["eval"]["sim_time"] = _at_iterations(source, steps["iteration"], sim_time,
                                                    arrays["eval"]["iteration"])
    new_config = {**config, "bandwidth": bandwidth, "latency": latency, "broadcast": broadcast, **node_keys,
                  "retimed": True}
    if links or "link_bandwidth" in config:
        new_config["link_bandwidth"] = links
    attrs = {**raw.attrs, "config": new_config, "retimed_from": str(source),
             "cost_model": local[0].to_dict() if local else None,
             "local_work": local[1].to_dict() if local else raw.attrs.get("local_work"),
             "retimed_from_network": {key: config[key] for key in NETWORK_KEYS + NODE_KEYS * (int(config.get(
                 "ranks_per_node", 1)) > 1) if key in config and config[key] != {}},
             "retimed_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_closed(output, specs, arrays, attrs)
    return (f"wrote {output}: {len(sim_time)} iterations re-timed from {_network(config)} to {_network(new_config)}: "
            f"{old_end:.1f} s -> {sim:.1f} s simulated")


def _nodes(path: Path, config: dict, ranks_per_node: int | None, intra_bandwidth: float | None,
           intra_latency: float | None) -> tuple[Nodes | None, dict]:
    """The nodes a trace is re-charged on (None: a worker per node) and the config keys that
    say so; TraceError for nodes its run cannot be re-charged on."""
    recorded = config.get("ranks_per_node", 1)
    if type(recorded) is not int or recorded < 1:
        raise TraceError(f"{path}: its ranks_per_node {recorded!r} is not a number of workers (a trace of mpigrad "
                         "train records the nodes its launch resolved)")
    L = recorded if ranks_per_node is None else int(ranks_per_node)
    bandwidth = float(config.get("intra_bandwidth", 10e9) if intra_bandwidth is None else intra_bandwidth)
    latency = float(config.get("intra_latency", 5e-6) if intra_latency is None else intra_latency)
    if L < 1:
        raise TraceError(f"ranks_per_node must be at least 1, got {L}")
    if not (bandwidth > 0 and math.isfinite(bandwidth)) or not (latency >= 0 and math.isfinite(latency)):
        raise TraceError("intra_bandwidth must be positive and intra_latency >= 0")
    keys = {"ranks_per_node": L, "intra_bandwidth": bandwidth, "intra_latency": latency} if L > 1 or recorded > 1 else {}
    if L == recorded and L == 1:
        return None, keys
    if config.get("pipeline") and L != recorded:
        raise TraceError(f"{path}: a pipelined run's schedule is charged on its own {recorded} workers per node: "
                         f"re-run it on nodes of {L} instead")
    if config.get("exchange") == "hierarchical" and L != recorded:
        raise TraceError(f"{path}: a hierarchical run's messages depend on its {recorded} workers per node (its "
                         f"slices, and who exchanges frames): re-run it on nodes of {L} instead")
    if flat_config(config).get("servers") != COLOCATED:
        raise TraceError(f"{path}: nodes of several workers are modelled for --servers colocated runs only")
    return (Nodes(L, bandwidth, latency) if L > 1 else None), keys


def _node_columns(specs: dict, steps: dict, link: LinkModel, parts: list[NodeRound]) -> dict:
    """The table specs of the re-timed trace, with ``steps``' node columns (``bytes_nic``,
    ...) charged again on ``link``'s nodes (``parts``: each row's ``NodeRound``), or dropped
    where it has none."""
    steps_spec = {name: spec for name, spec in specs["steps"].items() if name not in NODE_COLUMNS}
    for name in NODE_COLUMNS:
        steps.pop(name, None)
    if link.nodes is not None:
        columns = node_step_columns()
        steps_spec.update({name: (np.dtype(dtype), shape) for name, (dtype, shape) in columns.items()})
        for name, attr in zip(NODE_COLUMNS, ("nic_bytes", "intra_bytes", "nic_seconds", "intra_seconds")):
            steps[name] = np.array([getattr(p, attr) for p in parts], dtype=columns[name][0])
    return {**specs, "steps": steps_spec}


def local_costs(path: Path, attrs: dict, compute_time, choice: str | None) -> tuple[CostModel, LocalWork] | None:
    """(model, work) that charge the trace's local work, None for none: the recorded model
    (``choice`` None), none, or the model ``choice`` names, at the recorded ``local_work``."""
    if compute_time is None:
        if choice not in (None, "none"):
            raise TraceError(f"{path}: its local work was measured (no compute_time), no cost model to replace")
        return None
    try:
        if choice is None:
            recorded = attrs.get("cost_model")
            model = None if recorded is None else CostModel.from_dict(recorded, source=f"recorded in {path}")
        else:
            model = resolve(choice)
        if model is None:
            return None
        if attrs.get("local_work") is None:
            raise TraceError(f"{path}: the trace records no local_work (a run before issue 24, or with "
                             "--cost-model none), so a cost model has nothing to charge")
        work = LocalWork.from_dict(attrs["local_work"])
        work.check(model)
    except CostModelError as exc:
        raise TraceError(f"{path}: {exc}") from None
    return model, work


def _network(config: dict) -> str:
    links = "".join(f" rank {rank} {format_network_value(value)}"
                    for rank, value in sorted((config.get("link_bandwidth") or {}).items(), key=lambda kv: int(kv[0])))
    nodes = int(config.get("ranks_per_node", 1))
    return (f"{format_network_value(config['bandwidth'])}{links} latency "
            f"{format_network_value(config['latency'], 'latency')} {config['broadcast']}"
            + (f", nodes of {nodes} workers (inside: {format_network_value(config['intra_bandwidth'])})"
               if nodes > 1 else ""))


#: Codecs whose iterations exchange two rounds (mpigrad.codecs: ``Codec.two_rounds``), named
#: here so that reading a trace does not import the codecs.
TWO_ROUND_CODECS = ("powersgd",)


def codec_two_rounds(codec) -> bool:
    """True for a two-round codec id (``powersgd``)."""
    return codec in TWO_ROUND_CODECS


def _check_retimable(path: Path, raw, config) -> None:
    status = str(raw.attrs.get("status", "running"))
    if status != "complete":
        raise TraceError(f"{path}: trace status {status!r}; only a complete run is re-timed")
    reason = retime_refusal(config, buckets_recorded="buckets" in raw.arrays)
    if reason:
        raise TraceError(f"{path}: {reason}")


def retime_refusal(config, rounds_rebuilt: bool = False, buckets_recorded: bool = False) -> str | None:
    """Why a run of ``config`` (a trace's config, or a RunConfig's ``to_dict()``) cannot be
    re-timed to another network, whatever its status; None when it can. The one rule for
    `trace retime` and for planners that decide between re-timing and re-running
    (examples/map/run.py). ``rounds_rebuilt``: the caller rebuilds a two-round codec's rounds
    from the config (``mpigrad simulate``), so that codec is no reason; ``buckets_recorded``:
    the trace keeps a pipelined run's buckets (its ``buckets`` table), so that is none."""
    if isinstance(config, dict) and "peer" in config:
        return "a peer system's run (mpigrad bench peers), not timed by mpigrad's clock model"
    needed = ("bandwidth", "latency", "broadcast", "net_mode", "policy")
    if not isinstance(config, dict) or any(key not in config for key in needed):
        return f"not a trace of `mpigrad train` (its config lacks {', '.join(needed)})"
    codec = flat_config(config).get("codec")
    if codec_two_rounds(codec) and not rounds_rebuilt:
        return (f"codec {codec!r} sends two rounds per iteration, which the trace's frame "
                "columns sum into one; re-run it on the other network instead")
    if config.get("pipeline") and not buckets_recorded:
        return ("a pipelined run (--pipeline) whose trace keeps no buckets table (written before "
                "traces kept one): its overlap depends on when backward produced each bucket; re-run it "
                "on the other network instead")
    if config["net_mode"] == "off":
        return "run with --net-mode off, so its times were measured, not modelled; nothing to re-charge"
    policy = flat_config(config).get("policy")
    try:
        reads_clock = policy_class(policy).reads_clock
    except PolicyError as exc:
        return str(exc)
    if reads_clock:
        return (f"policy {policy!r} reads the clock to choose its bits, so on another "
                "network the run itself would differ; re-run it instead")
    return None


def recorded_traffic(path: Path, raw, colocated: bool = False, slice_bytes=()) -> list[IterationTraffic]:
    """Each steps row's messages, from the trace's columns (``colocated``: the run's
    workers served the shards; ``slice_bytes``: a hierarchical run's slices)."""
    arrays = raw.arrays
    steps, servers = arrays["steps"], arrays.get("servers")
    if servers is None:
        raise TraceError(f"{path}: the trace has no servers table (not written by mpigrad train, or before "
                         "per-server bytes were recorded), so its broadcasts cannot be re-charged")
    if "frame_bytes" in servers:
        frames_in = servers["frame_bytes"]
    elif servers["bytes_out"].shape[1] == 1:  # one server: its frames are the workers' bytes
        frames_in = arrays["workers"]["bytes_sent"][:, np.newaxis, :]
    else:
        raise TraceError(f"{path}: the trace records no frame sizes per server and worker "
                         "(servers/frame_bytes, written since issue 24), which a run with several servers needs")
    iterations = steps["iteration"]
    sources = {"servers": servers["iteration"]}
    if "frame_bytes" not in servers:
        sources["workers"] = arrays["workers"]["iteration"]
    for table, rows in sources.items():
        if not np.array_equal(rows, iterations):
            raise TraceError(f"{path}: the {table} table's iterations are not the steps table's (damaged trace)")
    ahead = steps.get("control_ahead")  # control = "ahead" (older traces: every Control after the losses)
    traffic = []
    for row in range(len(iterations)):
        try:
            traffic.append(IterationTraffic.from_totals(steps["bytes_up"][row], steps["bytes_down"][row],
                                                        frames_in[row], servers["bytes_out"][row], colocated,
                                                        ahead=bool(ahead[row]) if ahead is not None else False,
                                                        slice_bytes=slice_bytes))
        except ValueError as exc:
            raise TraceError(f"{path}: iteration {int(iterations[row])}: {exc}") from None
    return traffic


def recorded_buckets(path: Path, raw, hierarchical: bool) -> list[PipelinedTraffic]:
    """A pipelined run's iterations bucket by bucket, from its trace's ``buckets`` table
    (``trace.schema.bucket_columns``; ``hierarchical``: the run's exchange, whose ``intra``
    bytes count). TraceError (one line) for a table that is not the steps table's rows."""
    buckets, steps = raw.arrays["buckets"], raw.arrays["steps"]
    iterations = steps["iteration"]
    if not np.array_equal(buckets["iteration"], iterations):
        raise TraceError(f"{path}: the buckets table's iterations are not the steps table's (damaged trace)")
    ahead = steps.get("control_ahead")
    traffic = []
    for row in range(len(iterations)):
        try:
            traffic.append(PipelinedTraffic.from_bucket_columns(
                {name: column[row] for name, column in buckets.items()},
                ahead=bool(ahead[row]) if ahead is not None else False, hierarchical=hierarchical))
        except (ValueError, KeyError) as exc:
            raise TraceError(f"{path}: iteration {int(iterations[row])}: {exc}") from None
    return traffic


def _at_iterations(path: Path, iterations: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``values`` of the steps rows whose iteration is each of ``wanted`` (an evaluation's
    simulated time is that of the iteration it follows)."""
    row_of = {int(m): row for row, m in enumerate(iterations)}
    missing = [int(m) for m in wanted if int(m) not in row_of]
    if missing:
        raise TraceError(f"{path}: evaluations after iterations {missing} that the steps table lacks")
    return np.array([values[row_of[int(m)]] for m in wanted], dtype=np.float64)
