"""Labels for runs and groups of runs, from the config keys in which they differ.

One rule for every `mpigrad trace` action: a run is named by its method (``method_label``:
"Fix (2-bit)", "MQGrad", ...) followed by the config keys whose values differ between the
runs shown (``lr=0.01``), never by its file name alone. Runs that differ only in their seed
form one group (``group_key``); a per-run label adds ``seed=N``, and the run's file name
only when two runs agree on everything, seed included.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..config import OPTIONS, RECIPE_KEYS, describe_recipe, normal_shard_chunk
from ..units import format_duration, format_rate
from ..trace import Trace, method_label

__all__ = ["flat_config", "differing_keys", "group_key", "group_labels", "run_labels", "format_value",
           "labelled_config", "NETWORK_KEY", "NODES_KEY", "NODE_KEYS", "nodes_label", "trace_ranks_per_node",
           "clock_name", "common_clock", "SIMULATED", "WALL_CLOCK", "MIXED_CLOCKS", "file_labels", "loss_quantity",
           "LOSS_WITH_L2", "LOSS_ALONE", "SCRIPT_LOSS", "LOSS_TAGS"]

#: Keys that say how a run was run or written, not what was trained: never a difference.
BOOKKEEPING = frozenset({"trace", "force", "resume", "checkpoint", "progress_every", "trace_flush",
                         "timeout", "walltime", "threads", "device", "checksum_every", "norm_every", "label",
                         "eval_every", "eval_samples", "modelled"})
#: Keys the method label already expresses (or that only come with a method).
_METHOD_PREFIXES = ("codec", "policy", "bits", "peer")


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run's effective config, flat: ``{"policy_opts": {"T": 5}}`` -> ``{"policy_opts.T": 5}``.

    In a config written by ``mpigrad train`` (every key a RunConfig option, or ``retimed``),
    a key the trace lacks (written before the key existed) takes today's default, which keeps
    the old behaviour when a key is added (``servers = 1``; ``shard_chunk``, whose default
    ``auto`` keeps whole layers with one server, as 0 does: ``config.normal_shard_chunk``): old and new
    traces of one config form one group, and a re-timed trace (``retimed = true``) a group of
    its own. Other configs (the TraceWriter API) are taken as written.

    A training config's update rule (``config.RECIPE_KEYS``: optimizer, schedule, warm-up) is
    one key, ``recipe``, in a few words (``config.describe_recipe``; ``sgd`` for the paper's
    plain SGD, also in traces written before optimizers existed, and in DDP's); by the same
    rule its nodes (``NODE_KEYS``: workers per node, exchange, the precision inside a node) are
    one key, ``nodes`` (``nodes_label``: ``one per node`` for the model's default, also in
    traces written before the option existed; ``2x2 hier``), which ``labelled_config`` gives
    with the run's number of nodes."""
    defaults = {**_defaults(), RETIMED_KEY: False}
    if config and set(config) <= set(defaults) | _NESTED_KEYS | {NETWORK_KEY, NODES_KEY}:
        config = normal_shard_chunk({**defaults, **config})
    if config and (NODES_KEY in config or "ranks_per_node" in config):  # a peer's (DDP's) config too
        config = {key: value for key, value in config.items() if key not in NODE_KEYS} | {
            NODES_KEY: config.get(NODES_KEY) or nodes_label(config)}
    if config and "lr" in config:
        config = {key: value for key, value in config.items() if key not in RECIPE_KEYS} | {
            RECIPE_KEY: describe_recipe(config)}
    return _flatten(config)


#: The key of a training config's update rule in labels and groups (``flat_config``).
RECIPE_KEY = "recipe"
#: The key of a training config's nodes in labels and groups (``flat_config``), and the
#: config keys it stands for.
NODES_KEY = "nodes"
NODE_KEYS = ("ranks_per_node", "exchange", "intra_codec")
#: The exchanges' short names in a ``nodes`` label.
_EXCHANGE_TAGS = {"hierarchical": "hier", "flat": "flat"}


def trace_ranks_per_node(config: Any) -> int:
    """A trace's workers per node from its recorded config: the resolved
    ``ranks_per_node`` (the launch writes the number), 1 for a trace written before the
    option existed (or by the TraceWriter API without it)."""
    value = config.get("ranks_per_node", 1) if isinstance(config, dict) else 1
    return value if type(value) is int and value >= 1 else 1


def nodes_label(config: dict[str, Any], workers: int | None = None) -> str:
    """A run's nodes in a few words, from its config (``NODE_KEYS``): ``one per node`` for one
    worker per node (the model's default: the exchange is the flat one), else N x L and the
    exchange, ``2x2 hier``, ``2x2 flat``, with the precision inside a node where a
    hierarchical exchange did not keep float32 (``2x2 hier fp16``); ``L per node`` in place of
    ``NxL`` where ``workers`` is unknown."""
    L = trace_ranks_per_node(config)
    if L == 1:
        return "one per node"
    shape = f"{workers // L}x{L}" if isinstance(workers, int) and workers >= L else f"{L} per node"
    exchange = str(config.get("exchange", "auto"))
    text = f"{shape} {_EXCHANGE_TAGS.get(exchange, exchange)}"
    intra = config.get("intra_codec", "fp32")
    return f"{text} {intra}" if exchange == "hierarchical" and intra != "fp32" else text


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for sub, inner in _flatten(value).items():
                flat[f"{key}.{sub}"] = inner
        else:
            flat[key] = value
    return flat


_NESTED_KEYS = frozenset(name for name, option in OPTIONS.items() if isinstance(option.default, dict))


@functools.cache
def _defaults() -> dict[str, Any]:
    from ..config import RunConfig
    return {key: value for key, value in RunConfig().to_dict().items() if not isinstance(value, dict)}


#: Config keys stored in base units, shown as a user writes them (10MB/s, 0.5ms).
_UNIT_FORMATS = {"bandwidth": functools.partial(format_rate, bits=False), "latency": format_duration,
                 "compute_time": format_duration}


def format_value(value: Any, key: str | None = None) -> str:
    """``value`` for a label; the value of config key ``key`` in its unit where it has one."""
    if key is not None and key.startswith("link_bandwidth."):  # one rank's link (--link-bandwidth)
        key = "bandwidth"
    if key in _UNIT_FORMATS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _UNIT_FORMATS[key](value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def differing_keys(configs: Sequence[dict[str, Any]], *, seed: bool = False) -> list[str]:
    """Sorted flat keys whose values are not the same in every config (a missing key counts
    as a value); bookkeeping keys never, ``seed`` only when asked."""
    flats = [flat_config(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    ignored = BOOKKEEPING | (set() if seed else {"seed"})
    return [k for k in keys if k not in ignored
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]


def group_key(config: dict[str, Any], keys: Sequence[str]) -> str:
    flat = flat_config(config)
    return json.dumps([flat.get(k) for k in keys], sort_keys=True, default=str)


#: Set by `mpigrad trace retime`; the method label shows it as " (retimed)".
RETIMED_KEY = "retimed"


def _is_method_key(key: str) -> bool:
    return key == RETIMED_KEY or key.split(".")[0].split("_")[0] in _METHOD_PREFIXES


def group_labels(configs: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> list[str]:
    """A label per config: its method plus its values of the non-method ``keys`` (default: the
    keys that differ); method options (``policy_opts.epsilon``) are added only where the
    labels would otherwise clash."""
    keys = differing_keys(configs) if keys is None else list(keys)
    flats = [flat_config(c) for c in configs]

    def label(config, flat, chosen):
        extra = ", ".join(f"{k}={format_value(flat.get(k), k)}" for k in chosen)
        return f"{method_label(config)} {extra}".strip() if extra else method_label(config)

    plain = [k for k in keys if not _is_method_key(k)]
    labels = [label(c, f, plain) for c, f in zip(configs, flats)]
    for text in set(labels):
        members = [i for i, other in enumerate(labels) if other == text]
        if len({group_key(configs[i], keys) for i in members}) > 1:
            extra = [k for k in keys if _is_method_key(k)
                     and len({format_value(flats[i].get(k), k) for i in members}) > 1]
            for i in members:
                labels[i] = label(configs[i], flats[i], plain + extra)
    return labels


#: The key under which labels and groups see the network a run really had (``Trace.network``:
#: "host", "lab 10MB/s", ...), beside the config's network model (``net_mode``, ``bandwidth``).
NETWORK_KEY = "network"


#: The clocks a trace's ``sim_time`` can be kept by (``clock_name``), and what a set of runs
#: timed by both is called (``common_clock``).
SIMULATED, WALL_CLOCK, MIXED_CLOCKS = "simulated", "wall clock", "simulated or wall clock"


def clock_name(config: Any) -> str:
    """The clock that timed a run: ``SIMULATED`` (the network model charged each message), or
    ``WALL_CLOCK`` where there was none (``net_mode = "off"``: ``bench peers``' runs, lab runs
    timed by the wire; their ``sim_time`` is the wall clock, runtime/measure/clock.py)."""
    return WALL_CLOCK if isinstance(config, dict) and config.get("net_mode") == "off" else SIMULATED


def common_clock(clocks: Sequence[str]) -> str:
    """The one clock of ``clocks`` (each a ``clock_name``), else ``MIXED_CLOCKS``
    (``SIMULATED`` for none)."""
    names = set(clocks) or {SIMULATED}
    return names.pop() if len(names) == 1 else MIXED_CLOCKS


def labelled_config(trace: Trace) -> dict[str, Any]:
    """What a run is labelled and grouped by: its config, its network (``NETWORK_KEY``) and
    its nodes (``NODES_KEY``: ``nodes_label`` with the trace's workers); a lab run timed by
    the network model, not by its links, says so (``lab 20MB/s, timed by the model``: its
    times are the model's, whatever the links' rate)."""
    network = trace.network
    if network != "host" and clock_name(trace.config) == SIMULATED:
        network += ", timed by the model"
    workers = trace.attrs.get("workers")
    return {**trace.config, NETWORK_KEY: network, NODES_KEY: nodes_label(trace.config, workers)}


def run_labels(traces: Sequence[Trace]) -> list[str]:
    """Per-run labels: the group label, ``seed=N`` where runs of one group differ in seed,
    and the file name where two runs still share a label."""
    configs = [labelled_config(t) for t in traces]
    labels = group_labels(configs)
    seeds = [c.get("seed", t.attrs.get("seed")) for c, t in zip(configs, traces)]
    for text in set(labels):
        members = [i for i, other in enumerate(labels) if other == text]
        if len(members) > 1 and len({str(seeds[i]) for i in members}) > 1:
            for i in members:
                labels[i] = f"{labels[i]} seed={seeds[i]}"
    files = file_labels([t.path for t in traces])
    return [f"{label} ({file})" if labels.count(label) > 1 else label for label, file in zip(labels, files)]


def file_labels(paths: Sequence[str | os.PathLike]) -> list[str]:
    """A name per file, distinct where the files are: the shortest trailing part of its path
    that no other file's path ends in, without the extension (``mqgrad``; ``runs/mqgrad`` and
    ``ck/mqgrad`` for two files of that name), with it only where nothing else tells two
    files apart (``a.h5``, ``a.hdf5``). A file given twice gets one name, twice."""
    absolute = [Path(os.path.abspath(path)) for path in paths]

    def suffix(path: Path, depth: int, extension: bool) -> str:
        parts = [*path.parts[:-1], path.name if extension else path.stem]
        return "/".join(parts[-depth:]).replace("//", "/")

    names = []
    for path in absolute:
        others = {other for other in absolute if other != path}
        for extension in (False, True):
            depth = next((k for k in range(1, len(path.parts) + 1)
                          if all(suffix(path, k, extension) != suffix(other, k, extension) for other in others)), None)
            if depth is not None:
                names.append(suffix(path, depth, extension))
                break
        else:
            names.append(str(path))  # unreachable: the whole path tells files apart
    return names


#: What a trace's ``loss`` column measures (``loss_quantity``).
LOSS_WITH_L2, LOSS_ALONE, SCRIPT_LOSS = "training loss + l2", "training loss", "the script's loss"
#: The short tag of each loss quantity in labels and legends where runs of several are shown.
LOSS_TAGS = {LOSS_WITH_L2: "loss+l2", LOSS_ALONE: "loss", SCRIPT_LOSS: "script's loss"}


def loss_quantity(config: Any) -> str:
    """What a run's ``loss`` column (and its progress line's loss) measures, from its recorded
    config: ``SCRIPT_LOSS`` for a script's run (``mpigrad.Session``: model ``script NAME``),
    whose loss is what the script computed, mpigrad adding nothing; ``LOSS_WITH_L2`` where the
    paper's l2 term was in the loss (``weight_decay`` > 0 and ``weight_decay_in`` "loss"; a
    config that lacks a key takes today's default, 0.004 in the loss, as traces written before
    ``weight_decay_in`` existed had it); else ``LOSS_ALONE`` (``weight_decay`` 0, or decayed
    by the optimizer, ``weight_decay_in`` "optimizer": AdamW's decoupled decay). Times to one
    target loss compare only between runs of one quantity."""
    config = config if isinstance(config, dict) else {}
    model = config.get("model")
    if (isinstance(model, str) and model.startswith("script ")) or config.get("data") == "script":
        return SCRIPT_LOSS
    defaults = _defaults()
    decay = config.get("weight_decay", defaults["weight_decay"])
    where = config.get("weight_decay_in", defaults["weight_decay_in"])
    in_loss = where == "loss" and isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay > 0
    return LOSS_WITH_L2 if in_loss else LOSS_ALONE
