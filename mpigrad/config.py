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
from .clockmodel import Constant, LinkModel, Markov, Network, Steps
from .errors import UsageError

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
    #: (runtime/layout.py resolve_chunks).
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
    #: than devices is refused (runtime/gpu.py).
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


# ---- parsing of units and files ---------------------------------------------------------
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


def parse_assignments(items: list[str] | None, what: str) -> dict[str, Any] | None:
    """``--model-opt KEY=VALUE ...`` as a dict (see mpigrad.options); UsageError if malformed."""
    return options.parse_assignments(items, what, error=UsageError)


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
_OPTIONAL_TYPES = {"threads": int, "eval_samples": int, "data_dir": str, "checkpoint": str, "lr": float,
                   "min_quantize_size": int, "lr_schedule": str}


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


COLOCATED = "colocated"
#: ``shard_chunk``'s default (runtime/layout.py resolve_chunks).
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
