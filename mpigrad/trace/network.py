"""The network a run really had, as its trace records it: the one rule for the runtime that
writes it, the resume check that compares it, and every reader that labels or groups by it.

A run has one of two networks:

``{"kind": "lab", "nodes": N, "rate": ..., ...}``
    inside ``mpigrad lab``, which describes its links (rate or rate schedule, per-node rates,
    added latency, link events) in the environment variable :data:`VARIABLE` of every process
    it starts (``lab_network`` builds it);
``{"kind": "host"}``
    anywhere else: the hosts' own network (loopback when every rank is on one host).

Whether the clock models a network (``net_mode``, ``bandwidth``, ...) is the config's part,
not this one. The trace's root attribute ``network`` holds the network of the session that
created it; each ``resumes`` entry holds the network of that session. A trace written before
the attribute existed reads as ``host``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from ..errors import UsageError
from ..units import format_network_value

__all__ = ["VARIABLE", "ATTR", "HOST", "lab_network", "current", "history", "describe", "text", "details",
           "resume_change"]

#: Set by ``mpigrad lab`` for every process it starts: the lab's network, JSON.
VARIABLE = "MPIGRAD_LAB_NETWORK"
#: The root attribute (and the key of a ``resumes`` entry) that records it.
ATTR = "network"
#: A run outside a lab; also what a trace without the attribute is read as.
HOST: dict[str, Any] = {"kind": "host"}


def lab_network(nodes: int, rates: Mapping[int, Any], latency: float, events: Sequence[str],
                seed: int) -> dict[str, Any]:
    """The lab's network: ``rates`` node -> rate (bytes/s) or schedule text, ``events`` as
    ``TIME:nodeI:ACTION`` text. The most common rate is ``rate``; others are in ``node_rates``."""
    values = [format_network_value(rate) for _, rate in sorted(rates.items())]
    common = max(values, key=values.count)
    network: dict[str, Any] = {"kind": "lab", "nodes": int(nodes), "rate": common}
    others = {str(i): value for i, value in enumerate(values) if value != common}
    if others:
        network["node_rates"] = others
    if latency:
        network["latency"] = format_network_value(latency, "latency")
    if events:
        network["events"] = list(events)
    if any("markov" in value for value in values):
        network["seed"] = int(seed)
    return network


def current(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This process's network: the lab's (:data:`VARIABLE`) or :data:`HOST`."""
    environ = os.environ if environ is None else environ
    value = environ.get(VARIABLE)
    if not value:
        return dict(HOST)
    try:
        network = json.loads(value)
    except ValueError:
        network = None
    if not isinstance(network, dict) or network.get("kind") != "lab":
        raise UsageError(f"{VARIABLE}={value!r} is not a network mpigrad lab wrote (unset it outside a lab)")
    return network


def history(attrs: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(first iteration, network) of each session of a trace, from its root attributes; a
    session that recorded none continues the one before."""
    first = attrs.get(ATTR)
    sessions = [(0, first if isinstance(first, dict) else dict(HOST))]
    for resume in attrs.get("resumes") or []:
        if isinstance(resume, dict) and isinstance(resume.get(ATTR), dict):
            sessions.append((int(resume.get("at_iteration", 0)), resume[ATTR]))
    return sessions


def describe(network: Mapping[str, Any]) -> str:
    """One network in a few words: 'host', 'lab 10MB/s', 'lab 10MB/s, node 2 1MB/s, latency
    1ms, events 12s:node2:down'."""
    if network.get("kind") != "lab":
        return str(network.get("kind", "host"))
    parts = [f"lab {network.get('rate')}"]
    parts += [f"node {i} {rate}" for i, rate in sorted((network.get("node_rates") or {}).items())]
    if network.get("latency"):
        parts.append(f"latency {network['latency']}")
    if network.get("events"):
        parts.append(f"events {' '.join(network['events'])}")
    return ", ".join(parts)


def text(attrs: Mapping[str, Any]) -> str:
    """A trace's network in words, every change named: 'lab 10MB/s', or 'lab 10MB/s until
    iteration 16, then host' for a run resumed on another network (``--force``)."""
    sessions = history(attrs)
    merged = [sessions[0]]
    for at, network in sessions[1:]:
        if network != merged[-1][1]:
            merged.append((at, network))
    words = describe(merged[0][1])
    for at, network in merged[1:]:
        words += f" until iteration {at}, then {describe(network)}"
    return words


def details(attrs: Mapping[str, Any]) -> str:
    """``text`` for ``mpigrad trace info``, saying what a ``host`` network was and when the
    trace does not record it."""
    words = text(attrs)
    if ATTR not in attrs:
        return f"{words} (not recorded: this trace was written before mpigrad recorded it)"
    last = history(attrs)[-1][1]
    if " then " in words:
        return words
    if last.get("kind") == "lab":
        return f"{words} ({last.get('nodes')} nodes of mpigrad lab)"
    hosts = attrs.get("hosts")
    if isinstance(hosts, list) and len(set(hosts)) == 1:
        return f"{words} (loopback: every rank on {hosts[0]})"
    return f"{words} (the hosts' own network)"


def resume_change(path: str | os.PathLike, attrs: Mapping[str, Any], now: Mapping[str, Any],
                  force: bool = False) -> str | None:
    """For ``--resume`` of the trace at ``path``, whose root attributes are ``attrs``
    (``reader.root_attrs``), on network ``now``: None when the trace's last session ran on it
    too; else, with ``force``, a warning line, and without it a UsageError (one line): a
    resume on another network would mix two networks in one trace unsaid."""
    before = history(attrs)[-1][1]
    if before == now:
        return None
    if not force:
        raise UsageError(f"--resume: trace {path} ran on {describe(before)}, this run is on {describe(now)}: "
                         "resume it where it ran, or pass --force to resume here (the trace records the change)")
    return (f"mpigrad: warning: resuming on {describe(now)} a trace that ran on {describe(before)} (--force); "
            "the trace records the change")
