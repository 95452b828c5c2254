"""Units of mpigrad's options and reports: rates, sizes, durations and schedules of them.

Parsers read what a user writes (``10MB/s``, ``100Mbps``, ``50ms``, ``30m``,
``10MB/s@0s,1GB/s@60s``) into base units (bytes per second, seconds) or a
:mod:`mpigrad.clockmodel` schedule, and raise :class:`mpigrad.errors.UsageError` (one line)
on anything else; formatters write base units back the way the parsers read them. A leaf
module: it imports from mpigrad only ``errors`` and ``clockmodel`` (itself a leaf, the
schedules' types), so config, runtime, lab, bench, analysis and trace all import units
from here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .clockmodel import Constant, Markov, Network, Steps
from .errors import UsageError


_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _rate_units() -> dict[str, float]:
    """Every unit spelling ``parse_rate`` reads, in bytes per second: an upper-case ``B`` is a
    byte (``MB/s``, ``MBps``, ``MiB/s``), a lower-case ``b`` or ``bit`` a bit (``Mbps``,
    ``Mb/s``, ``Mbit/s``), as network people write them."""
    prefixes = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    units = {}
    for prefix, scale in prefixes.items():
        for per_second in ("/s", "ps"):
            units[f"{prefix}B{per_second}"] = scale
            units[f"{prefix}b{per_second}"] = scale / 8
        units[f"{prefix}bit/s"] = scale / 8
    return units


_RATE_UNITS = _rate_units()
#: Units that only differ in case from a known one ("mbps", "MBPS", "gb/s"): bits or bytes?
_AMBIGUOUS_RATE_UNITS = {unit.lower() for unit in _RATE_UNITS}


def parse_rate(text: Any) -> float:
    """A bandwidth in bytes per second: '10MB/s' -> 1e7, '100Mbps' -> 1.25e7, '1Gbit/s' and
    '1Gb/s' -> 1.25e8, '125MiB/s' -> 125 * 2**20. A number needs its unit (a bare '10' or a
    TOML number is refused, not read as bytes/s), and a unit that differs from a known one
    only in case ('mbps', 'MB/S') is refused as ambiguous; both errors show how to write
    the rate in bits and in bytes."""
    raw = str(text).strip()
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]*)", raw)
    if not match:
        raise UsageError(f"cannot read bandwidth {text!r}: {_RATE_SPELLINGS}")
    number, unit = match.groups()
    if not unit:
        value = float(number)  # large numbers were once read as bytes/s: offer that reading
        as_bytes, as_bits = (_scaled(value), _scaled(8 * value)) if value >= 1000 else (number + "M",) * 2
        raise UsageError(f"bandwidth {text!r} has no unit: write e.g. {as_bytes}B/s (bytes per second) or "
                         f"{as_bits}bit/s (bits per second)")
    if unit in _RATE_UNITS:
        rate = float(number) * _RATE_UNITS[unit]
        if not (rate > 0 and math.isfinite(rate)):
            raise UsageError(f"bandwidth {text!r} must be positive and finite")
        return rate
    if unit.lower() in _AMBIGUOUS_RATE_UNITS:
        prefix = _PREFIX_SPELLING[unit.lower().partition("b")[0]]
        raise UsageError(f"bandwidth {text!r}: unit {unit!r} is ambiguous (bits or bytes?): write "
                         f"{number}{prefix}bit/s or {number}{prefix}bps for bits, {number}{prefix}B/s for bytes")
    raise UsageError(f"cannot read bandwidth {text!r}: {_RATE_SPELLINGS}")


_PREFIX_SPELLING = {"": "", "k": "k", "m": "M", "g": "G", "t": "T", "ki": "Ki", "mi": "Mi", "gi": "Gi", "ti": "Ti"}
_RATE_SPELLINGS = "use e.g. 100Mbps, 100Mbit/s or 10Gb/s (bits), 10MB/s or 125MiB/s (bytes)"


def format_rate(bytes_per_second: float, *, bits: bool = True) -> str:
    """A rate as ``parse_rate`` reads it, in bytes and in bits: ``1e7`` -> '10MB/s (80Mbit/s)'
    (with ``bits=False``: '10MB/s')."""
    text = f"{_scaled(bytes_per_second)}B/s"
    return f"{text} ({_scaled(8 * bytes_per_second)}bit/s)" if bits else text


def format_duration(seconds: float) -> str:
    """A duration as ``parse_duration`` reads it: ``0.0005`` -> '0.5ms', ``7200`` -> '2h'."""
    for unit, scale, least in (("h", 3600.0, 3600.0), ("m", 60.0, 60.0), ("s", 1.0, 1.0), ("ms", 1e-3, 1e-4)):
        if abs(seconds) >= least:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-6:g}us" if seconds else "0s"


def format_elapsed(seconds: float) -> str:
    """An elapsed or simulated time as a run reports it, to the tenth of a second below a
    minute: ``5.04`` -> '5.0s', ``398`` -> '6m38s', ``7300`` -> '2h01m' (every line of a run
    that states a duration: the progress lines, the ``done:`` line)."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _scaled(value: float) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:g}{prefix}"
    return f"{value:g}"


def parse_duration(text: Any) -> float:
    """'50ms' -> 0.05; '2h' -> 7200; a bare number is seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip())
    if not match or (match.group(2) and match.group(2) not in _TIME_UNITS):
        raise UsageError(f"cannot read duration {text!r}: use e.g. 50ms, 30s, 2h")
    return float(match.group(1)) * _TIME_UNITS.get(match.group(2) or "s", 1.0)


# ---- network schedules: --bandwidth, --latency, --link-bandwidth ---------------------------
SCHEDULE_SYNTAX = ("VALUE@TIME,VALUE@TIME,...[,repeat@PERIOD] (e.g. 10MB/s@0s,1GB/s@60s,10MB/s@120s) or "
                   "markov:VALUE,VALUE,dwell=MEAN,MEAN (e.g. markov:10MB/s,1GB/s,dwell=30s,60s)")


def is_schedule(text: Any) -> bool:
    """Whether ``text`` is a schedule rather than one value (it has ``@`` or ``,``, or is
    ``markov:...``)."""
    return isinstance(text, str) and ("@" in text or "," in text or text.strip().startswith("markov:"))


def parse_schedule(text: Any, what: str = "bandwidth", seed: int = 0, stream: str | None = None):
    """A schedule of ``what`` (``bandwidth``: rates as ``parse_rate`` reads them, bytes/s;
    ``latency``: durations) on the simulated clock, as a :mod:`mpigrad.clockmodel` schedule:

    - ``10MB/s@0s,1GB/s@60s,10MB/s@120s``: each value from its time on (the first at 0s;
      its ``@0s`` may be left out); a trailing ``repeat@PERIOD`` starts the pattern over
      every PERIOD (``10MB/s,1GB/s@60s,repeat@120s``: 60 s slow, 60 s fast, and again);
    - ``markov:10MB/s,1GB/s,dwell=30s,60s``: a two-state Markov process starting in the
      first state, each state held for an exponential time of the given mean, drawn from
      ``seed`` (the run's) and ``stream`` (which schedule: default ``what``);
    - one value: a constant (a number: already in bytes/s or s, as a config holds it).

    UsageError, one line, for anything else."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return Constant(text)  # a config's value already in base units (bytes/s, s)
    raw = "".join(str(text).split())
    value = parse_rate if what == "bandwidth" else parse_duration
    stream = stream or what

    def fail(why: str) -> UsageError:
        return UsageError(f"cannot read {what} schedule {str(text)!r}: {why}; use {SCHEDULE_SYNTAX}")

    if not is_schedule(raw):
        return Constant(value(raw))
    if raw.startswith("markov:"):
        parts = raw[len("markov:"):].split(",")
        if len(parts) != 4 or not parts[2].startswith("dwell="):
            raise fail("a Markov schedule is markov:VALUE,VALUE,dwell=MEAN,MEAN")
        values = [value(p) for p in parts[:2]]
        dwell = [parse_duration(p) for p in (parts[2][len("dwell="):], parts[3])]
        if not all(d > 0 for d in dwell):
            raise fail("mean dwell times must be positive")
        return Markov(values, dwell, seed, stream)
    entries = raw.split(",")
    period = None
    if entries[-1].startswith("repeat@"):
        period = parse_duration(entries.pop()[len("repeat@"):])
        if not entries:
            raise fail("repeat@PERIOD needs values before it")
    times, values = [], []
    for k, entry in enumerate(entries):
        item, sep, at = entry.partition("@")
        if not item or (sep and not at):
            raise fail(f"{entry!r} is not VALUE@TIME")
        if not sep and k:
            raise fail(f"{entry!r} has no @TIME (only the first value may leave it out, meaning @0s)")
        times.append(parse_duration(at) if sep else 0.0)
        values.append(value(item))
    if times[0] != 0:
        raise fail("the first value must start at 0s")
    for before, after in zip(times, times[1:]):
        if after <= before:
            raise fail(f"times must increase ({format_duration(after)} after {format_duration(before)})")
    if period is not None and period <= times[-1]:
        raise fail(f"repeat@{format_duration(period)} must come after the last change ({format_duration(times[-1])})")
    return Steps(times, values, period)


def _parse_value_or_schedule(text: Any, what: str) -> float | str:
    """One value (in base units), or a schedule kept as written (spaces removed) once it parses."""
    if is_schedule(text):
        parse_schedule(text, what)
        return "".join(text.split())
    return parse_rate(text) if what == "bandwidth" else parse_duration(text)


def parse_bandwidth(text: Any) -> float | str:
    """``--bandwidth``: a rate (bytes/s, ``parse_rate``) or a schedule (``parse_schedule``)."""
    return _parse_value_or_schedule(text, "bandwidth")


def parse_latency(text: Any) -> float | str:
    """``--latency``: a duration (s) or a schedule of durations."""
    return _parse_value_or_schedule(text, "latency")


def parse_link_bandwidth(value: Any) -> dict[str, float | str]:
    """``--link-bandwidth RANK=RATE|SCHEDULE`` (repeated; a TOML table ``[link_bandwidth]``
    of ``RANK = "..."``): rank RANK's link at its own rate or schedule, kept as written (spaces
    removed) once it parses, keyed by the rank as a string (as JSON keeps it)."""
    items = value.items() if isinstance(value, dict) else None
    if items is None:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise UsageError(f"link_bandwidth must be RANK=RATE items or a table, got {value!r}")
        items = []
        for item in value:
            rank, sep, spec = str(item).partition("=")
            if not sep:
                raise UsageError(f"--link-bandwidth {item!r}: use RANK=RATE or RANK=SCHEDULE, e.g. 0=1MB/s")
            items.append((rank, spec))
    links = {}
    for rank, spec in items:
        rank = str(rank).strip()
        if not rank.isdigit():
            raise UsageError(f"link_bandwidth: {rank!r} is not a rank (use RANK=RATE, e.g. 0=1MB/s)")
        parse_bandwidth(spec)
        links[str(int(rank))] = "".join(str(spec).split())  # as written: a rate or a schedule
    return links


def network_from(bandwidth: float | str, latency: float | str, link_bandwidth: dict[str, Any] | None,
                 seed: int) -> Network | None:
    """The schedules of a config's network (None when it is one constant rate and latency):
    a Markov schedule draws from ``seed`` and its own stream (``bandwidth``, ``latency``,
    ``linkR`` for rank R's link)."""
    if not (isinstance(bandwidth, str) or isinstance(latency, str) or link_bandwidth):
        return None
    return Network(parse_schedule(bandwidth, "bandwidth", seed), parse_schedule(latency, "latency", seed),
                   {int(rank): parse_schedule(spec, "bandwidth", seed, f"link{rank}")
                    for rank, spec in (link_bandwidth or {}).items()})


def format_network_value(value: float | str, what: str = "bandwidth") -> str:
    """A bandwidth or latency as a user writes it: '10MB/s', '0.5ms', or the schedule's text."""
    if isinstance(value, str):
        return value
    return format_rate(value, bits=False) if what == "bandwidth" else format_duration(value)


def parse_interval(text: Any) -> int | str:
    """``--checkpoint-every``: a whole number of iterations (500, "500") or a duration with
    a unit ("30m", "90s"), kept as written so that the config reads back the same."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise UsageError(f"checkpoint_every must be iterations (500) or a duration (30m), got {text!r}")
    if isinstance(text, int) or text.strip().isdigit():
        return int(text)
    text = text.strip()
    if not re.fullmatch(_NUMBER + r"\s*[a-z]+", text):
        raise UsageError(f"cannot read checkpoint interval {text!r}: use iterations (500) or a duration "
                         "with a unit (30m, 90s, 2h)")
    parse_duration(text)
    return text
