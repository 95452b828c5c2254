"""RunConfig: every option of ``mpigrad train``, from defaults, a TOML file and the command line.

Precedence: built-in defaults < ``--config FILE`` < command-line options. TOML keys are the
option names with underscores (``batch_size = 32``); codec and policy hyperparameters go in
``[codec_opts]`` and ``[policy_opts]`` tables (or ``--codec-opt KEY=VALUE``). Values are
validated in ``RunConfig.validate`` so that a bad run fails before any rank starts work.

Each option is declared once, as its RunConfig field: ``name: type = option(default, ...)``,
a ``dataclasses.field`` whose ``metadata["option"]`` is an :class:`Option` (its help group,
help text, argparse type, choices and metavar, its unit parser, and its own value check).
From that one declaration come the TOML key (the field's name), the flag (``--`` and the
name with dashes; ``--NAME-opt KEY=VALUE`` for a ``NAME_opts`` table), its help and the
default the help shows (``{default}`` in the text), the conversion of a file's or the
command line's value (``coerce``), and the per-option check of ``validate``; ``OPTIONS``
holds the declarations by name, in field order (the order of ``to_dict``, which traces
record and checkpoints compare). ``launch.add_arguments`` builds the ``train`` parser from
them: its table of groups orders the help, and an option's ``shown_before`` moves it ahead
of another in its group. Checks between options stay code, in ``validate``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from . import options
from .clockmodel import LinkModel, Network, Nodes
from .errors import UsageError
from .units import (format_rate, network_from, parse_bandwidth, parse_duration, parse_interval, parse_latency,
                    parse_link_bandwidth, parse_rate)


NET_MODES = ("virtual", "sleep", "off")
#: Learning rate when none is given: the paper's 0.2 on CIFAR-10. On the embedded 8x8
#: digits the paper CNN's 8.8M-weight FC layers, fed 2-bit round-to-nearest gradients,
#: diverge at 0.2 and learn steadily at 0.01.
DEFAULT_LR = {"cifar10": 0.2, "digits": 0.01, "synthetic": 0.05, "teacher": 0.05}
BROADCASTS = ("star", "tree", "mpich")
ERROR_FEEDBACK = ("none", "residual", "accumulate")
DEVICES = ("cpu", "cuda", "auto")
#: TF32 for float32 matmuls and convolutions on the GPU: torch's defaults as they come, or set.
TF32 = ("default", "on", "off")
#: How a rank waits for messages: poll without sleeping, sleep-poll with back-off, or auto
#: (spin where every rank of the node has a core per thread).
WAITS = ("auto", "spin", "sleep")
#: When rank 0 sends an iteration's Control: ``ahead`` of the workers' losses where the
#: policy knows its bits before them (``Policy.bits_ahead``: fixed, schedule, MQGrad between
#: its steps), else after them; ``paper``: always after them (MQGrad's Alg. 1 round trip).
CONTROLS = ("ahead", "paper")
#: ``autocast`` choices.
AUTOCAST = ("none", "bf16")
#: ``weight_decay_in`` choices.
WEIGHT_DECAY_IN = ("loss", "optimizer")
#: ``lr_scaling`` choices.
LR_SCALINGS = ("none", "linear")
COLOCATED = "colocated"
#: ``shard_chunk``'s default (runtime/plan/layout.py resolve_chunks).
AUTO_CHUNK = "auto"
#: ``ranks_per_node`` and ``exchange``: resolved at launch (runtime/plan/topology.py).
AUTO = "auto"
#: ``exchange`` choices: ``auto`` resolves to one of the other two at launch.
EXCHANGE_KINDS = (AUTO, "flat", "hierarchical")
#: ``intra_codec`` choices: the precision of a hierarchical exchange's slices inside a node.
INTRA_CODECS = ("fp32", "fp16", "bf16", "int8")


def _count_or_word(value: Any, word: str, refusal: str) -> int | str:
    """A whole number >= 1 (a TOML integer or its digits) or ``word``; UsageError ``refusal``
    (with ``got VALUE``) otherwise."""
    if isinstance(value, str) and value.strip() == word:
        return word
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{refusal} or {word!r}, got {value!r}")
    return value


def parse_ranks_per_node(value: Any) -> int | str:
    """``--ranks-per-node``: a whole number L >= 1 of workers per node, or ``auto``."""
    return _count_or_word(value, AUTO, "ranks_per_node must be a number of workers (at least 1)")


def parse_servers(value: Any) -> int | str:
    """``--servers``: a whole number S >= 1 of server ranks, or ``colocated``."""
    return _count_or_word(value, COLOCATED, "servers must be a number of server ranks (at least 1)")


def parse_shard_chunk(value: Any) -> int | str:
    """``--shard-chunk``: ``auto`` or a whole number N >= 0 of elements (0: whole layers)."""
    if isinstance(value, str) and value.strip() == AUTO_CHUNK:
        return AUTO_CHUNK
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"shard_chunk must be {AUTO_CHUNK} (even shares) or a number of elements >= 0 "
                         f"(0: never cut a layer), got {value!r}")
    return value


def checkpoint_interval_of(every: int | str | None) -> tuple[str, float] | None:
    """``("iterations", N)`` or ``("seconds", S)`` from a ``checkpoint_every``; None when unset."""
    if every is None:
        return None
    if isinstance(every, int):
        return "iterations", every
    return "seconds", parse_duration(every)


# ---- the declaration of an option ------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """What a RunConfig field declares besides its name, type and default (see the module's
    docstring).

    ``group``: the ``--help`` group of its flag; None for an option of the config file only
    (no flag). ``help``: the flag's help, where ``{default}`` stands for the default (as
    ``show`` writes it, else ``str``, a float as ``:g``). ``type``, ``choices``, ``metavar``:
    argparse's; ``type`` is also the kind ``coerce`` checks where the default is None.
    ``append``: a repeatable flag (``NAME_opts`` tables are). ``parse``: the unit parser of a
    file's or the command line's value (``coerce``), raising UsageError. ``valid``: the
    value's own check (default: among ``choices``), ``invalid`` its message (``{value}``
    formatted in, or a function of the value). ``shown_before``: the option of its group
    that its flag precedes in the help, where that differs from the field order. ``name``
    and ``default`` are the field's, filled in by ``OPTIONS``.
    """

    group: str | None
    help: str = ""
    type: type | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    append: bool = False
    parse: Callable[[Any], Any] | None = None
    valid: Callable[[Any], bool] | None = None
    invalid: str | Callable[[Any], str] = ""
    show: Callable[[Any], str] | None = None
    shown_before: str | None = None
    name: str = ""
    default: Any = None

    @property
    def table(self) -> bool:
        """A ``NAME_opts`` table of KEY = VALUE (``--NAME-opt KEY=VALUE``, repeatable)."""
        return self.name.endswith("_opts")

    @property
    def flag(self) -> str | None:
        """The command-line flag, None for a file-only option."""
        if self.group is None:
            return None
        return "--" + (self.name[:-len("_opts")] + "_opt" if self.table else self.name).replace("_", "-")

    @property
    def kind(self) -> type:
        """The type ``coerce`` checks a value without ``parse`` against."""
        if self.type is not None:
            return self.type
        return str if self.default is None else type(self.default)

    def help_text(self) -> str:
        """``help`` with the default it shows filled in."""
        if "{default}" not in self.help:
            return self.help
        default = self.default
        shown = (self.show(default) if self.show else format(default, "g") if isinstance(default, float)
                 else str(default))
        return self.help.replace("{default}", shown)

    def arguments(self) -> dict[str, Any]:
        """``add_argument``'s keywords of the flag. Every default is None (a flag not given
        leaves the config file's value); a bool option is a ``store_true`` flag."""
        kwargs: dict[str, Any] = {"help": self.help_text()}
        if isinstance(self.default, bool):
            kwargs.update(action="store_true", default=None)
        elif self.table or self.append:
            kwargs["action"] = "append"
        for key in ("type", "choices"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        metavar = self.metavar or ("KEY=VALUE" if self.table else None)
        if metavar is not None:
            kwargs["metavar"] = metavar
        return kwargs

    def convert(self, value: Any) -> Any:
        """A value from TOML or the command line (not None), type-checked, units parsed;
        UsageError naming the option."""
        name = self.name
        if self.parse is not None:
            return self.parse(value)
        if self.table:
            if not isinstance(value, dict):
                raise UsageError(f"{name} must be a table of KEY = VALUE")
            return dict(value)
        kind = self.kind
        if kind is bool:
            return options.check_bool(name, value, error=UsageError)
        if kind is int:
            return options.check_int(name, value, error=UsageError)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{name} must be a number, got {value!r}")
            return float(value)
        if kind is str and not isinstance(value, str):
            raise UsageError(f"{name} must be a string, got {value!r}")
        return value

    def check(self, value: Any) -> None:
        """UsageError (``invalid``) where the value fails the option's own check."""
        valid = self.valid or ((lambda v: v in self.choices) if self.choices is not None else None)
        if valid is None or valid(value):
            return
        raise UsageError(self.invalid(value) if callable(self.invalid) else self.invalid.format(value=value))


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | Any = dataclasses.MISSING,
           **declaration: Any) -> Any:
    """A RunConfig field declaring its option: ``default`` (or ``factory``, as
    ``default_factory``) and the :class:`Option` of ``declaration``."""
    return field(default=default, default_factory=factory, metadata={"option": Option(**declaration)})


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda value: value >= low


def _none_or_at_least(low: float) -> Callable[[Any], bool]:
    return lambda value: value is None or value >= low


def _autocast_refused(value: Any) -> str:
    return (f"autocast must be {' or '.join(AUTOCAST)}, got {value!r}"
            + ("; fp16 needs a loss scale whose overflow every replica skips alike, which mpigrad does not "
               "have: use bf16" if value == "fp16" else ""))


_KEY_VALUE = "KEY=VALUE"
_RUN, _MODEL, _QUANTIZATION, _SERVERS, _NETWORK, _OUTPUT, _ROBUSTNESS = (
    "run", "model and data", "quantization", "parameter servers", "network model", "output", "robustness")


@dataclass
class RunConfig:
    """One training run. Units: times in seconds, bandwidth in bytes per second. Each field
    is an option, declared once (``option``: the module's docstring)."""

    iterations: int = option(300, group=_RUN, type=int, help="SGD iterations (default {default})",
                             valid=_at_least(1), invalid="iterations must be at least 1")
    batch_size: int = option(32, group=_RUN, type=int, help="per-worker batch size (default {default})",
                             valid=_at_least(1), invalid="batch_size must be at least 1")
    lr: float | None = option(  # None: the dataset's default (DEFAULT_LR)
        None, group=_RUN, type=float,
        help="learning rate (default: the paper's 0.2 on cifar10, 0.01 on digits, 0.05 on synthetic and teacher)",
        valid=lambda lr: lr is not None and lr > 0 and math.isfinite(lr),
        invalid="lr must be a positive number, got {value}")
    weight_decay: float = option(0.004, group=_RUN, type=float, help="weight decay coefficient (default {default}); "
                                 "where it acts: --weight-decay-in",
                                 valid=_at_least(0), invalid="weight_decay must be >= 0")
    #: Where ``weight_decay`` acts: "loss", the paper's l2 term (on the model's chosen layers,
    #: through the codec with the gradient), or "optimizer", its ``weight_decay`` option (on
    #: the decoded update, every parameter, on every replica; decoupled for adamw).
    weight_decay_in: str = option(
        "loss", group=_RUN, choices=WEIGHT_DECAY_IN,
        help="loss (default): the paper's l2 term in the loss (paper-cnn: its big FC weights; other models: conv and "
             "linear weights), which goes through the codec with the gradient; optimizer: the optimizer's "
             "weight_decay option, on the decoded update on every replica, every parameter (decoupled for adamw)",
        invalid=f"weight_decay_in must be {' or '.join(WEIGHT_DECAY_IN)}, got {{value!r}}")
    #: The update rule (mpigrad/optim.py): "sgd" without options is the paper's plain SGD;
    #: any other torch.optim optimizer by name, or package.module:factory, with its options.
    optimizer: str = option(
        "sgd", group=_RUN,
        help="the update's optimizer: sgd (default; without options the paper's plain w <- w - lr g) | adam | adamw "
             "| rmsprop | adagrad | adamax | nadam | radam | asgd | rprop (torch.optim's) | package.module:factory "
             "(docs/training.rst)")
    optimizer_opts: dict[str, Any] = option(
        factory=dict, group=_RUN, help="optimizer option, e.g. momentum=0.9, nesterov=true, betas=[0.9,0.999]")
    lr_schedule: str | None = option(  # a torch.optim.lr_scheduler class by name, stepped per iteration
        None, group=_RUN, metavar="NAME",
        help="a torch.optim.lr_scheduler class, stepped once per iteration, e.g. CosineAnnealingLR, MultiStepLR, "
             "StepLR (default: a constant rate)")
    lr_schedule_opts: dict[str, Any] = option(
        factory=dict, group=_RUN, help="schedule option, e.g. T_max=300, milestones=[150,225], gamma=0.1")
    lr_warmup: int = option(  # iterations of linear warm-up to the (scheduled) rate
        0, group=_RUN, type=int, metavar="N",
        help="linear warm-up: iteration m < N runs at (m+1)/N of the scheduled rate (default {default})",
        valid=_at_least(0), invalid="lr_warmup must be >= 0 iterations, got {value}")
    lr_scaling: str = option(  # "linear": the base rate times the number of workers
        "none", group=_RUN, choices=LR_SCALINGS,
        help="linear: the base --lr times the number of workers (Goyal et al.; default {default})",
        invalid="lr_scaling must be none or linear, got {value!r}")
    model: str = option("paper-cnn", group=_MODEL,
                        help="paper-cnn (default) | resnet20 | resnet18 | package.module:factory (docs/models.rst)")
    model_opts: dict[str, Any] = option(factory=dict, group=_MODEL,
                                        help="model option, e.g. fc_sizes=[256,256], norm=group")
    data: str = option("digits", group=_MODEL,
                       help="digits (embedded, default) | cifar10 | synthetic | teacher | package.module:factory")
    data_dir: str | None = option(None, group=_MODEL, help="directory of the CIFAR-10 python batches")
    data_opts: dict[str, Any] = option(factory=dict, group=_MODEL, help="dataset option, e.g. shape=[3,32,32]")
    augment: str = option(  # "crop-flip": random crops with padding and flips (mpigrad/data/augment.py)
        "none", group=_MODEL, metavar="NAME",
        help="training-batch augmentation: crop-flip, He et al.'s random crop after 4-pixel padding and horizontal "
             "flip, for data sets whose images allow it (cifar10; docs/training.rst) (default {default})")
    augment_opts: dict[str, Any] = option(factory=dict, group=_MODEL,
                                          help="augmentation option: padding=4, flip=false")
    #: "bf16": forward and loss under torch.autocast in bfloat16 (parameters, gradients and
    #: codecs stay float32); "none": float32 throughout.
    autocast: str = option(
        "none", group=_MODEL, choices=AUTOCAST, shown_before="augment",
        help="bf16: forward and loss under torch.autocast in bfloat16, as mixed-precision CNN recipes train "
             "(parameters, gradients and codecs stay float32; fp16 is not offered: it needs a loss scale that every "
             "replica skips alike) (default {default})",
        invalid=_autocast_refused)
    codec: str = option("uniform", group=_QUANTIZATION,
                        help="gradient codec: %(codecs)s | package.module:Class, a codec of your own "
                             "(docs/extending.rst) (default {default})")
    codec_opts: dict[str, Any] = option(
        factory=dict, group=_QUANTIZATION,
        help="codec option, e.g. bucket_size=512; powersgd (low rank, two rounds per iteration, --policy fixed, or "
             "lgreco with menus): rank=R (1), start=K (0: float32 before iteration K), min_compression_rate=X (2), "
             "factor_bits=B (32: float32 factors; 1..8: uniform, 16: fp16), rest_bits=B (the same for the layers "
             "it leaves uncompressed), ranks=1,2,4 and widths=2,4,8 (menus: with --policy lgreco each layer gets "
             "a rank of ranks, or goes whole uniform at a width of widths; rank must be one of ranks)")
    bits: int = option(
        2, group=_QUANTIZATION, type=int,
        help="bits, or initial bits for a moving policy (default {default}); refused where neither the policy nor "
             "the codec has a width to set (docs/policies.rst); uniform: 2**bits levels from min to max; qsgd: the "
             "sign is one of the bits, s = 2**(bits-1) - 1 levels per sign (bits 4 gives s = 7)",
        valid=lambda bits: 1 <= bits <= 32, invalid="bits must be in 1..32, got {value}")
    policy: str = option("mqgrad", group=_QUANTIZATION,
                         help="bit policy: %(policies)s | package.module:Class, a policy of your own "
                              "(docs/extending.rst) (default {default}; schedule needs --policy-opt "
                              "schedule=0:2,500:4)")
    policy_opts: dict[str, Any] = option(factory=dict, group=_QUANTIZATION, help="policy option, e.g. epsilon=0.1")
    min_quantize_size: int | None = option(  # None: the model's paper layers (quantized_parameters)
        None, group=_QUANTIZATION, type=int,
        help="quantize every parameter of at least this many elements, the rest travels as float32 (default: the "
             "layers the paper quantizes, the weights of the two big fully connected layers)",
        valid=_none_or_at_least(1), invalid="min_quantize_size must be at least 1")
    servers: int | str = option(  # ranks 0..servers-1 are parameter servers, one shard each; or
                                  # "colocated": every worker serves a shard, rank 0 none
        1, group=_SERVERS, metavar="S|colocated", parse=parse_servers,
        help="S: ranks 0..S-1 are servers, each aggregating a slice of the parameters balanced by bytes; rank 0 "
             "stays scheduler and MDP server (default {default}). colocated: every worker also serves a slice (each "
             "node's link then carries all-reduce's 2(P-1)/P of the gradient), rank 0 serves none "
             "(docs/runtime.rst)")
    #: The pipelined iteration (colocated servers): the loss goes after the forward pass and each
    #: bucket's frames as soon as backward has produced it; False: the paper's sequential order.
    pipeline: bool = option(
        False, group=_SERVERS,
        help="with --servers colocated: the pipelined iteration (the loss goes after the forward pass, rank 0 "
             "chooses the bits during backward, each layer's frames go as soon as backward has produced its "
             "gradient, and its average as soon as all its frames are in; on nodes of several workers, the "
             "hierarchical exchange bucket by bucket); the same losses as without (docs/runtime.rst)")
    #: Nodes of several workers (docs/runtime.rst, Nodes): ``ranks_per_node`` workers share a
    #: node, in worker order (rank 0, the scheduler, is an extra rank on node 0); "auto":
    #: as MPI's shared-memory split sees the launched ranks. Resolved to a number at launch
    #: (runtime/plan/topology.py), which the trace records.
    ranks_per_node: int | str = option(
        1, group=_SERVERS, metavar="L|auto", parse=lambda value: parse_ranks_per_node(value),
        help="workers per node, L consecutive workers to a node behind one NIC (rank 0, the scheduler, sits on "
             "node 0 beside its workers); the network model, the lab and --exchange hierarchical follow it, and "
             "it wins over what MPI sees (with a note); auto: the nodes MPI's shared-memory split finds "
             "(default {default}: every worker a node of its own, as the model has always had it)",
        valid=lambda value: value == AUTO or (type(value) is int and value >= 1),
        invalid="ranks_per_node must be a number of workers (at least 1) or auto, got {value!r}")
    #: How gradients cross nodes of several workers: "flat" (every worker exchanges shards with
    #: every other, as with one worker per node), "hierarchical" (a full-precision reduce-scatter
    #: inside the node, the codecs across nodes by local rank, an all-gather inside), or "auto".
    exchange: str = option(
        AUTO, group=_SERVERS, choices=EXCHANGE_KINDS,
        help="with --servers colocated and nodes of several workers (--ranks-per-node): hierarchical (a "
             "reduce-scatter inside each node at --intra-codec, each local rank's slice through the codecs, "
             "servers and policy across nodes, an all-gather inside: only what crosses a NIC is compressed) or "
             "flat (every worker sends a shard to every other, across the NIC or not); default auto: "
             "hierarchical where nodes hold several workers and servers are colocated, else flat",
        invalid=f"exchange must be one of {', '.join(EXCHANGE_KINDS)}")
    intra_codec: str = option(
        "fp32", group=_SERVERS, choices=INTRA_CODECS,
        help="with --exchange hierarchical: the precision of the gradients' slices inside a node (reduce-scatter "
             "and all-gather): fp32 (default, exact), fp16 or bf16 (half the intra-node bytes, rounded to "
             "nearest) or int8 (8 bits a value and a float32 scale per 256-value block, 1.016 bytes a value: "
             "about a quarter of the bytes, rounded to nearest); the sums are float32",
        invalid=f"intra_codec must be one of {', '.join(INTRA_CODECS)}")
    control: str = option(
        "ahead", group=_SERVERS, choices=CONTROLS,
        help="when rank 0 sends an iteration's bits: ahead of the workers' losses where the policy knows them in "
             "advance (default: fixed, schedule, mqgrad between its steps), or paper: after every iteration's "
             "losses (MQGrad's round trip)",
        invalid=f"control must be one of {', '.join(CONTROLS)}")
    #: Cut layers (quantized, and the small layers' piece) into pieces of at most this many
    #: elements (0: never); "auto": whole layers with one server, else even shares
    #: (runtime/plan/layout.py resolve_chunks).
    shard_chunk: int | str = option(
        AUTO_CHUNK, group=_SERVERS, metavar="auto|ELEMENTS", parse=parse_shard_chunk,
        help="cut quantized layers larger than ELEMENTS into pieces quantized on their own, and the small layers' "
             "float32 piece likewise, so that S servers can balance a model with few big layers (changes each "
             "quantized piece's min/max scaling); 0: whole layers; default auto: whole layers with one server, "
             "else pieces that give every server an even share of the quantized and of the small layers "
             "(docs/runtime.rst, Sharding)",
        valid=lambda chunk: chunk == AUTO_CHUNK or (type(chunk) is int and chunk >= 0),
        invalid=f"shard_chunk must be {AUTO_CHUNK} or a number of elements >= 0 (0: never cut a layer), "
                f"got {{value!r}}")
    error_feedback: str = option("none", group=_QUANTIZATION, choices=ERROR_FEEDBACK,
                                 help="error-feedback memory (default {default})",
                                 invalid=f"error_feedback must be one of {', '.join(ERROR_FEEDBACK)}")
    #: DGC's momentum correction: each worker's codec encodes its velocity u <- m u + g
    #: instead of g (mpigrad/feedback.py MomentumCorrection); 0: off. The update is then
    #: plain SGD, so the optimizer must have no momentum of its own.
    momentum_correction: float = option(
        0.0, group=_QUANTIZATION, type=float, metavar="M",
        help="DGC's momentum correction: each worker encodes its velocity u <- M u + g instead of its gradient g, "
             "and the update is plain SGD on the average (with the optimizer's own momentum refused); default "
             "{default}, off (docs/training.rst)",
        valid=lambda m: 0.0 <= m < 1.0, invalid="momentum_correction must be in [0, 1) (0: off), got {value}")
    bandwidth: float | str = option(  # bytes/s, or a schedule as written (parse_bandwidth)
        10e6, group=_NETWORK, metavar="RATE|SCHEDULE", parse=parse_bandwidth,
        show=lambda rate: format_rate(rate, bits=False),
        help="link bandwidth with its unit: bytes 10MB/s, 125MiB/s; bits 100Mbps, 1Gbit/s, 10Gb/s (default "
             "{default}); or a schedule on the simulated clock: 10MB/s@0s,1GB/s@60s,10MB/s@120s (each rate from its "
             "time on; a trailing ,repeat@PERIOD starts it over every PERIOD), or markov:10MB/s,1GB/s,dwell=30s,60s "
             "(two states, exponential dwell times of those means, drawn from --seed); a message crossing a change "
             "pays each part at its rate",
        valid=lambda rate: isinstance(rate, str) or (rate > 0 and math.isfinite(rate)),
        invalid="bandwidth must be positive")
    latency: float | str = option(  # s, or a schedule as written
        0.0, group=_NETWORK, metavar="DURATION|SCHEDULE", parse=parse_latency,
        help="per-message latency, e.g. 0.5ms (default {default}), or a schedule of latencies as for --bandwidth "
             "(0s@0s,20ms@60s or markov:0s,20ms,dwell=60s,10s)",
        valid=lambda latency: isinstance(latency, str) or latency >= 0, invalid="latency must be >= 0")
    link_bandwidth: dict[str, str] = option(  # rank -> its link's rate or schedule, as written
        factory=dict, group=_NETWORK, append=True, metavar="RANK=RATE|SCHEDULE", parse=parse_link_bandwidth,
        help="rank RANK's link at its own rate or schedule (repeatable), e.g. 1=1MB/s for a slow server link; a "
             "message goes at the slower of its two ranks' links")
    intra_bandwidth: float = option(
        10e9, group=_NETWORK, metavar="RATE", parse=lambda value: parse_rate(value),
        show=lambda rate: format_rate(rate, bits=False),
        help="with --ranks-per-node L > 1: each worker's link inside its node, both directions at once, a PCIe "
             "3.0 x16 class by default ({default}; NVLink: about 100GB/s to 450GB/s); a node's NIC is --bandwidth, "
             "shared by the node's concurrent flows",
        valid=lambda rate: rate > 0 and math.isfinite(rate), invalid="intra_bandwidth must be positive")
    intra_latency: float = option(
        5e-6, group=_NETWORK, metavar="DURATION", parse=lambda value: parse_duration(value),
        help="with --ranks-per-node L > 1: the per-message latency inside a node, in seconds (default {default})",
        valid=lambda latency: latency >= 0 and math.isfinite(latency), invalid="intra_latency must be >= 0")
    net_mode: str = option("virtual", group=_NETWORK, choices=NET_MODES,
                           help="virtual clock, real sleeps, or no model (default {default})",
                           invalid=f"net_mode must be one of {', '.join(NET_MODES)}")
    broadcast: str = option(
        "star", group=_NETWORK, choices=BROADCASTS,
        help="broadcast model: star (a copy per receiver, one after another; default), tree (ceil(log2(n)) "
             "rounds) or mpich (MPICH's binomial Ibcast: a node's copies to its children share its link)",
        invalid=f"broadcast must be one of {', '.join(BROADCASTS)}")
    broadcast_codec: str = option(
        "paper", group=_QUANTIZATION, metavar="CODEC", shown_before="error_feedback",
        help="codec of the server's broadcast of the average: paper (default: the workers' codec and bits, as "
             "MQGrad's Alg. 1; mcgq: fp32, as its all-reduce), same, fp32, fp16, a codec id at the policy's bits, "
             "or CODEC:BITS e.g. uniform:8; a plugin: package.module:Class or package.module:Class:BITS",
        valid=bool, invalid="broadcast_codec must not be empty")
    compute_time: float | None = option(
        None, group=_NETWORK, parse=parse_duration,
        help="charge this per iteration for the workers' compute instead of measured CPU time, e.g. 50ms "
             "(deterministic runs); the policy, encoding, decoding and averaging are then charged by --cost-model",
        valid=_none_or_at_least(0), invalid="compute_time must be >= 0")
    #: With compute_time: the cost model of local work (policy, encode, decode, average) charged on
    #: the simulated clock: "default" (the package's, mpigrad/cost_model.json), "none" or a
    #: JSON file written by ``mpigrad bench calibrate`` (mpigrad.costmodel).
    cost_model: str = option(
        "default", group=_NETWORK, metavar="default|none|FILE",
        help="with --compute-time: the cost model of the policy, encode, decode and average on the simulated "
             "clock: default (the package's, measured by mpigrad bench calibrate on the machine it names), FILE "
             "(one written by mpigrad bench calibrate) or none (charge no local work, the clock before issue 24) "
             "(default {default})",
        valid=bool, invalid="cost_model must be default, none or a cost model file")
    seed: int = option(0, group=_RUN, type=int,
                       help="seeds data order, model init, codecs and policy (default {default})",
                       valid=lambda seed: 0 <= seed < 2**63, invalid="seed must be a non-negative integer")
    trace: str = option("mpigrad-trace.h5", group=_OUTPUT, metavar="PATH", help="HDF5 trace file (default {default})",
                        valid=bool, invalid="trace path must not be empty")
    force: bool = option(False, group=_OUTPUT,
                         help="overwrite an existing trace; with --resume, resume on another network than the "
                              "trace's (the trace records it)")
    trace_flush: int = option(100, group=_OUTPUT, type=int,
                              help="flush the trace every N iterations (default {default})",
                              valid=_at_least(1), invalid="trace_flush must be at least 1")
    eval_every: int = option(100, group=_MODEL, type=int,
                             help="evaluate on the test split every N iterations, 0 = never (default {default})",
                             valid=_at_least(0), invalid="eval_every must be >= 0 (0 disables evaluation)")
    eval_samples: int | None = option(None, group=_MODEL, type=int,
                                      help="evaluate on the first N test examples (default all)",
                                      valid=_none_or_at_least(1), invalid="eval_samples must be >= 1")
    progress_every: int = option(10, group=_OUTPUT, type=int,
                                 help="progress line every N iterations, 0 = never (default {default})",
                                 valid=_at_least(0), invalid="progress_every must be >= 0")
    checksum_every: int = option(50, group=_OUTPUT, type=int,
                                 help="compare parameter checksums every N iterations (default {default})",
                                 valid=_at_least(0), invalid="checksum_every must be >= 0")
    #: Record norm_ratio every N iterations (0: never); the energies behind it are computed
    #: only then (``norm_due``), other rows are NaN.
    norm_every: int = option(1, group=_OUTPUT, type=int,
                             help="record the trace's norm_ratio every N iterations, 0 = never; the passes over the "
                                  "gradient behind it run only then, the other rows are NaN (default {default})",
                             valid=_at_least(0), invalid="norm_every must be >= 0 (0: never)")
    timeout: float = option(300.0, group=_ROBUSTNESS, parse=parse_duration,
                            help="seconds to wait for a rank before aborting (default {default})",
                            valid=lambda seconds: seconds > 0, invalid="timeout must be positive")
    device: str = option(
        "cpu", group=_RUN, choices=DEVICES,
        help="torch device (default cpu; auto: cuda where available). With cuda each GPU rank takes the device of "
             "its position on its node (docs/gpu.rst)",
        invalid=f"device must be one of {', '.join(DEVICES)}")
    #: GPU ranks of a node may share its devices (round-robin); without it more GPU ranks
    #: than devices is refused (runtime/plan/gpu.py).
    share_gpu: bool = option(False, group=_RUN, help="let a node's GPU ranks share its devices (default: more GPU "
                                                     "ranks than devices is refused)")
    tf32: str = option("default", group=_RUN, choices=TF32,
                       help="TF32 for float32 matmuls and convolutions on the GPU: torch's defaults (default; "
                            "recorded in the trace), or on/off",
                       invalid=f"tf32 must be one of {', '.join(TF32)}")
    wait: str = option(
        "auto", group=_RUN, choices=WAITS,
        help="how ranks wait for messages: poll without sleeping, sleep-poll with back-off, or auto (default: spin "
             "where every rank of the node has a core per thread, else sleep; the trace records each rank's)",
        invalid=f"wait must be one of {', '.join(WAITS)}")
    threads: int | None = option(None, group=_RUN, type=int, shown_before="wait",
                                 help="threads per rank (default SLURM_CPUS_PER_TASK or 1)",
                                 valid=_none_or_at_least(1), invalid="threads must be at least 1")
    walltime: float | None = option(None, group=_ROBUSTNESS, parse=parse_duration,
                                    help="stop, checkpoint and exit 75 before this much time has passed, e.g. 2h",
                                    valid=lambda seconds: seconds is None or seconds > 0,
                                    invalid="walltime must be positive")
    checkpoint: str | None = option(None, group=_ROBUSTNESS, metavar="PATH",
                                    help="checkpoint file (default TRACE.ckpt; the one before is kept as PATH.prev)")
    checkpoint_every: int | str | None = option(  # iterations (int) or a duration ("30m")
        None, group=_ROBUSTNESS, metavar="N|DURATION", parse=parse_interval,
        help="also checkpoint every N iterations, or every DURATION of wall time (e.g. 30m): a crash then loses at "
             "most one interval (default: only on stop)",
        valid=lambda every: every is None or checkpoint_interval_of(every)[1] > 0,
        invalid="checkpoint_every must be a positive number of iterations or a duration such as 30m")
    resume: bool = option(False, group=_ROBUSTNESS, help="continue from the checkpoint")
    #: (config file, N) when the file has a "# ranks: N" line, the world size it was written
    #: for (set by from_sources; not an option, not in to_dict).
    declared_ranks: ClassVar[tuple[str, int] | None] = None
    #: The options the user set, in the config file or on the command line (set by
    #: from_sources; not an option, not in to_dict): ``check_options`` refuses one the run
    #: would not use (``--bits`` to a policy or codec without a width to set).
    given: ClassVar[frozenset[str]] = frozenset()
    #: (file, bits) where a policy or codec on the command line replaced a config file's
    #: method and with it the file's ``bits`` (``from_sources``), else None: rank 0 says so.
    replaced_bits: ClassVar[tuple[str, int] | None] = None
    #: Lines rank 0 prints before the run (set by from_sources; not options, not in to_dict):
    #: what the command line changed in a config file's values besides replacing them
    #: (a ``--data`` that drops the file's ``data_dir``).
    notes: ClassVar[tuple[str, ...]] = ()
    #: The run's nodes once the launch resolved them (a ``runtime.plan.topology.Topology``; not
    #: an option, not in to_dict: ``ranks_per_node`` and ``exchange`` then hold the resolved
    #: values, which the trace records), else None.
    topology: ClassVar[Any] = None

    def norm_due(self, m: int) -> bool:
        """Whether iteration m records ``norm_ratio`` (and computes the energies behind it)."""
        return self.norm_every > 0 and m % self.norm_every == 0

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_sources(cls, config_file: str | None, overrides: dict[str, Any]) -> "RunConfig":
        """Defaults, then the TOML file, then non-None ``overrides`` (already typed).

        A file's ``data_dir`` goes with the file's ``data``: a ``data`` override naming another
        data set (``--data digits`` on a CIFAR-10 config) drops it, unless ``data_dir`` is
        overridden too, and ``notes`` says so. A schedule whose length is the run's
        (``SCHEDULE_LENGTH``: CosineAnnealingLR's ``T_max``, OneCycleLR's ``total_steps``)
        gets ``iterations`` where its options leave it out (``schedule_length_options``)."""
        values: dict[str, Any] = {}
        if config_file:
            values.update({k: coerce(k, v) for k, v in load_toml(config_file).items()})
        notes = []
        data = overrides.get("data")
        if (data is not None and overrides.get("data_dir") is None and values.get("data_dir") is not None
                and data != values.get("data", _FIELDS["data"].default)):
            notes.append(f"mpigrad: note: {config_file}'s data_dir = {values['data_dir']!r} went with its data "
                         f"{values.get('data', _FIELDS['data'].default)!r}, which --data {data} replaced: dropped")
            del values["data_dir"]
        given = set(values)
        for key, value in overrides.items():
            if value is None:
                continue
            given.add(key)
            value = coerce(key, value)
            if (key.endswith("_opts") or key == "link_bandwidth") and key in values:
                values[key] = {**values[key], **value}
            else:
                values[key] = value
        # A config file's width belongs to the file's method: a policy or codec set on the
        # command line replaces that method, and the file's bits with it (not refused).
        command_line = {key for key, value in overrides.items() if value is not None}
        replaced_bits = None
        if "bits" not in command_line and command_line & {"policy", "codec"}:
            given.discard("bits")
            if config_file and "bits" in values:
                replaced_bits = (config_file, values["bits"])
        try:
            config = cls(**values)
        except TypeError as exc:
            raise UsageError(str(exc)) from None
        if config.lr is None:
            config.lr = DEFAULT_LR.get(config.data, 0.2)
        if isinstance(config.lr_schedule, str) and isinstance(config.lr_schedule_opts, dict):
            config.lr_schedule_opts = schedule_length_options(config.lr_schedule, config.lr_schedule_opts,
                                                              config.iterations)
        config.notes = tuple(notes)
        ranks = declared_ranks(config_file) if config_file else None
        if ranks is not None:
            config.declared_ranks = (config_file, ranks)
        config.given = frozenset(given)
        config.replaced_bits = replaced_bits
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    # ---- derived ------------------------------------------------------------------
    def codec_config(self) -> dict[str, Any]:
        config = {"id": self.codec, **self.codec_opts}
        return config

    def broadcast_codec_config(self) -> tuple[dict[str, Any], int | None]:
        """(codec config, fixed bits or None) of the server's broadcast.

        ``paper``: MQGrad's reading (Alg. 1 line 54: re-quantize the average with the workers'
        codec and bits), except for ``mcgq``, whose paper merges the workers' samples by
        all-reduce and never samples the average again: its average travels as float32.
        ``same``: the workers' codec and bits. ``CODEC``: that codec with its default options,
        following the policy's bits when it has a bits option. ``CODEC:BITS``: at fixed bits.
        A codec plugin is ``package.module:Class``, or ``package.module:Class:BITS`` at fixed
        bits (a class name cannot be a number, so the last ``:`` part is the bits when it is one).
        Bits None means: follow the policy's bits.
        """
        choice = self.broadcast_codec
        if choice == "paper":
            choice = "fp32" if self.codec == "mcgq" else "same"
        if choice == "same":
            return self.codec_config(), None
        name, sep, bits_text = choice.rpartition(":")
        if sep and re.fullmatch(r"[0-9]+", bits_text):
            return {"id": name}, int(bits_text)
        if ":" in choice and "." not in choice.partition(":")[0]:
            from .codecs import available

            if choice.partition(":")[0] in available():  # uniform:x
                raise UsageError(f"broadcast_codec {self.broadcast_codec!r}: expected CODEC:BITS with "
                                 f"an integer BITS, e.g. uniform:8 (or package.module:Class[:BITS])")
        return {"id": choice}, None

    def policy_config(self) -> dict[str, Any]:
        """The policy's config; ``bits`` becomes its ``bits`` or ``initial_bits`` option."""
        from .policies import bits_option

        config = {"id": self.policy}
        name = bits_option(self.policy)
        if name is not None:
            config[name] = self.bits
        return {**config, **self.policy_opts}

    def network(self) -> Network | None:
        """The network's schedules (None: one constant rate and latency, every link)."""
        return network_from(self.bandwidth, self.latency, self.link_bandwidth, self.seed)

    def link_model(self) -> LinkModel:
        """The clock's network model of this run (nodes of several workers where
        ``ranks_per_node`` > 1: their NICs and intra-node links, :class:`~.clockmodel.Nodes`)."""
        network = self.network()
        if network is None:
            nodes = (Nodes(self.ranks_per_node, self.intra_bandwidth, self.intra_latency)
                     if isinstance(self.ranks_per_node, int) and self.ranks_per_node > 1 else None)
            return LinkModel(self.bandwidth, self.latency, self.net_mode, self.broadcast, nodes=nodes)
        return LinkModel(network.bandwidth.at(0.0), network.latency.at(0.0), self.net_mode, self.broadcast, network)

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint) if self.checkpoint else Path(self.trace + ".ckpt")

    @property
    def colocated(self) -> bool:
        """``--servers colocated``: worker rank s + 1 also serves shard s, rank 0 no shard."""
        return self.servers == COLOCATED

    def shard_count(self, size: int) -> int:
        """The number of shards S in a world of ``size`` ranks (P when colocated)."""
        return size - 1 if self.colocated else int(self.servers)

    def non_worker_ranks(self) -> int:
        """Ranks that train nothing (rank 0 and the shard servers): 1 when colocated, else S;
        a run of P workers has P + this many ranks."""
        return 1 if self.colocated else int(self.servers)

    @property
    def loss_weight_decay(self) -> float:
        """The coefficient of the loss's l2 term: ``weight_decay``, or 0 where the optimizer decays."""
        return self.weight_decay if self.weight_decay_in == "loss" else 0.0

    @property
    def update_options(self) -> dict[str, Any]:
        """The optimizer's options, ``weight_decay`` among them where the optimizer decays."""
        return update_options({"optimizer_opts": self.optimizer_opts, "weight_decay": self.weight_decay,
                               "weight_decay_in": self.weight_decay_in})

    @property
    def checkpoint_interval(self) -> tuple[str, float] | None:
        """``("iterations", N)`` or ``("seconds", S)`` from ``checkpoint_every``; None when unset."""
        return checkpoint_interval_of(self.checkpoint_every)

    def validate(self) -> None:
        """UsageError (one line) for the first value that fails its option's own check
        (``Option.check``, in field order), then for options that cannot go together."""
        for name, declared in OPTIONS.items():
            declared.check(getattr(self, name))
        checks = [
            (not (self.optimizer_opts.get("weight_decay") and (self.weight_decay_in == "optimizer" or self.weight_decay)),
             "weight decay given twice (--weight-decay and --optimizer-opt weight_decay): give it once, as "
             "--weight-decay X --weight-decay-in loss|optimizer"),
            (not self.pipeline or self.colocated,
             "pipeline needs servers = colocated (the pipelined iteration is built for that layout only)"),
            (not self.momentum_correction or (self.optimizer == "sgd" and not self.optimizer_opts.get("momentum")),
             "momentum correction is the update's momentum, accumulated before the codec: the optimizer must be "
             "plain sgd (drop --optimizer-opt momentum, or drop --momentum-correction)"),
            (not self.momentum_correction or not self.pipeline,
             "momentum correction with --pipeline is not built: the pipelined iteration encodes bucket by bucket "
             "(drop one of them)"),
            (self.exchange != "hierarchical" or self.colocated,
             "--exchange hierarchical needs --servers colocated (each local rank's slice is served by the workers "
             "of its local rank across nodes), not --servers S"),
            (self.net_mode != "off" or self.network() is None,
             "a bandwidth or latency schedule or --link-bandwidth needs a modelled network (net_mode virtual "
             "or sleep); with net_mode off nothing is charged (in the lab, give the schedule to mpigrad lab --rate)"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        if self.ranks_per_node != AUTO:
            self.check_nodes(self.ranks_per_node)

    def check_nodes(self, ranks_per_node: int, exchange: str | None = None) -> None:
        """UsageError (one line) where this run cannot have nodes of ``ranks_per_node``
        workers with ``exchange`` (default: the config's, which may still be ``auto``): the
        one rule for a declared L (``validate``) and for the L and exchange the launch
        resolves (runtime/plan/topology.py)."""
        if ranks_per_node == 1:
            return
        exchange = self.exchange if exchange is None else exchange
        checks = [
            (self.colocated,
             "--ranks-per-node L > 1 is built for --servers colocated (separate server ranks have no place on the "
             "nodes yet): use --servers colocated, or drop --ranks-per-node"),
            (not self.pipeline or exchange != "flat",
             "--pipeline with --ranks-per-node L > 1 is built on the hierarchical exchange only (the flat "
             "exchange's pipelined clock has one link per worker): use --exchange hierarchical, or drop one of them"),
            (not self.link_bandwidth and not isinstance(self.bandwidth, str) and not isinstance(self.latency, str),
             "--ranks-per-node L > 1 models each node's NIC at one constant --bandwidth and --latency: a schedule "
             "or --link-bandwidth with nodes is not built"),
            (self.broadcast == "star",
             "--ranks-per-node L > 1 models colocated shards as the runtime sends them, point to point: drop "
             "--broadcast (tree and mpich model MPI's broadcasts across ranks of their own links)"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)


# ---- the recipe ----------------------------------------------------------------------------


#: The config keys of the recipe besides ``lr``: the update rule (mpigrad/optim.py) and the
#: augmentation (mpigrad/data/augment.py), which ``describe_recipe`` puts in a few words.
RECIPE_KEYS = ("optimizer", "optimizer_opts", "weight_decay_in", "lr_schedule", "lr_schedule_opts", "lr_warmup",
               "lr_scaling", "augment", "augment_opts", "autocast", "momentum_correction")

#: The schedules whose length is a number of iterations with no default of torch's that fits
#: a run (lower-case names, as ``--lr-schedule`` matches them): the option that gets the run's
#: ``iterations`` where none of the options after it is given (``schedule_length_options``).
#: LinearLR, ConstantLR and PolynomialLR keep torch's default of 5 iterations.
SCHEDULE_LENGTH = {"cosineannealinglr": ("T_max",), "onecyclelr": ("total_steps", "epochs")}


def schedule_length_options(schedule: str, opts: dict[str, Any], iterations: int) -> dict[str, Any]:
    """``opts`` of ``schedule`` with its length (``SCHEDULE_LENGTH``) set to ``iterations``
    where the options give none: the schedule is stepped once per iteration from iteration 0,
    the warm-up's ramp multiplying its first rates, so a cosine of ``T_max = iterations``
    reaches ``eta_min`` at the run's end. Other schedules' options are returned as given."""
    names = SCHEDULE_LENGTH.get(schedule.lower())
    if not names or any(name in opts for name in names):
        return opts
    return {**opts, names[0]: iterations}


def update_options(values: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's options of a config (a dict of RunConfig keys, the missing ones at their
    defaults), with ``weight_decay`` where ``weight_decay_in`` is "optimizer"."""
    options = dict(values.get("optimizer_opts") or {})
    decay = values.get("weight_decay", _FIELDS["weight_decay"].default)
    if values.get("weight_decay_in", "loss") == "optimizer" and decay:
        options["weight_decay"] = decay
    return options


def describe_recipe(values: dict[str, Any]) -> str:
    """The recipe of a config (a dict of RunConfig keys, the missing ones at their defaults)
    in a few words, ``lr`` aside: ``sgd`` for the paper's plain SGD at a constant rate without
    augmentation, else e.g. ``sgd(momentum=0.9, nesterov=True) CosineAnnealingLR(T_max=300)
    warm-up 5 crop-flip autocast bf16``."""
    def get(key: str) -> Any:
        return values.get(key, {} if key.endswith("_opts") else _FIELDS[key].default)

    def options(opts: dict[str, Any]) -> str:
        return ", ".join(f"{key}={value}" for key, value in (opts or {}).items())

    opts = update_options(values)
    parts = [f"{get('optimizer')}({options(opts)})" if opts else str(get("optimizer"))]
    if get("momentum_correction"):
        parts.append(f"momentum correction {get('momentum_correction')}")
    if get("lr_scaling") == "linear":
        parts.append("lr x workers")
    if get("lr_schedule"):
        parts.append(f"{get('lr_schedule')}({options(get('lr_schedule_opts'))})")
    if get("lr_warmup"):
        parts.append(f"warm-up {get('lr_warmup')}")
    if get("augment") != "none":
        opts = get("augment_opts")
        parts.append(f"{get('augment')}({options(opts)})" if opts else str(get("augment")))
    if get("autocast") != "none":
        parts.append(f"autocast {get('autocast')}")
    return " ".join(parts)




def parse_assignments(items: list[str] | None, what: str) -> dict[str, Any] | None:
    """``--model-opt KEY=VALUE ...`` as a dict (see mpigrad.options); UsageError if malformed."""
    return options.parse_assignments(items, what, error=UsageError)


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
#: Every option's declaration (the field's ``Option`` with its name and default), in field order.
OPTIONS: dict[str, Option] = {
    f.name: dataclasses.replace(f.metadata["option"], name=f.name,
                                default=f.default_factory() if f.default is dataclasses.MISSING else f.default)
    for f in dataclasses.fields(RunConfig)}


def normal_shard_chunk(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict whose ``shard_chunk`` says what it does: with one server (``servers``
    absent or 1), 0 and ``auto`` both keep whole layers, so 0 (written before auto became
    the default, 2026-11-28) reads as ``auto``. Traces and checkpoints compare by it."""
    if config.get("shard_chunk") == 0 and config.get("servers", 1) == 1:
        return {**config, "shard_chunk": AUTO_CHUNK}
    return config


def coerce(key: str, value: Any) -> Any:
    """Check the type of one config value (from TOML or the command line) and convert units
    (``Option.convert``); UsageError for a key that is no option, naming close ones."""
    if key not in OPTIONS:
        close = [name for name in OPTIONS if name.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(f"unknown option {key!r}{hint}")
    if value is None:
        return None
    return OPTIONS[key].convert(value)


def declared_ranks(path: str) -> int | None:
    """N of the file's first "# ranks: N" line: the world size a config was written for (the
    jobscripts read the same line); None without one."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                match = re.match(r"# ranks: *([0-9]+)", line)
                if match:
                    return int(match.group(1))
    except OSError:
        return None
    return None


def dump_toml(values: dict[str, Any]) -> str:
    """``values`` (a config's keys, as :func:`load_toml` gives them) as TOML text that
    :func:`load_toml` reads back to the same values: strings, booleans, numbers, lists and
    tables (the ``*_opts`` keys, inline); a key whose value is None is left out (a TOML file
    has no null); a None inside a table or list, or a value of none of these types, is a
    ValueError naming its key."""
    lines = [f"{key} = {_toml_value(value, key)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    # JSON's escapes are TOML's but for characters beyond the BMP (JSON's surrogate pairs,
    # refused by TOML: kept as they are) and DEL (TOML wants it escaped, JSON does not).
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float.__repr__(value)
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item, key) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(str(k))} = {_toml_value(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    if value is None:
        raise ValueError(f"{key}: a value inside a table or list cannot be None (TOML has no null)")
    raise ValueError(f"{key}: a {type(value).__name__} has no TOML form")


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    return {key.replace("-", "_"): value for key, value in data.items()}
