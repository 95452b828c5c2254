"""A replay plan run on SimGrid, in a process of its own.

SimGrid allows one ``Engine`` per process, so every simulation runs in a child process:
:func:`run_plan` starts ``python -m mpigrad.simulate.engine``, writes the plan to it as JSON
and reads the result back. The child imports SimGrid and nothing of mpigrad but this
module, :mod:`.simgrid_module` and :mod:`mpigrad.errors`.

The plan (a :class:`~.plan.Plan`'s ``to_json``): ``platform`` (a SimGrid XML file),
``model`` (a key of :data:`NETWORK_MODELS`), ``hosts`` (the host of each rank),
``programs`` (distinct iterations, each a list of phases) and ``sequence`` (the program of
each simulated iteration). A phase is ``{"work": {rank: seconds}, "messages": [[src, dst,
bytes], ...], "send_wait": W, "recv_wait": W, "post_at": A, "floor": {rank: seconds}}``.
Every rank runs the phases it takes part in, in order: it executes its work (``this_actor.execute(seconds * speed)``,
its host's speed), or posts its receives (``get_async``; with ``post_at``, already at the
first of its phases from that earlier one on) and then its sends (``put_async``); it waits
for them before it goes on to the next phase where W is null, else only before phase W (a
later phase's index) or at the end of the iteration (``"end"``), going on meanwhile; with a
``floor``, it ends the phase no sooner than that long after it posted (messages left out of
the plan whose time it still takes: ``plan.aggregate``'s tiny ones). A
transfer starts when both ends are posted (SimGrid's rendezvous); each ordered pair of ranks
has one mailbox, matched in order, which both ends post in the same order. A phase with
``"fifo": true`` sends each of its messages after the sender's earlier fifo messages to the
same rank are through, as one connection carries them in order (TCP under MPI), without
holding the sender up: a small actor per message puts it once the one before it on the pair
is done (the rank waits for those actors where it would wait for its sends). A phase with
``"relay": J`` (an earlier phase) and ``"chain": C``: a rank that sends in it and receives in
phase J forwards what it received, as a node's slice owner does: a small actor, created as
the iteration starts, takes the rank's receives of phase J (the rank does not post them),
then waits for the rank to reach this phase, then for the rank's previous actor of chain C
to be done, and then sends this phase's messages one after another (the rank goes on at
once). Each phase has mailboxes of its own, so that messages of two phases between one
pair never match each other's receives. ``hosts[rank]``
indexes the platform's hosts in natural order of their names (``node-2`` before ``node-10``).

The result: ``ends[m][k]``, the latest time any rank finished its part of phase k of
iteration m (a work's end, the last of its transfers' ``finish_time``; None where no rank
took part), and ``clock``, the simulated time at the end.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time

from ..errors import UsageError

__all__ = ["NETWORK_MODELS", "run_plan", "natural_key", "main"]

#: SimGrid's network models by the name ``--network-model`` takes, as ``--cfg`` options.
#: ``cm02``: CM02 without the TCP window (``TCP-gamma:0``) and without the 5 % of every
#: flow's rate charged to its reverse path (``crosstraffic:0``): a single flow takes
#: latency + bytes / bandwidth, concurrent flows share links max-min fairly. ``lv08``:
#: SimGrid's default (CM02 fitted to TCP: latency x 13.01, bandwidth x 0.97, the window
#: cap, cross traffic on). Both with ``network/optim:Full`` (:data:`FULL_UPDATES`).
NETWORK_MODELS = {
    "cm02": ["--cfg=network/model:CM02", "--cfg=network/TCP-gamma:0", "--cfg=network/crosstraffic:0"],
    "lv08": ["--cfg=network/model:LV08"],
}

#: SimGrid 3.32's lazy updates (``network/optim:Lazy``, the models' default) let flows through
#: a NIC faster than its rate in some phases once messages have a latency: 64 nodes of the
#: hierarchical exchange's gradients, 16.5 MB into one NIC of 1.25 GB/s, ended in 10.2 ms
#: instead of 13.2 (``tests/test_simulate.py``, a latency that makes an iteration faster).
#: Full updates recompute every share at every event; they cost little here (DDP's ring: 30 %
#: more wall, docs/simulate.rst).
FULL_UPDATES = "--cfg=network/optim:Full"


def run_plan(plan: dict, timeout: float | None = None) -> dict:
    """Run ``plan`` (the JSON object above) in a child process; return its result, with
    ``timing``: the child's ``wall`` and ``cpu`` seconds as the parent saw them (start,
    SimGrid, exit), and the child's own ``run_wall``/``run_cpu`` (the simulation alone),
    ``actors`` and ``transfers``. UsageError (one line) where SimGrid is missing, refuses
    the platform or fails."""
    started, before = time.monotonic(), _children_cpu()
    try:
        done = subprocess.run([sys.executable, "-m", "mpigrad.simulate.engine"], input=json.dumps(plan),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UsageError(f"the SimGrid simulation ran past {timeout:g} s") from None
    wall, cpu = time.monotonic() - started, _children_cpu() - before
    if done.returncode == 2 and done.stdout.startswith("error: "):
        raise UsageError(done.stdout[len("error: "):].strip())
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and "->" not in line]
        raise UsageError(f"the SimGrid simulation failed (exit {done.returncode}): "
                         f"{lines[-1].strip() if lines else 'no message'}")
    result = json.loads(done.stdout)
    result["timing"] = {"wall": wall, "cpu": cpu, **result.get("timing", {})}
    return result


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _rank_steps(programs: list, ranks: int) -> list[list[list[tuple]]]:
    """``steps[rank][program]``: (phase index, work seconds, sends [(dst, bytes)], receives
    [src], send wait, receive wait, early, floor, fifo, relay) of each phase ``rank`` takes part in, in
    order; ``early``: the later phases (index, [src]) whose receives it posts after this phase's
    (their ``post_at`` is this phase or one before it that ``rank`` has no part in); ``relay``:
    None, or (phase J, [src] of J, chain) where this rank's sends forward its receives of phase J
    (which its step of J then leaves out)."""
    steps = [[[] for _ in programs] for _ in range(ranks)]
    for index, phases in enumerate(programs):
        for k, phase in enumerate(phases):
            work = {int(rank): float(seconds) for rank, seconds in phase.get("work", {}).items() if seconds > 0}
            floor = {int(rank): float(seconds) for rank, seconds in phase.get("floor", {}).items() if seconds > 0}
            sends: dict[int, list] = {}
            recvs: dict[int, list] = {}
            for src, dst, n in phase.get("messages", ()):
                if n > 0:
                    sends.setdefault(src, []).append((dst, int(n)))
                    recvs.setdefault(dst, []).append(src)
            for rank in sorted(set(work) | set(sends) | set(recvs) | set(floor)):
                steps[rank][index].append([k, work.get(rank, 0.0), sends.get(rank, []), recvs.get(rank, []),
                                           phase.get("send_wait"), phase.get("recv_wait"), [],
                                           floor.get(rank, 0.0), bool(phase.get("fifo")), None])
        for rank in range(ranks):
            mine = steps[rank][index]
            at = {step[0]: step for step in mine}
            for step in mine:
                relay = phases[step[0]].get("relay")
                source = at.get(relay) if relay is not None else None
                if step[2] and source is not None and source[3]:
                    step[9] = (relay, source[3], phases[step[0]].get("chain"))
                    source[3] = []
            mine = [step for step in mine if step[1] or step[2] or step[3] or step[7]]
            for later in mine:
                post_at = programs[index][later[0]].get("post_at")
                if post_at is None or not later[3]:
                    continue
                first = next(step for step in mine if step[0] >= post_at)
                if first is not later:
                    first[6].append((later[0], later[3]))
            steps[rank][index] = [tuple(step) for step in mine]
    return steps


def _simulate(plan: dict) -> dict:
    from .simgrid_module import load_simgrid

    sg = load_simgrid()
    model = plan.get("model", "cm02")
    if model not in NETWORK_MODELS:
        raise UsageError(f"unknown network model {model!r}; choose from {', '.join(NETWORK_MODELS)}")
    engine = sg.Engine(["mpigrad-simulate", "--log=root.thresh:critical", *NETWORK_MODELS[model], FULL_UPDATES])
    try:
        engine.load_platform(plan["platform"])
    except Exception as exc:  # noqa: BLE001 - SimGrid raises its own types
        raise UsageError(f"SimGrid refuses the platform {plan['platform']}: {exc}") from None
    hosts = sorted(engine.all_hosts, key=lambda host: natural_key(host.name))
    needed = max(plan["hosts"]) + 1
    if needed > len(hosts):
        raise UsageError(f"the platform {plan['platform']} has {len(hosts)} host(s); the simulation needs {needed}")
    programs, sequence = plan["programs"], plan["sequence"]
    ends: list[list[float | None]] = [[None] * len(programs[index]) for index in sequence]
    errors: list[str] = []
    boxes: dict[tuple[int, int, int, int], object] = {}

    def box(src: int, dst: int, index: int, k: int):
        """The mailbox of ``src``'s messages to ``dst`` in phase k of program ``index``."""
        key = (src, dst, index, k)
        if key not in boxes:
            boxes[key] = sg.Mailbox.by_name(f"{src}>{dst}@{index}.{k}")
        return boxes[key]

    def record(m: int, k: int, t: float) -> None:
        if ends[m][k] is None or t > ends[m][k]:
            ends[m][k] = t

    def finish(m: int, k: int, comms: list) -> None:
        actors = [c for c in comms if isinstance(c, sg.Actor)]  # fifo senders: they record their own ends
        comms = [c for c in comms if not isinstance(c, sg.Actor)]
        for actor in actors:
            actor.join()
        if comms:
            sg.Comm.wait_all(comms)
            record(m, k, max(comm.finish_time for comm in comms))

    def fifo_sender(m: int, k: int, before, mailbox, nbytes: int) -> None:
        if before is not None:
            before.join()
        mailbox.put(None, nbytes)
        record(m, k, sg.Engine.clock)

    def relay_sender(m: int, index: int, rank: int, k: int, relay: tuple, reached, before, sends: list) -> None:
        j, sources, _ = relay
        gets = [box(src, rank, index, j).get_async() for src in sources]
        comms = [comm for comm, _ in gets]
        sg.Comm.wait_all(comms)
        record(m, j, max(comm.finish_time for comm in comms))
        reached.acquire()
        if before is not None:
            before.join()
        for dst, n in sends:
            box(rank, dst, index, k).put(None, n)
        record(m, k, sg.Engine.clock)

    def rank_main(rank: int, steps: list) -> None:
        try:
            host = sg.this_actor.get_host()
            speed = host.speed
            last_on: dict[int, object] = {}  # dst -> the latest fifo sender to it
            last_of: dict[str, object] = {}  # chain -> the latest relay sender of it
            for m, index in enumerate(sequence):
                pending: list[tuple] = []  # (wait before phase, phase, comms)
                held: list = []  # the receives' data handles, until their comms are done
                early: dict[int, list] = {}  # phase -> its receives, posted with an earlier phase
                relays: dict[int, tuple] = {}  # phase -> (its relay sender, the semaphore it waits on)
                for k, _, sends, _, _, _, _, _, _, relay in steps[index]:
                    if relay is not None:
                        reached = sg.Semaphore(0)
                        actor = sg.Actor.create(f"rank-{rank}-relay-{k}", host, relay_sender, m, index, rank, k,
                                                relay, reached, last_of.get(relay[2]), sends)
                        last_of[relay[2]] = actor
                        relays[k] = (actor, reached)
                for k, work, sends, recvs, send_wait, recv_wait, posts, floor, fifo, relay in steps[index]:
                    for due in [p for p in pending if p[0] != "end" and p[0] <= k]:
                        pending.remove(due)
                        finish(m, due[1], due[2])
                    if work > 0:
                        sg.this_actor.execute(work * speed)
                        record(m, k, sg.Engine.clock)
                    posted = sg.Engine.clock
                    gets = early.pop(k, None)
                    if gets is None:
                        gets = [box(src, rank, index, k).get_async() for src in recvs]  # (comm, data): keep both
                    held.append(gets)
                    for later, sources in posts:  # then the receives of later phases posted with this one
                        early[later] = [box(src, rank, index, later).get_async() for src in sources]
                        held.append(early[later])
                    if relay is not None:
                        actor, reached = relays[k]
                        reached.release()
                        puts = [actor]
                    elif fifo:
                        puts = []
                        for dst, n in sends:
                            last_on[dst] = sg.Actor.create(f"rank-{rank}>{dst}", host, fifo_sender, m, k,
                                                           last_on.get(dst), box(rank, dst, index, k), n)
                            puts.append(last_on[dst])
                    else:
                        puts = [box(rank, dst, index, k).put_async(None, n) for dst, n in sends]
                    now = []
                    for comms, wait in (([comm for comm, _ in gets], recv_wait), (puts, send_wait)):
                        if comms and wait is None:
                            now += comms
                        elif comms:
                            pending.append((wait, k, comms))
                    if now:
                        finish(m, k, now)
                    if floor > 0:  # the elided messages' own time (the hosts' replay: plan.aggregate)
                        if sg.Engine.clock < posted + floor:
                            sg.this_actor.sleep_until(posted + floor)
                        record(m, k, posted + floor)
                for _, k, comms in pending:
                    finish(m, k, comms)
        except Exception as exc:  # noqa: BLE001 - reported by the parent in one line
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
            raise

    steps = _rank_steps(programs, len(plan["hosts"]))
    for rank, host in enumerate(plan["hosts"]):
        sg.Actor.create(f"rank-{rank}", hosts[host], rank_main, rank, steps[rank])
    started, cpu = time.monotonic(), time.process_time()
    engine.run()
    timing = {"run_wall": time.monotonic() - started, "run_cpu": time.process_time() - cpu,
              "actors": len(plan["hosts"]),
              "transfers": sum(1 for index in sequence for phase in programs[index]
                               for message in phase.get("messages", ()) if message[2] > 0)}
    if errors:
        raise UsageError(f"the simulation failed: {errors[0]}")
    return {"ends": ends, "clock": engine.clock, "hosts": [host.name for host in hosts[:needed]], "timing": timing,
            "simgrid_version": ".".join(map(str, sg.simgrid_version)) if isinstance(sg.simgrid_version, tuple)
            else str(sg.simgrid_version)}


def natural_key(name: str) -> list:
    """The sort key of a host name in natural order: its runs of digits as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _one_cpu() -> None:
    """Keep the child on one CPU: SimGrid runs one actor thread at a time, handing over at
    every call into it, and handing over on one CPU costs less than across CPUs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[os.getpid() % len(cpus)]})
    except (AttributeError, OSError):  # not Linux, or not allowed: no matter
        pass


def main() -> int:
    """The child: a plan on stdin, its result on stdout (``error: LINE`` and exit 2 for a
    refusal)."""
    _one_cpu()
    try:
        result = _simulate(json.load(sys.stdin))
    except UsageError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
