"""``mpigrad lab``: build N namespaces on a bridge with rate-limited links, check each link's
rate, run a command one rank per node or L ranks per node (link events on a schedule), and
remove it all.

    mpigrad lab --nodes 3 --rate 10MB/s                       # build, check the links, remove
    mpigrad lab --nodes 3 --rate 10MB/s -- train --iterations 50 --net-mode off
    mpigrad lab --nodes 3 --event 20s:node2:down -- train --timeout 10 ...
    mpigrad lab --nodes 3 --rate 10MB/s@0s,100MB/s@60s,repeat@120s -- train --net-mode off ...
    mpigrad lab --nodes 2 --launch each -- python ddp_peer.py  # RANK, MASTER_ADDR, ... set
    mpigrad lab --nodes 2 --ranks-per-node 2 -- train --servers colocated ...  # 5 ranks: 3 in node 0, 2 in node 1

Exit: the command's exit code; 2 for a usage error or a host that cannot build a lab (one
line: not root, no ip netns, no tbf); 1 when the lab itself fails; 130 on Ctrl-C. Whatever
way it ends, the lab's namespaces, links, qdiscs and processes are removed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace

from ..errors import UsageError
from ..trace import network as run_network
from ..units import is_schedule, parse_duration, parse_schedule
from .host import LabError, require_lab
from .launch import CommandRun, Placement, each_plan, expand_command, mpi_plan, pass_ranks_per_node
from .netns import Lab, Topology, traffic
from .ratecheck import check_links, summary
from .shaping import EventSchedule, LinkEvent, Links, RateSchedules


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("A command starting with 'train' runs as 'python -m mpi4py -m mpigrad train ...'. "
                     "Needs root (or a container with NET_ADMIN, or a VM): see docs/lab.rst.")
    parser.add_argument("--nodes", type=int, default=3, help="nodes, one rank each unless --ranks-per-node (default 3)")
    parser.add_argument("--ranks-per-node", metavar="L",
                        help="L ranks in every node's namespace, behind the node's one link; the ranks of a node talk "
                             "through shared memory (MPICH) or loopback (gloo's TCP), not the link. --launch mpi starts "
                             "N*L+1 ranks: rank 0, mpigrad's scheduler, an extra rank in node 0 (node 0 holds ranks "
                             "0..L, node k ranks kL+1..kL+L, as mpigrad train places them); --launch each N*L (node k "
                             "holds ranks kL..kL+L-1). A train command gets --ranks-per-node L added when it has none "
                             "(another L there is refused). The rate check stays one transfer per link. Default: one "
                             "rank per node, rank I in node I")
    parser.add_argument("--rate", default="10MB/s", metavar="RATE|SCHEDULE",
                        help="every link's rate, both directions, e.g. 10MB/s, 80Mbit/s (default 10MB/s); or a "
                             "schedule as mpigrad train --bandwidth takes it (10MB/s@0s,100MB/s@60s[,repeat@120s], "
                             "markov:10MB/s,100MB/s,dwell=30s,60s), followed on the real clock from the command's "
                             "start: tc changes the links at the scheduled times")
    parser.add_argument("--node-rate", action="append", metavar="I=RATE|SCHEDULE",
                        help="node I's link at another rate or schedule (one rank per node: node I holds rank I, as "
                             "train's --link-bandwidth I=...; with --ranks-per-node, the link node I's ranks share)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of markov: schedules (default 0; give the train run's --seed for the same draw)")
    parser.add_argument("--latency", help="added one-way delay per link end, e.g. 1ms (needs netem in the kernel; "
                        "one delay, not a schedule)")
    parser.add_argument("--event", action="append", metavar="TIME:nodeI:ACTION",
                        help="at TIME after the command starts: down, up or rate=RATE, e.g. 5s:node2:down, "
                             "3s:node1:rate=1MB/s")
    parser.add_argument("--launch", choices=["mpi", "each"], default="mpi",
                        help="mpi: one mpiexec, rank I in node I or as --ranks-per-node places them (default); each: "
                             "the command once per node (once per rank with --ranks-per-node)")
    parser.add_argument("--name", default="mgl", help="lab name, the prefix of its namespaces (default mgl)")
    parser.add_argument("--subnet", default="10.77.0.0/24", help="the nodes' addresses (default 10.77.0.0/24)")
    parser.add_argument("--check", choices=["mpi", "tcp", "none"], default=None,
                        help="rate check before the command: MPI messages under mpiexec, plain TCP sockets, or "
                             "none (default: mpi with --launch mpi, tcp with --launch each)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")


def _ranks_per_node(value: str | None) -> int | None:
    """``--ranks-per-node L``: a whole number >= 1, None when not given (one rank per node)."""
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise UsageError(f"--ranks-per-node {value!r}: give a whole number L >= 1 of ranks per node (the lab places "
                         "the ranks; train's auto then finds them)")
    return int(value)


def _rates(args: argparse.Namespace) -> dict[int, object]:
    """Each node's rate schedule (``clockmodel.Constant`` for one rate). A Markov schedule
    draws as ``mpigrad train`` does with ``--seed``: ``--rate`` as its ``--bandwidth``,
    ``--node-rate I=`` as its ``--link-bandwidth I=``."""
    rate = parse_schedule(args.rate, "bandwidth", args.seed)
    rates = {i: rate for i in range(args.nodes)}
    for item in args.node_rate or []:
        index, sep, value = item.partition("=")
        if not sep or not index.strip().isdigit() or int(index) not in rates:
            raise UsageError(f"--node-rate {item!r}: use I=RATE with I a node 0..{args.nodes - 1}")
        rates[int(index)] = parse_schedule(value, "bandwidth", args.seed, f"link{int(index)}")
    return rates


def _rate_texts(args: argparse.Namespace, rates: dict[int, object]) -> dict[int, float | str]:
    """Each node's rate as the trace records it: bytes/s for a constant rate, else the
    schedule as written."""
    texts = {i: args.rate for i in rates}
    for item in args.node_rate or []:
        index, _, value = item.partition("=")
        texts[int(index)] = value
    return {i: rates[i].at(0.0) if rates[i].constant else "".join(texts[i].split()) for i in rates}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: stop the command, remove the lab, exit 130."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    topology = Topology(args.name, args.nodes, args.subnet)
    rates = _rates(args)
    events = [LinkEvent.parse(text) for text in args.event or []]
    for event in events:
        topology.node(event.node)  # UsageError for a node the lab does not have
    if args.latency and is_schedule(args.latency):
        raise UsageError(f"--latency {args.latency!r}: the lab applies one delay, not a latency schedule "
                         "(rate schedules only: --rate, --node-rate)")
    latency = parse_duration(args.latency) if args.latency else 0.0
    if events and not command:
        raise UsageError("--event needs a command to run")
    scheduled = sorted(i for i, schedule in rates.items() if not schedule.constant)
    if scheduled and not command:
        raise UsageError("a rate schedule needs a command to run (it is followed from the command's start)")
    clash = sorted({e.node for e in events if e.action == "rate" and e.node in scheduled})
    if clash:
        raise UsageError(f"--event rate=... on node(s) {', '.join(map(str, clash))}, whose rate follows a schedule: "
                         "put the change in the schedule")
    placement = Placement.of(args.launch, args.nodes, _ranks_per_node(args.ranks_per_node))
    command = pass_ranks_per_node(command, placement.ranks_per_node)
    support = require_lab()
    if latency and support.latency_reason:
        raise UsageError(support.latency_reason)
    plan = None
    if command:
        command = expand_command(command, args.launch)
        plan = (mpi_plan(topology, command, placement=placement) if args.launch == "mpi"
                else each_plan(topology, command, placement))
        # Every process learns the lab's network: mpigrad train records it in its trace.
        network = run_network.lab_network(args.nodes, _rate_texts(args, rates), latency,
                                          [e.text() for e in sorted(events, key=lambda e: e.at)], args.seed)
        plan = replace(plan, env={**plan.env, run_network.VARIABLE: json.dumps(network)})
    log = lambda message: print(message, flush=True)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    lab = Lab(topology, log=log)
    try:
        check = args.check or ("tcp" if args.launch == "each" else "mpi")
        code = _run_in_lab(lab, rates, latency, events, plan, placement, check, log)
    except LabError as exc:
        print(f"mpigrad lab: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        removed = _remove(lab, log, previous)
    return code if removed else max(code, 1)


def _remove(lab: Lab, log, sigterm_handler) -> bool:
    """Tear the lab down with SIGINT and SIGTERM ignored (a second Ctrl-C must not leave half a
    lab); False when that failed, printed as one line (the names left are in it)."""
    sigint_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        removed = lab.teardown()
        if removed.namespaces:
            ended = f", ended {len(removed.killed)} process(es) left inside" if removed.killed else ""
            log(f"lab: removed {', '.join(removed.namespaces)}{ended}")
        return True
    except LabError as exc:
        print(f"mpigrad lab: error: teardown: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        signal.signal(signal.SIGINT, sigint_handler)
        signal.signal(signal.SIGTERM, sigterm_handler)


def _run_in_lab(lab: Lab, rates: dict[int, object], latency: float, events: list[LinkEvent], plan,
                placement: Placement, check: str, log) -> int:
    topology = lab.topology
    lab.build()
    links = Links(topology, latency)
    for index, rate in rates.items():
        links.set_rate(index, rate.at(0.0))
    for node in topology.node_list:
        follows = "" if rates[node.index].constant else ", then on a schedule from the command's start"
        delay = f", +{latency * 1e3:g} ms" if latency else ""
        log(f"lab: node {node.index}: namespace {node.namespace}, {node.address} on lab0, "
            f"{rates[node.index].at(0.0) / 1e6:g} MB/s each way{follows}{delay}")
    if check != "none":
        log(summary(check_links(topology, links, check, log=log)))
    if plan is None:
        return 0
    nodes = placement.ranks_per_node is not None
    if nodes:
        scheduler = " (rank 0: the scheduler)" if placement.scheduler else ""
        log(f"lab: {placement.ranks} ranks, {placement.ranks_per_node} per node{scheduler}: {placement.describe()}; "
            "the ranks of a node talk through shared memory (MPICH) or loopback (TCP), not its link")
    before = _traffic(topology, log) if nodes else None
    schedule = EventSchedule(links, events, log=log)
    rate_schedules = RateSchedules(links, rates, log=log)
    running = CommandRun(plan)
    schedule.start()
    rate_schedules.start()
    try:
        result = running.wait()
    finally:
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits for the stop
        try:
            rate_schedules.stop()
            schedule.stop()
            running.stop()
        finally:
            signal.signal(signal.SIGINT, interrupt)
    log(f"lab: command exited {result.returncode} after {result.seconds:.1f} s")
    after = _traffic(topology, log) if before else None
    for node, counted, now in zip(topology.node_list, before or [], after or []):
        spent = now - counted
        log(f"lab: node {node.index} during the command: link {spent.sent / 1e6:.3f} MB out, "
            f"{spent.received / 1e6:.3f} MB in; loopback {spent.loopback / 1e6:.3f} MB")
    return result.returncode


def _traffic(topology: Topology, log) -> list | None:
    """Every node's byte counters (``netns.traffic``), or None, said in one line, where they
    cannot be read: the counts are a report, never a reason to fail the command."""
    try:
        return [traffic(node) for node in topology.node_list]
    except LabError as exc:
        log(f"lab: no traffic counts: {exc}")
        return None
