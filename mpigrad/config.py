"""RunConfig: every option of ``mpigrad train``, from defaults, a TOML file and the command line.

Precedence: built-in defaults < ``--config FILE`` < command-line options. TOML keys are the
option names with underscores (``batch_size = 32``); codec and policy hyperparameters go in
``[codec_opts]`` and ``[policy_opts]`` tables (or ``--codec-opt KEY=VALUE``). Values are
validated in ``RunConfig.validate`` so that a bad run fails before any rank starts work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from . import options
from .clockmodel import LinkModel, Network
from .errors import UsageError
from .units import (network_from, parse_bandwidth, parse_duration, parse_interval, parse_latency,
                    parse_link_bandwidth)


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


@dataclass
class RunConfig:
    """One training run. Units: times in seconds, bandwidth in bytes per second."""

    iterations: int = 300
    batch_size: int = 32
    lr: float | None = None          # None: the dataset's default (DEFAULT_LR)
    weight_decay: float = 0.004
    #: Where ``weight_decay`` acts: "loss", the paper's l2 term (on the model's chosen layers,
    #: through the codec with the gradient), or "optimizer", its ``weight_decay`` option (on
    #: the decoded update, every parameter, on every replica; decoupled for adamw).
    weight_decay_in: str = "loss"
    #: The update rule (mpigrad/optim.py): "sgd" without options is the paper's plain SGD;
    #: any other torch.optim optimizer by name, or package.module:factory, with its options.
    optimizer: str = "sgd"
    optimizer_opts: dict[str, Any] = field(default_factory=dict)
    lr_schedule: str | None = None   # a torch.optim.lr_scheduler class by name, stepped per iteration
    lr_schedule_opts: dict[str, Any] = field(default_factory=dict)
    lr_warmup: int = 0               # iterations of linear warm-up to the (scheduled) rate
    lr_scaling: str = "none"         # "linear": the base rate times the number of workers
    model: str = "paper-cnn"
    model_opts: dict[str, Any] = field(default_factory=dict)
    data: str = "digits"
    data_dir: str | None = None
    data_opts: dict[str, Any] = field(default_factory=dict)
    augment: str = "none"            # "crop-flip": random crops with padding and flips (mpigrad/data/augment.py)
    augment_opts: dict[str, Any] = field(default_factory=dict)
    #: "bf16": forward and loss under torch.autocast in bfloat16 (parameters, gradients and
    #: codecs stay float32); "none": float32 throughout.
    autocast: str = "none"
    codec: str = "uniform"
    codec_opts: dict[str, Any] = field(default_factory=dict)
    bits: int = 2
    policy: str = "mqgrad"
    policy_opts: dict[str, Any] = field(default_factory=dict)
    min_quantize_size: int | None = None   # None: the model's paper layers (quantized_parameters)
    servers: int | str = 1           # ranks 0..servers-1 are parameter servers, one shard each; or
                                     # "colocated": every worker serves a shard, rank 0 none
    #: The pipelined iteration (colocated servers): the loss goes after the forward pass and each
    #: bucket's frames as soon as backward has produced it; False: the paper's sequential order.
    pipeline: bool = False
    control: str = "ahead"           # CONTROLS
    #: Cut layers (quantized, and the small layers' piece) into pieces of at most this many
    #: elements (0: never); "auto": whole layers with one server, else even shares
    #: (runtime/plan/layout.py resolve_chunks).
    shard_chunk: int | str = "auto"
    error_feedback: str = "none"
    #: DGC's momentum correction: each worker's codec encodes its velocity u <- m u + g
    #: instead of g (mpigrad/feedback.py MomentumCorrection); 0: off. The update is then
    #: plain SGD, so the optimizer must have no momentum of its own.
    momentum_correction: float = 0.0
    bandwidth: float | str = 10e6    # bytes/s, or a schedule as written (parse_bandwidth)
    latency: float | str = 0.0       # s, or a schedule as written
    link_bandwidth: dict[str, str] = field(default_factory=dict)  # rank -> its link's rate or schedule, as written
    net_mode: str = "virtual"
    broadcast: str = "star"
    broadcast_codec: str = "paper"
    compute_time: float | None = None
    #: With compute_time: the cost model of local work (policy, encode, decode, average) charged on
    #: the simulated clock: "default" (the package's, mpigrad/cost_model.json), "none" or a
    #: JSON file written by ``mpigrad bench calibrate`` (mpigrad.costmodel).
    cost_model: str = "default"
    seed: int = 0
    trace: str = "mpigrad-trace.h5"
    force: bool = False
    trace_flush: int = 100
    eval_every: int = 100
    eval_samples: int | None = None
    progress_every: int = 10
    checksum_every: int = 50
    #: Record norm_ratio every N iterations (0: never); the energies behind it are computed
    #: only then (``norm_due``), other rows are NaN.
    norm_every: int = 1
    timeout: float = 300.0
    device: str = "cpu"
    #: GPU ranks of a node may share its devices (round-robin); without it more GPU ranks
    #: than devices is refused (runtime/plan/gpu.py).
    share_gpu: bool = False
    tf32: str = "default"
    wait: str = "auto"
    threads: int | None = None
    walltime: float | None = None
    checkpoint: str | None = None
    checkpoint_every: int | str | None = None  # iterations (int) or a duration ("30m")
    resume: bool = False
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
        """The clock's network model of this run."""
        network = self.network()
        if network is None:
            return LinkModel(self.bandwidth, self.latency, self.net_mode, self.broadcast)
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
        if self.checkpoint_every is None:
            return None
        if isinstance(self.checkpoint_every, int):
            return "iterations", self.checkpoint_every
        return "seconds", parse_duration(self.checkpoint_every)

    def validate(self) -> None:
        checks = [
            (self.iterations >= 1, "iterations must be at least 1"),
            (self.batch_size >= 1, "batch_size must be at least 1"),
            (self.lr is not None and self.lr > 0 and math.isfinite(self.lr), f"lr must be a positive number, got {self.lr}"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.lr_warmup >= 0, f"lr_warmup must be >= 0 iterations, got {self.lr_warmup}"),
            (self.lr_scaling in ("none", "linear"), f"lr_scaling must be none or linear, got {self.lr_scaling!r}"),
            (self.autocast in AUTOCAST, f"autocast must be {' or '.join(AUTOCAST)}, got {self.autocast!r}"
             + ("; fp16 needs a loss scale whose overflow every replica skips alike, which mpigrad does not "
                "have: use bf16" if self.autocast == "fp16" else "")),
            (self.weight_decay_in in WEIGHT_DECAY_IN,
             f"weight_decay_in must be {' or '.join(WEIGHT_DECAY_IN)}, got {self.weight_decay_in!r}"),
            (not (self.optimizer_opts.get("weight_decay") and (self.weight_decay_in == "optimizer" or self.weight_decay)),
             "weight decay given twice (--weight-decay and --optimizer-opt weight_decay): give it once, as "
             "--weight-decay X --weight-decay-in loss|optimizer"),
            (1 <= self.bits <= 32, f"bits must be in 1..32, got {self.bits}"),
            (self.min_quantize_size is None or self.min_quantize_size >= 1,
             "min_quantize_size must be at least 1"),
            (not self.pipeline or self.colocated,
             "pipeline needs servers = colocated (the pipelined iteration is built for that layout only)"),
            (self.shard_chunk == AUTO_CHUNK or (type(self.shard_chunk) is int and self.shard_chunk >= 0),
             f"shard_chunk must be {AUTO_CHUNK} or a number of elements >= 0 (0: never cut a layer), "
             f"got {self.shard_chunk!r}"),
            (self.error_feedback in ERROR_FEEDBACK,
             f"error_feedback must be one of {', '.join(ERROR_FEEDBACK)}"),
            (0.0 <= self.momentum_correction < 1.0,
             f"momentum_correction must be in [0, 1) (0: off), got {self.momentum_correction}"),
            (not self.momentum_correction or (self.optimizer == "sgd" and not self.optimizer_opts.get("momentum")),
             "momentum correction is the update's momentum, accumulated before the codec: the optimizer must be "
             "plain sgd (drop --optimizer-opt momentum, or drop --momentum-correction)"),
            (not self.momentum_correction or not self.pipeline,
             "momentum correction with --pipeline is not built: the pipelined iteration encodes bucket by bucket "
             "(drop one of them)"),
            (isinstance(self.bandwidth, str) or (self.bandwidth > 0 and math.isfinite(self.bandwidth)),
             "bandwidth must be positive"),
            (isinstance(self.latency, str) or self.latency >= 0, "latency must be >= 0"),
            (self.net_mode in NET_MODES, f"net_mode must be one of {', '.join(NET_MODES)}"),
            (self.net_mode != "off" or self.network() is None,
             "a bandwidth or latency schedule or --link-bandwidth needs a modelled network (net_mode virtual "
             "or sleep); with net_mode off nothing is charged (in the lab, give the schedule to mpigrad lab --rate)"),
            (self.broadcast in BROADCASTS, f"broadcast must be one of {', '.join(BROADCASTS)}"),
            (bool(self.broadcast_codec), "broadcast_codec must not be empty"),
            (self.compute_time is None or self.compute_time >= 0, "compute_time must be >= 0"),
            (bool(self.cost_model), "cost_model must be default, none or a cost model file"),
            (0 <= self.seed < 2**63, "seed must be a non-negative integer"),
            (self.trace_flush >= 1, "trace_flush must be at least 1"),
            (self.eval_every >= 0, "eval_every must be >= 0 (0 disables evaluation)"),
            (self.eval_samples is None or self.eval_samples >= 1, "eval_samples must be >= 1"),
            (self.progress_every >= 0, "progress_every must be >= 0"),
            (self.checksum_every >= 0, "checksum_every must be >= 0"),
            (self.norm_every >= 0, "norm_every must be >= 0 (0: never)"),
            (self.timeout > 0, "timeout must be positive"),
            (self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}"),
            (self.tf32 in TF32, f"tf32 must be one of {', '.join(TF32)}"),
            (self.wait in WAITS, f"wait must be one of {', '.join(WAITS)}"),
            (self.control in CONTROLS, f"control must be one of {', '.join(CONTROLS)}"),
            (self.threads is None or self.threads >= 1, "threads must be at least 1"),
            (self.walltime is None or self.walltime > 0, "walltime must be positive"),
            (self.checkpoint_interval is None or self.checkpoint_interval[1] > 0,
             "checkpoint_every must be a positive number of iterations or a duration such as 30m"),
            (bool(self.trace), "trace path must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)


# ---- the recipe ----------------------------------------------------------------------------


#: The config keys of the recipe besides ``lr``: the update rule (mpigrad/optim.py) and the
#: augmentation (mpigrad/data/augment.py), which ``describe_recipe`` puts in a few words.
RECIPE_KEYS = ("optimizer", "optimizer_opts", "weight_decay_in", "lr_schedule", "lr_schedule_opts", "lr_warmup",
               "lr_scaling", "augment", "augment_opts", "autocast", "momentum_correction")

#: ``autocast`` choices.
AUTOCAST = ("none", "bf16")

#: ``weight_decay_in`` choices.
WEIGHT_DECAY_IN = ("loss", "optimizer")


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
_OPTIONAL_TYPES = {"threads": int, "eval_samples": int, "data_dir": str, "checkpoint": str, "lr": float,
                   "min_quantize_size": int, "lr_schedule": str}



COLOCATED = "colocated"
#: ``shard_chunk``'s default (runtime/plan/layout.py resolve_chunks).
AUTO_CHUNK = "auto"


def parse_servers(value: Any) -> int | str:
    """``--servers``: a whole number S >= 1 of server ranks, or ``colocated``."""
    if isinstance(value, str) and value.strip() == COLOCATED:
        return COLOCATED
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"servers must be a number of server ranks (at least 1) or {COLOCATED!r}, got {value!r}")
    return value


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


def normal_shard_chunk(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict whose ``shard_chunk`` says what it does: with one server (``servers``
    absent or 1), 0 and ``auto`` both keep whole layers, so 0 (written before auto became
    the default, 2026-11-28) reads as ``auto``. Traces and checkpoints compare by it."""
    if config.get("shard_chunk") == 0 and config.get("servers", 1) == 1:
        return {**config, "shard_chunk": AUTO_CHUNK}
    return config


_CONVERTERS = {"servers": parse_servers, "shard_chunk": parse_shard_chunk, "bandwidth": parse_bandwidth,
               "latency": parse_latency, "link_bandwidth": parse_link_bandwidth, "compute_time": parse_duration,
               "walltime": parse_duration, "timeout": parse_duration, "checkpoint_every": parse_interval}


def coerce(key: str, value: Any) -> Any:
    """Check the type of one config value (from TOML or the command line) and convert units."""
    if key not in _FIELDS:
        close = [name for name in _FIELDS if name.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(f"unknown option {key!r}{hint}")
    if value is None:
        return None
    if key in _CONVERTERS:
        return _CONVERTERS[key](value)
    if key.endswith("_opts"):
        if not isinstance(value, dict):
            raise UsageError(f"{key} must be a table of KEY = VALUE")
        return dict(value)
    default = _FIELDS[key].default
    kind = _OPTIONAL_TYPES.get(key, type(default))
    if kind is bool:
        return options.check_bool(key, value, error=UsageError)
    if kind is int:
        return options.check_int(key, value, error=UsageError)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{key} must be a number, got {value!r}")
        return float(value)
    if kind is str and not isinstance(value, str):
        raise UsageError(f"{key} must be a string, got {value!r}")
    return value


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
