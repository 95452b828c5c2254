"""Bit-selection policy base class, the observation it sees, option checks and the registry.

A policy is a plain object that knows nothing of MPI: rank 0 builds one with
``get_policy(config, n_layers, seed)`` and calls ``decide(observation)`` once per
iteration, in order, before the workers quantize. ``decide`` returns the bits of each
quantized layer for that iteration. Policies that learn or adapt log one row per
decision in ``drain_records()``; ``state_dict()`` / ``load_state_dict()`` carry
everything a resumed run needs to make the same decisions.

A policy of the user's own is named ``package.module:Class`` wherever an id is taken
(``--policy``, ``get_policy({"id": ...})``): the class is imported, checked (a ``Policy``
subclass with a ``policy_id`` of its own and every abstract method implemented), and
registered under its ``policy_id``; docs/extending.rst shows one in one file.
"""

from __future__ import annotations

import inspect
import json
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .. import options
from ..plugins import call_factory, is_plugin
from ..registry import Registry

__all__ = [
    "Policy", "PeriodicPolicy", "PolicyError", "Observation", "SettingCosts", "BITS_LIMITS", "register_policy", "get_policy",
    "available", "policy_class", "policy_options", "bits_option", "check_decision",
]

#: Widest bits range any policy accepts; a codec may support less (see ``Policy.check_codec``).
BITS_LIMITS = (1, 32)


class PolicyError(ValueError):
    """A policy config, observation or state that a policy cannot accept."""


@dataclass(frozen=True)
class SettingCosts:
    """What a policy that chooses settings (``Policy.chooses_settings``) sees of a low-rank
    codec's menu (``powersgd`` with ``ranks``/``widths``): ``codes`` the K setting codes
    (r > 0 rank r, -b width b: ``mpigrad.codecs.powersgd.setting_code``), ``errors`` and
    ``sizes`` layers x K (the workers' mean squared error of their M_i at each setting, and
    the bytes each setting puts on the wire), ``reference`` the code whose total error is
    the budget (the codec's ``rank``)."""

    codes: tuple[int, ...]
    errors: np.ndarray
    sizes: np.ndarray
    reference: int

    def __post_init__(self):
        k = len(self.codes)
        for name in ("errors", "sizes"):
            value = np.asarray(getattr(self, name), dtype=np.float64)
            if value.ndim != 2 or value.shape[1] != k or not np.isfinite(value).all() or (value < 0).any():
                raise PolicyError(f"setting {name} must be a finite, non-negative layers x {k} array, "
                                  f"got shape {value.shape}")
        if self.reference not in self.codes:
            raise PolicyError(f"setting reference {self.reference} is not one of {list(self.codes)}")


@dataclass(frozen=True)
class Observation:
    """What rank 0 knows when it chooses the bits of iteration ``iteration``."""

    iteration: int                          # m, 0-based
    loss: float                             # global loss L^m: mean of the workers' losses
    last_iteration_ms: float                # duration of iteration m-1 on the run's clock (0.0 at m=0)
    gradients: Sequence[np.ndarray] = ()    # workers' averaged gradient of m-1, per layer, before re-quantization
    codec: object | None = None             # the run's codec (accepts_bits) for error-based policies
    last_comm_ms: float = 0.0               # communication time of iteration m-1 on the run's clock (0.0 at m=0)
    last_bytes: int = 0                     # bytes iteration m-1 put on the network, both directions (0 at m=0)
    settings: SettingCosts | None = None    # a low-rank codec's menu, measured in m-1 (chooses_settings)
    lr: float | None = None                 # the learning rate iteration m runs at (None: not given)

    def __post_init__(self):
        options.check_int("observation iteration", self.iteration, 0, error=PolicyError)
        for name in ("last_iteration_ms", "last_comm_ms"):
            ms = getattr(self, name)
            if not isinstance(ms, (int, float, np.floating, np.integer)) or not math.isfinite(ms) or ms < 0:
                raise PolicyError(f"observation {name} must be finite and >= 0, got {ms!r}")
        options.check_int("observation last_bytes", self.last_bytes, 0, error=PolicyError)


def register_policy(cls: type["Policy"]) -> type["Policy"]:
    """Class decorator: make ``cls`` reachable through ``get_policy({"id": cls.policy_id})``."""
    return POLICIES.register(cls)


def available() -> list[str]:
    """Sorted ids of the registered policies."""
    return POLICIES.names()


def policy_class(policy_id: str) -> type["Policy"]:
    """The class of a registered id, of a plugin ``package.module:Class`` (loaded and checked
    by the registry, ``Registry.admit``), or of a loaded plugin's own ``policy_id`` (what its
    ``get_config`` says). Plugins are not listed by ``available()``."""
    return POLICIES.lookup(policy_id)


def policy_options(policy_id: str) -> dict[str, Any]:
    """The hyperparameters of a policy and their defaults, in signature order."""
    cls = policy_class(policy_id)
    params = inspect.signature(cls.__init__).parameters
    return {name: p.default for name, p in params.items()
            if p.kind is p.KEYWORD_ONLY and name not in _RUN_ARGS}


#: The policy options ``--bits`` fills, in order of preference (docs/extending.rst).
BITS_OPTIONS = ("bits", "initial_bits")


def bits_option(policy_id: str) -> str | None:
    """The option of this policy that the run's ``--bits`` sets: ``bits`` (its width) or
    ``initial_bits`` (its start width); None when it takes neither: it chooses every width
    itself and ``--bits`` does not apply (``mpigrad train`` refuses it)."""
    options = policy_options(policy_id)
    return next((name for name in BITS_OPTIONS if name in options), None)


def get_policy(config: dict[str, Any], n_layers: int = 1, seed: int = 0) -> "Policy":
    """Build a policy from a JSON-able config such as ``{"id": "mqgrad", "T": 5}``.

    ``n_layers`` is the number of quantized layers, ``seed`` the run's seed. Unknown ids,
    unknown option names and bad values raise PolicyError with a one-line message.
    """
    if not isinstance(config, dict) or "id" not in config:
        raise PolicyError("policy config must be a dict with an 'id' key")
    params = dict(config)
    policy_id = params.pop("id")
    options.check_keys(f"policy {policy_id!r}", params, list(policy_options(policy_id)), error=PolicyError)
    if is_plugin(policy_id):  # the user's code: any failure in one line
        return call_factory(policy_id, policy_class(policy_id), {**params, "n_layers": n_layers, "seed": seed},
                            PolicyError)
    return policy_class(policy_id)(**params, n_layers=n_layers, seed=seed)


def check_decision(policy: "Policy", bits: Any, iteration: int) -> list[int]:
    """``bits`` as ``decide`` returned them, checked: one whole number per quantized layer,
    each in the policy's ``bits_range()``; PolicyError naming the policy and iteration."""
    lo, hi = policy.bits_range()
    try:
        decided = [operator.index(b) for b in bits]
    except TypeError:
        decided = None
    if decided is None or len(decided) != policy.n_layers or not all(lo <= b <= hi for b in decided):
        raise PolicyError(f"policy {policy.policy_id!r} decided bits {bits!r} for iteration {iteration}: "
                          f"expected {policy.n_layers} whole number(s) in [{lo}, {hi}]")
    return decided


# ---- option checks, shared by the policies' __init__ ---------------------------------

def check_int(policy_id: str, name: str, value: Any, low: int | None = None,
              high: int | None = None) -> int:
    """``value`` as an int in [low, high]; PolicyError otherwise (bools and floats rejected)."""
    return options.check_int(name, value, low, high, error=PolicyError, prefix=f"policy {policy_id!r}: ")


def check_float(policy_id: str, name: str, value: Any, low: float, high: float = math.inf,
                low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] ((low, high] when ``low_open``)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        lo = f"> {low}" if low_open else f">= {low}"
        hi = "" if high == math.inf else f" and <= {high}"
        raise PolicyError(f"policy {policy_id!r}: {name} must be a number {lo}{hi}, got {value!r}")
    return float(value)


def check_choice(policy_id: str, name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise PolicyError(f"policy {policy_id!r}: {name} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}")
    return value


def check_bool(policy_id: str, name: str, value: Any) -> bool:
    return options.check_bool(name, value, error=PolicyError, prefix=f"policy {policy_id!r}: ")


def check_bits_range(policy_id: str, min_bits: Any, max_bits: Any) -> tuple[int, int]:
    lo = check_int(policy_id, "min_bits", min_bits, *BITS_LIMITS)
    hi = check_int(policy_id, "max_bits", max_bits, *BITS_LIMITS)
    if lo > hi:
        raise PolicyError(f"policy {policy_id!r}: bits range is empty (min_bits={lo} > max_bits={hi})")
    return lo, hi


def layer_gradients(policy_id: str, obs: "Observation", n_layers: int) -> list[np.ndarray]:
    """``obs.gradients`` checked: one 1-D float array per quantized layer; PolicyError otherwise."""
    if len(obs.gradients) != n_layers:
        raise PolicyError(f"policy {policy_id!r}: got {len(obs.gradients)} gradients for "
                          f"{n_layers} quantized layers")
    gradients = []
    for layer, gradient in enumerate(obs.gradients):
        gradient = np.asarray(gradient)
        if gradient.ndim != 1 or gradient.dtype.kind != "f":
            raise PolicyError(f"policy {policy_id!r}: layer {layer} gradient must be a 1-D float "
                              f"array, got {gradient.dtype} of shape {gradient.shape}")
        gradients.append(gradient)
    return gradients


def bits_codec(policy_id: str, obs: "Observation") -> Any:
    """``obs.codec`` when it has a bits option; PolicyError otherwise."""
    codec = obs.codec
    if codec is None or not getattr(codec, "accepts_bits", False):
        raise PolicyError(f"policy {policy_id!r} needs the run's codec, one with a 'bits' option, "
                          f"in Observation.codec (got {codec!r})")
    return codec


_RUN_ARGS = ("n_layers", "seed")


class Policy(ABC):
    """Chooses the bits of every quantized layer, once per iteration.

    Subclasses set ``policy_id``, take their hyperparameters as keyword-only ``__init__``
    arguments (checked there, PolicyError for bad values) followed by ``n_layers`` and
    ``seed``, list them in ``_config`` and implement ``decide``. Stateful subclasses
    override ``state_dict`` / ``load_state_dict``; recording ones override
    ``record_columns`` / ``drain_records``.
    """

    policy_id: ClassVar[str]
    #: True when ``decide`` reads ``Observation.gradients`` and ``Observation.codec``.
    uses_gradients: ClassVar[bool] = False
    #: True when ``decide`` reads the clock (``Observation.last_iteration_ms``): its bits,
    #: and so the whole run, depend on the network, and ``mpigrad trace retime`` refuses it.
    reads_clock: ClassVar[bool] = False
    #: True when, given a low-rank codec with menus (``powersgd`` ``ranks``/``widths``), the
    #: policy chooses setting codes from ``Observation.settings`` instead of bits
    #: (``setup_codec`` tells it; the runtime refuses the other policies with such a codec).
    chooses_settings: ClassVar[bool] = False

    def __init__(self, *, n_layers: int = 1, seed: int = 0):
        self.n_layers = check_int(self.policy_id, "n_layers", n_layers, 1)
        self.seed = check_int(self.policy_id, "seed", seed, 0, 2**63 - 1)

    # ---- configuration ------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """JSON-able config; ``get_policy(p.get_config(), p.n_layers, p.seed) == p``."""
        return {"id": self.policy_id, **self._config()}

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """Policy hyperparameters, JSON-able."""

    @abstractmethod
    def bits_range(self) -> tuple[int, int]:
        """The lowest and highest bits ``decide`` can return."""

    def check_codec(self, codec: Any) -> None:
        """Raise PolicyError unless ``codec`` can be set to every bits this policy may choose.

        The runtime calls this at start-up so that a bits range the codec cannot honour
        fails before the first iteration rather than in the middle of a run.
        """
        if not getattr(codec, "accepts_bits", False):
            raise PolicyError(f"policy {self.policy_id!r} chooses bits, but codec "
                              f"{getattr(codec, 'codec_id', codec)!r} has no 'bits' option")
        lo, hi = self.bits_range()
        for bits in range(lo, hi + 1):
            try:
                codec.with_bits(bits)
            except ValueError as exc:
                raise PolicyError(f"policy {self.policy_id!r} may choose {bits} bits, which codec "
                                  f"{codec.codec_id!r} rejects: {exc}") from None

    def setup_codec(self, codec: Any) -> None:
        """Rank 0 calls this once with the run's codec, before the first decision (and before
        a checkpoint's state is loaded). A policy that ``chooses_settings`` switches to the
        codec's menu here; the others ignore it."""

    def observes(self, iteration: int) -> bool:
        """True when ``decide`` at ``iteration`` may read what iteration - 1 measured (the
        runtime asks the workers for setting errors only then); by default ``uses_gradients``."""
        return self.uses_gradients

    def bits_ahead(self, iteration: int) -> tuple[int, ...] | None:
        """What ``decide`` will return for ``iteration`` whatever its observation, when the
        policy knows it before the iteration's losses; None when the decision may depend on
        them (the default). Asked just before ``decide`` for the same iteration, with no
        decision in between; it changes no state. The runtime sends such a decision ahead
        (``control = "ahead"``) and still calls ``decide`` with the full observation."""
        return None

    def __eq__(self, other: object) -> bool:
        return (type(self) is type(other) and self.get_config() == other.get_config()
                and (self.n_layers, self.seed) == (other.n_layers, other.seed))

    def __hash__(self) -> int:
        return hash((json.dumps(self.get_config(), sort_keys=True), self.n_layers, self.seed))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args}, n_layers={self.n_layers}, seed={self.seed})"

    # ---- decisions ----------------------------------------------------------------
    @abstractmethod
    def decide(self, obs: Observation) -> tuple[int, ...]:
        """Bits of each quantized layer for iteration ``obs.iteration`` (length ``n_layers``)."""

    def record_columns(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Columns of this policy's trace rows: name -> (numpy dtype string, shape)."""
        return {"iteration": ("i8", ()), "layer": ("i4", ()), "bits": ("i4", ())}

    def drain_records(self) -> list[dict[str, Any]]:
        """Rows (keys == ``record_columns()``) logged since the last drain; [] by default."""
        return []

    # ---- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain python/numpy state, picklable. Undrained records are not part of it."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise PolicyError(f"policy {self.policy_id!r} is stateless; got state keys {sorted(state)}")



#: mpigrad's policies by policy_id (``register_policy``); plugins loaded in this process
#: apart from them (``available()`` lists mpigrad's policies only).
POLICIES: Registry[Policy] = Registry("policy", PolicyError, id_attr="policy_id", base=Policy,
                                      base_name="mpigrad.policies.Policy",
                                      plugin_hint=" (or a class of your own: package.module:Class)")

class PeriodicPolicy(Policy):
    """A policy that re-decides every ``self.interval`` iterations from the observed gradients.

    Subclasses set ``interval``, call ``_start(bits)`` at the end of ``__init__`` and
    implement ``_choose(obs) -> bits``, appending their trace rows to ``self._records``;
    ``self._decisions`` counts the decisions taken before the current one.
    """

    interval: int

    def _start(self, bits: tuple[int, ...]) -> None:
        self._bits = tuple(bits)
        self._next_decision = 0      # first iteration at which a gradient triggers a decision
        self._decisions = 0
        self._records: list[dict[str, Any]] = []

    @abstractmethod
    def _choose(self, obs: Observation) -> tuple[int, ...]:
        """The bits of every layer from ``obs.gradients`` (present, not yet checked)."""

    def observes(self, iteration: int) -> bool:
        return iteration >= self._next_decision

    def decide(self, obs: Observation) -> tuple[int, ...]:
        if (len(obs.gradients) or obs.settings is not None) and obs.iteration >= self._next_decision:
            self._bits = tuple(self._choose(obs))
            self._next_decision = obs.iteration + self.interval
            self._decisions += 1
        return self._bits

    def drain_records(self):
        records, self._records = self._records, []
        return records

    def state_dict(self) -> dict[str, Any]:
        return {"bits": list(self._bits), "next_decision": self._next_decision,
                "decisions": self._decisions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bits = tuple(int(b) for b in state["bits"])
        lo, hi = self.bits_range()
        if len(bits) != self.n_layers or not all(lo <= b <= hi for b in bits):
            raise PolicyError(f"policy {self.policy_id!r}: checkpoint bits {bits} do not fit "
                              f"{self.n_layers} layers in [{lo}, {hi}]")
        self._bits = bits
        self._next_decision = int(state["next_decision"])
        self._decisions = int(state["decisions"])
        self._records = []
