"""Rank 0's start-up text: what the run is (model, codec, policy, shards, network, nodes,
cost model, warm-ups, where the ranks wait) in the lines a researcher reads at the head of a
job's log."""

from __future__ import annotations

from mpi4py import MPI

from ...analysis.labels import format_value
from ...codecs import get_codec
from ...machine import mpi_library_line, mpi_library_version
from ...trace import network
from ...units import format_duration, format_network_value, format_rate
from ..exchange.build import broadcast_codec, piece_bytes
from ..exchange.device import codec_path
from ..plan.checks import replaced_bits_note
from ..plan.environment import format_ranks
from ..plan.nodes import nodes_line
from .script import _SCRIPT_NAMED, SCRIPT_KEYS


def describe_run(config, server, size: int, log, warm_up_s: float | None = None,
                 device_warm_ups: list[float] = ()) -> None:
    """rank 0's start-up lines; ``device_warm_ups``: the workers' device warm-ups, seconds."""
    layout = server.replica.layout
    quantized = sum(s.size for s in layout.quantized)
    if server.colocated:
        servers = "scheduler, each worker serving a shard (colocated)"
    else:
        servers = "server" if server.servers == 1 else f"{server.servers} servers"
    log(f"mpigrad {_version()}: {server.workers} workers + {servers}, MPI: {mpi_library_line(mpi_library_version(MPI))}")
    held = ("fp32: nothing quantized" if config.codec == "fp32" else
            f"{len(layout.quantized)} quantized layer(s) holding {quantized / max(layout.total, 1):.1%}")
    log(f"model {config.model} on {server.data_description}: {layout.total:,} parameters, {held}")
    if server.buffer_sync.size:
        log(f"model buffers (BatchNorm statistics): {server.buffer_sync.size:,} values, averaged over the "
            "workers after each evaluated iteration, before a checkpoint and at the end")
    if server.servers > 1:
        log(shard_description(server.shards, server.codec, server.chunks, config.shard_chunk))
    log(f"network: {network_description(config)}")
    nodes = nodes_line(config.topology, config.exchange, config) if config.topology is not None else None
    if nodes:  # the launch resolved them (in-process loopback runs have none)
        log(nodes)
    note = replaced_bits_note(config, server.codec)
    if note:
        log(note)
    links = network.current()
    if links != network.HOST:  # in mpigrad lab: the real links, as the trace records them
        log(f"links: {network.describe(links)} (mpigrad lab)")
        warning = lab_clock_warning(config, links)
        if warning:
            log(warning)
    if config.compute_time is not None and config.net_mode != "off":
        log(f"local work: {local_work_description(config, server)}")
    waits = getattr(server.channel, "waits", None)
    if waits:
        log(f"waits: {waits_description(config.wait, waits)}")
    where = codec_path(config, [server.codec, broadcast_codec(config)[0], get_codec({"id": "fp32"})])
    if where:
        log(where)
    if warm_up_s is not None:
        log(f"warm-up: every codec this run can use compiled or loaded from Numba's cache before iteration 0, "
            f"in {warm_up_s:.1f} s on rank 0")
    if device_warm_ups:
        log(f"device warm-up: every device kernel this run can use launched once on each of "
            f"{len(device_warm_ups)} worker(s) before iteration 0, in parallel, {max(device_warm_ups):.1f} s at most")
    log("config: " + config_description(config, server.codec, script=getattr(server, "script", False)))


def waits_description(mode: str, waits: dict[str, list[int]]) -> str:
    """The ``waits:`` start-up line: how the ranks wait for messages, and why."""

    why = {"auto": "auto: ", "spin": "--wait spin: ", "sleep": "--wait sleep: "}[mode]
    if not waits["sleep"]:
        return f"polling without sleeping on every rank ({why}{'each rank has a core per thread' if mode == 'auto' else 'asked for'})"
    if not waits["spin"]:
        reason = "ranks outnumber the cores of their node" if mode == "auto" else "asked for"
        return f"sleep-polling with back-off to 0.5 ms on every rank ({why}{reason})"
    return (f"polling without sleeping on ranks {format_ranks(waits['spin'])}, sleep-polling on ranks "
            f"{format_ranks(waits['sleep'])} (auto: by the cores of each node)")


#: Config keys the ``network:`` line states (in their units), left out of the ``config:`` line
#: (the links inside a node: stated where nodes hold several workers, else of no use).
_NETWORK_KEYS = ("bandwidth", "latency", "link_bandwidth", "intra_bandwidth", "intra_latency")


def config_description(config, codec=None, script: bool = False) -> str:
    """The ``config:`` line: every option but the network's (the ``network:`` line states
    it), a value with a unit as a user writes it (``compute_time=50ms``); without ``bits``
    where the run's ``codec`` takes none (``fp32``, a codec given by its levels), and for a
    ``script``'s run (:class:`mpigrad.Session`) without the keys the script owns but its
    model, data and optimizer (rank 0's note names those the config file set)."""

    values = config.to_dict()
    left_out = set(_NETWORK_KEYS)
    if codec is not None and not codec.takes_policy_bits:
        left_out.add("bits")
    if script:

        left_out |= set(SCRIPT_KEYS) - set(_SCRIPT_NAMED)
    return " ".join(f"{k}={format_value(v, k)}" for k, v in sorted(values.items()) if k not in left_out)


def shard_description(shards, codec, chunks, setting) -> str:
    """The shards' sizes at the initial bits, how far the largest is from an even split (the
    busiest server's link sets the round's time) and how the layers were cut (``chunks``,
    a ``layout.Chunks``, from ``--shard-chunk setting``)."""

    size = piece_bytes(codec)
    loads = [sum(size(piece) for piece in shard.pieces) for shard in shards]
    even = sum(loads) / len(loads)
    pieces = sum(len(shard.pieces) for shard in shards)
    text = (f"shards at the initial bits: {', '.join(f'{n / 1e6:.2f}' for n in loads)} MB; the largest "
            f"{max(loads) / even:.2f}x an even split; {pieces} pieces, {chunks.describe()} (--shard-chunk {setting}"
            + ("; the factors go by whole layers" if codec.two_rounds else "") + ")")
    if max(loads) > 1.2 * even and not chunks.quantized:
        text += "; --shard-chunk auto or N cuts layers into pieces the servers can share"
    return text


def network_description(config) -> str:
    """The network model in words, the rate in bytes and in bits (``10MB/s (80Mbit/s)``);
    with nodes of several workers (``ranks_per_node`` L > 1) the rate is each node's NIC,
    and the links inside a node follow (``--intra-bandwidth``, ``--intra-latency``)."""
    if config.net_mode == "off":
        return "not modelled (net_mode off: the simulated clock is the wall clock)"
    clock = "simulated clock" if config.net_mode == "virtual" else "real sleeps"
    rate = (f"{config.bandwidth} (schedule on the simulated clock)" if isinstance(config.bandwidth, str)
            else format_rate(config.bandwidth))
    latency = (f"{config.latency} (schedule)" if isinstance(config.latency, str) else format_duration(config.latency))
    links = "".join(f", rank {rank}'s link {format_network_value(value)}"
                    for rank, value in sorted(config.link_bandwidth.items(), key=lambda item: int(item[0])))
    L = config.ranks_per_node
    if isinstance(L, int) and L > 1:
        return (f"{rate} per node's NIC (shared by its {L} workers), latency {latency} per message; inside a node "
                f"{format_rate(config.intra_bandwidth)} per worker's link, latency "
                f"{format_duration(config.intra_latency)}; {config.broadcast} broadcast, {clock}")
    return (f"{rate} per link{links}, latency {latency} per message, "
            f"{config.broadcast} broadcast, {clock}")


def lab_clock_warning(config, links: dict) -> str | None:
    """The line warning that a run in the lab (``links``) is timed by a network model of
    another rate than its links' (None where it is timed by the wire, net_mode off, or by a
    model of the links' own rate)."""
    if links.get("kind") != "lab" or config.net_mode == "off":
        return None
    model = format_network_value(config.bandwidth)
    if model == links.get("rate") and not links.get("node_rates") and not config.link_bandwidth:
        return None
    return (f"mpigrad: warning: timed by the network model ({model} per link), not by the lab's links "
            f"({network.describe(links)}): pass --net-mode off to be timed by the wire, or the links' rate "
            "as --bandwidth to model them")


def local_work_description(config, server) -> str:
    """What a --compute-time run charges for local work, in words."""
    compute = f"{format_duration(config.compute_time)} per iteration for compute"
    if server.clock.local_costs is None and server.codec.two_rounds:
        return (f"{compute}; policy, encode, decode and average not charged (no cost model has "
                f"{config.codec}'s matrix products)")
    if server.clock.local_costs is None:
        return f"{compute}; policy, encode, decode and average not charged (--cost-model none)"
    model, _ = server.clock.local_costs
    name = "the package's cost model" if config.cost_model == "default" else f"cost model {config.cost_model}"
    charged = model.charges_policy(config.policy)
    layers = max(len(server.replica.layout.quantized), 1)

    def ms(bits: int) -> str:
        return f"{1e3 * server.clock.local_seconds([bits] * layers):.2f} ms"

    if not server.codec.takes_policy_bits:  # its width is the codec's: the policy's bits change nothing
        cost = f"{ms(server.codec.fixed_bits)} per iteration"
    else:
        lowest, highest = server.policy.bits_range()
        cost = (f"{ms(lowest)} per iteration at {lowest} bits" if lowest == highest else
                f"{ms(lowest)} per iteration at {lowest} bits to {ms(highest)} at {highest} bits")
    text = (f"{compute}, {'policy, ' if charged else ''}encode, decode and average by {name} "
            f"(measured on {model.machine}): {cost}")
    return text if charged else f"{text}; policy {config.policy!r} not in the model: not charged"


def _version() -> str:
    from ... import __version__
    return __version__
