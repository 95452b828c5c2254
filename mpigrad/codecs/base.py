"""Codec base class and registry; the wire header they write is :mod:`.header`'s.

Every encoded buffer is a fixed 40-byte header (:mod:`.header` lays it out) followed by a
codec payload. The header carries everything a decoder needs besides
the codec class itself, so ``decode`` never depends on the decoding object's config.
``decode`` validates the header and the buffer length before any kernel runs; codecs
validate every length inside their payload before handing it to a kernel.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from .. import options
from ..plugins import call_factory, is_plugin
from ..registry import Registry
from .contract import check_contract
from .header import (BUILTIN_WIRE_IDS, FORMAT_VERSION, HEADER_SIZE, MAX_ELEMENTS, PLUGIN_WIRE_IDS, CodecError,
                     Header, PluginFault, _write_header, header_bytes, read_header)

__all__ = [
    "Codec", "CodecError", "FusedCodec", "Header", "PluginFault", "HEADER_SIZE", "FORMAT_VERSION", "MAX_ELEMENTS",
    "register_codec", "get_codec", "available", "codec_class", "read_header", "header_bytes", "BUILTIN_WIRE_IDS",
    "PLUGIN_WIRE_IDS",
]


def _admit_codec(spec: str, cls: type["Codec"]) -> None:
    """A codec plugin's own checks, after the registry's (``Registry.admit``): a wire id in
    the plugins' range, a declared error bound, and the header's methods left as they are."""
    wire_id = cls.__dict__.get("wire_id")
    if isinstance(wire_id, bool) or not isinstance(wire_id, int) or wire_id not in PLUGIN_WIRE_IDS:
        raise CodecError(f"codec {spec} must set wire_id to a number of its own in 128..255, the plugins' "
                         f"range (1..127 are mpigrad's codecs), got {wire_id!r}")
    if cls.error_bound is Codec.error_bound:
        raise CodecError(f"codec {spec} must declare error_bound(x), a bound on max |decode(encode(x)) - x| "
                         "that its load check holds it to")
    sealed = [name for name in _SEALED if getattr(cls, name) is not getattr(Codec, name)]
    if sealed:
        raise CodecError(f"codec {spec} overrides {', '.join(sealed)}: the header and its checks live there; "
                         "implement _encode_payload and _decode_payload instead")


#: Plugin configs (less the seed) whose instances passed ``contract.check_contract``.
_CHECKED: set[str] = set()
#: Methods a plugin inherits as they are: the header, its checks and the wire id live there.
_SEALED = ("encode", "decode", "max_encoded_size")


def register_codec(cls: type["Codec"]) -> type["Codec"]:
    """Class decorator: make ``cls`` reachable through ``get_codec({"id": cls.codec_id})``.

    For mpigrad's own codecs, wire ids 1..127; a codec of the user's own is a plugin
    (``package.module:Class``, wire ids 128..255), loaded by ``codec_class``."""
    if not (isinstance(cls.wire_id, int) and cls.wire_id in BUILTIN_WIRE_IDS):
        raise ValueError(f"codec {cls.__name__}: wire id {cls.wire_id!r} is not in 1..127, the range of "
                         "mpigrad's own codecs (a codec of your own is a plugin, package.module:Class, "
                         "with a wire id in 128..255)")
    return CODECS.register(cls)


def available() -> list[str]:
    """Sorted ids of the registered codecs (plugins are not listed)."""
    return CODECS.names()


def codec_class(codec_id: str) -> type["Codec"]:
    """The class of a registered id, of a plugin ``package.module:Class`` (loaded and checked
    by the registry, ``Registry.admit``, and ``_admit_codec``), or of a loaded plugin's own
    ``codec_id`` (what its ``get_config`` says, so ``get_codec(c.get_config())`` and
    ``with_bits`` work in a process that loaded it)."""
    return CODECS.lookup(codec_id)


def get_codec(config: dict[str, Any]) -> "Codec":
    """Build a codec from a JSON-able config such as ``{"id": "qsgd", "bits": 4}``.

    A plugin (``{"id": "package.module:Class", ...}``, or its own codec_id once loaded) is
    built through ``plugins.call_factory`` (an exception in its ``__init__`` is one line
    naming it), and each of its configs is checked once by ``contract.check_contract``."""
    if not isinstance(config, dict) or "id" not in config:
        raise CodecError("codec config must be a dict with an 'id' key")
    params = dict(config)
    codec_id = params.pop("id")
    cls = codec_class(codec_id)
    options.check_keys(f"codec {codec_id!r}", params, options.keyword_names(cls), error=CodecError)
    if not CODECS.is_loaded_plugin(cls):
        try:
            return cls(**params)
        except TypeError as exc:
            raise CodecError(f"bad options for codec {cls.codec_id!r}: {exc}") from None
    name = codec_id if is_plugin(codec_id) else f"{cls.__module__}:{cls.__qualname__}"
    key = json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}",
                      **{k: v for k, v in params.items() if k != "seed"}}, sort_keys=True, default=repr)
    if key not in _CHECKED:
        check_contract(call_factory(name, cls, params, CodecError), name)
        _CHECKED.add(key)
    return call_factory(name, cls, params, CodecError)


def wire_owner(wire_id: int) -> type["Codec"] | None:
    """The class, built-in or loaded plugin, that writes ``wire_id`` (None: none known here)."""
    return CODECS.by("wire_id", wire_id)


class Codec(ABC):
    """Gradient codec: 1-D float32 in, self-describing uint8 buffer out, and back.

    Subclasses set ``codec_id`` and ``wire_id`` (1..127 for mpigrad's codecs, 128..255 for
    plugins: docs/extending.rst), store their hyperparameters in
    ``__init__`` (rejecting bad values with CodecError), list them in ``get_config``,
    and implement ``max_payload_size``, ``_encode_payload`` and ``_decode_payload``.

    ``encode(x, out=None)`` writes into ``out`` (uint8, at least ``max_encoded_size(x.size)``
    bytes) when given, and returns a view of the bytes used. ``decode(buf, out=None)``
    writes into ``out`` (float32, exactly the element count) when given;
    ``decode(buf, out, accumulate=True)`` adds the decoded values to ``out`` instead, with
    the float32 result of ``out + decode(buf)`` bit for bit, and leaves ``out`` untouched
    when it raises. Codecs with a fused kernel override ``_accumulate_payload``; the default
    decodes into a scratch array that the instance keeps, then adds.

    Stochastic codecs take a ``seed``; each ``encode`` call consumes one counter value,
    so the same seed and call count give the same bytes. ``state_dict`` carries it.

    ``state_dict()`` is everything an instance holds beyond its config, for checkpoints:
    ``{"calls": n}`` here, and a codec that adapts between calls (e.g. ``mcgq`` with
    ``dynamic=True``) extends both methods with its own JSON-able entries, so that
    ``load_state_dict(state_dict())`` on a codec of the same config continues exactly.
    """

    codec_id: ClassVar[str]
    wire_id: ClassVar[int]
    #: True when the codec's ``bits`` option can be set per call by a bit policy.
    accepts_bits: ClassVar[bool] = False
    #: Bits per element of a codec without a bits option, for traces (0 when it varies).
    nominal_bits: ClassVar[int] = 0
    #: True when decode(encode(x)) is random given x (the codec draws from its RNG).
    stochastic: ClassVar[bool] = False
    #: True for a codec whose layers the runtime exchanges in two rounds (``powersgd``).
    two_rounds: ClassVar[bool] = False
    #: True when every ``encode`` of n elements is exactly ``max_encoded_size(n)`` bytes, so a
    #: receiver can size a frame from the element count alone (the runtime then broadcasts it
    #: in one message, not a length first); a codec whose size depends on the data says False.
    exact_size: ClassVar[bool] = False

    def __init__(self, *, checksum: bool = False, seed: int = 0):
        self.seed = options.check_int("seed", seed, 0, 2**63 - 1, error=CodecError)
        self.checksum = bool(checksum)
        self.calls = 0
        self._scratch = np.empty(0, np.float32)

    # ---- configuration ------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """JSON-able config; ``get_codec(c.get_config()) == c``."""
        config = {"id": self.codec_id, **self._config()}
        if self.checksum:
            config["checksum"] = True
        if self.stochastic:
            config["seed"] = self.seed
        return config

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """Codec-specific hyperparameters, JSON-able."""

    @property
    def takes_policy_bits(self) -> bool:
        """True when a bit policy sets this codec's bits: it has a bits option and was not
        configured by its levels (levels fix the quantization, so the policy's bits do not apply)."""
        return self.accepts_bits and "levels" not in self.get_config()

    @property
    def fixed_bits(self) -> int:
        """The bits a trace records for a codec the policy does not drive."""
        return int(getattr(self, "bits", None) or self.nominal_bits)

    def with_bits(self, bits: int) -> "Codec":
        """A codec of the same config with ``bits`` changed (for bit policies)."""
        if not self.accepts_bits:
            raise CodecError(f"codec {self.codec_id!r} has no 'bits' option")
        config = self.get_config()
        config.pop("levels", None)
        config["bits"] = int(bits)
        return get_codec(config)

    def wire_codecs(self, widths=()) -> list["Codec"]:
        """The codecs whose buffers a run of this codec puts on the wire, for the warm-up to
        compile before the first iteration: this one at each of ``widths`` (the bits a policy
        may choose; this one alone when none are given or the codec takes no bits)."""
        if widths and self.takes_policy_bits:
            return [self.with_bits(bits) for bits in widths]
        return [self]

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({args})"

    # ---- state (RNG counter, plus a subclass's adaptive state) ------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-instance state: ``{"calls": n}``; adaptive codecs add their own entries."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (subclasses check and take their entries)."""
        self.calls = int(state["calls"])

    def _next_stream(self) -> tuple[int, int]:
        """(seed, counter) for one encode call's random draws; advances the counter."""
        counter = self.calls
        self.calls += 1
        return self.seed, counter

    def error_bound(self, x: np.ndarray) -> float | None:
        """An upper bound on ``max |decode(encode(x)) - x|`` for float32 ``x`` (every draw of
        a stochastic codec), or None when the codec declares none. A plugin must declare one:
        ``contract.check_contract`` holds it to it when the plugin is built."""
        return None

    # ---- encode / decode ----------------------------------------------------------
    def max_encoded_size(self, n: int) -> int:
        """Upper bound on ``encode(x).size`` for ``x.size == n``."""
        return HEADER_SIZE + self.max_payload_size(n)

    @abstractmethod
    def max_payload_size(self, n: int) -> int:
        """Upper bound on the payload bytes for n elements."""

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        x = _as_float32_vector(x)
        size = self.max_encoded_size(x.size)
        if out is None:
            out = np.empty(size, np.uint8)
        elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1
                  and out.flags.c_contiguous):
            raise CodecError("out= must be a contiguous 1-D uint8 array")
        elif out.size < size:
            raise CodecError(f"out= holds {out.size} bytes, encode may need {size}")
        payload = out[HEADER_SIZE:size]
        try:
            fields = self._encode_payload(x, payload)
            header = Header(self.wire_id, *fields[:4], x.size, fields[4])
            if header.payload_len > payload.size:
                raise AssertionError(f"{self.codec_id} wrote past its max_payload_size")
            if self.exact_size and header.payload_len != payload.size:
                raise AssertionError(f"{self.codec_id} declares exact_size but wrote {header.payload_len} "
                                     f"payload bytes of {payload.size}")
        except CodecError:
            raise
        except Exception as exc:
            if not CODECS.is_loaded_plugin(type(self)):
                raise
            raise PluginFault(self, "encode", exc) from exc
        _write_header(out, header, self.checksum)
        return out[:HEADER_SIZE + header.payload_len]

    def decode(self, buf: np.ndarray, out: np.ndarray | None = None, *,
               accumulate: bool = False) -> np.ndarray:
        """Decode ``buf`` into ``out`` (allocated when None) and return ``out``.

        With ``accumulate=True`` (``out`` required) add the decoded values to ``out``:
        ``out[i] += value`` in float32, bit for bit ``out + decode(buf)``. Either way the
        header and payload are checked before anything is written; with ``accumulate``
        a buffer found corrupt at any point leaves ``out`` unchanged.
        """
        if accumulate and out is None:
            raise CodecError("decode(accumulate=True) needs out=, the float32 array to add to")
        header = read_header(buf)
        if header.wire_id != self.wire_id:
            other = wire_owner(header.wire_id)
            name = repr(other.codec_id) if other else f"unknown wire id {header.wire_id}"
            raise CodecError(f"buffer was encoded by codec {name}, not {self.codec_id!r}")
        payload = buf[HEADER_SIZE:]
        try:
            self._check_payload(header, payload)
            if out is None:
                out = np.empty(header.n, np.float32)
            elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 1
                      and out.flags.c_contiguous and out.flags.writeable):
                raise CodecError("out= must be a writeable contiguous 1-D float32 array")
            elif out.size != header.n:
                raise CodecError(f"out= holds {out.size} elements, buffer encodes {header.n}")
            if accumulate:
                self._accumulate_payload(header, payload, out)
            else:
                self._decode_payload(header, payload, out)
        except CodecError:
            raise
        except Exception as exc:
            if not CODECS.is_loaded_plugin(type(self)):
                raise
            raise PluginFault(self, "decode", exc) from exc
        return out

    @abstractmethod
    def _encode_payload(self, x: np.ndarray, payload: np.ndarray) -> tuple[int, int, int, int, int]:
        """Encode finite-checked contiguous float32 ``x`` into ``payload``.

        Return ``(bits, flags, param_a, param_b, payload_len)`` for the header.
        Raise CodecError if ``x`` holds a non-finite value.
        """

    def _check_payload(self, header: Header, payload: np.ndarray) -> None:
        """Reject header fields that disagree with the payload before ``decode`` allocates."""

    @abstractmethod
    def _decode_payload(self, header: Header, payload: np.ndarray, out: np.ndarray) -> None:
        """Decode ``payload`` (exactly ``header.payload_len`` bytes) into ``out``.

        Validate every header field and payload-internal length before any kernel runs.
        """

    def _accumulate_payload(self, header: Header, payload: np.ndarray, out: np.ndarray) -> None:
        """Add the decoded ``payload`` to ``out`` (float32: ``out + decode`` bit for bit).

        Every CodecError must be raised before the first write to ``out``. This default
        suits any codec: it decodes into the instance's scratch array (so corruption found
        only while decoding, as in a variable-length stream, leaves ``out`` untouched) and
        adds. A codec whose checks all run before its kernel writes overrides it with a
        fused kernel that adds as it decodes.
        """
        scratch = self._decode_scratch(header.n)
        self._decode_payload(header, payload, scratch)
        np.add(out, scratch, out=out)

    def _decode_scratch(self, n: int) -> np.ndarray:
        """A float32 scratch array of ``n`` elements, allocated once and grown as needed
        (one per instance: an instance decodes on one thread at a time)."""
        if self._scratch.size < n:
            self._scratch = np.empty(n, np.float32)
        return self._scratch[:n]



class FusedCodec(Codec):
    """A codec whose kernel adds as it decodes: implement ``_decode(header, payload, out,
    accumulate)``, raising every CodecError before the kernel's first write to ``out``."""

    @abstractmethod
    def _decode(self, header: Header, payload: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
        """Decode ``payload`` into ``out``, or add it to ``out`` when ``accumulate``."""

    def _decode_payload(self, header: Header, payload: np.ndarray, out: np.ndarray) -> None:
        self._decode(header, payload, out, False)

    def _accumulate_payload(self, header: Header, payload: np.ndarray, out: np.ndarray) -> None:
        self._decode(header, payload, out, True)


#: mpigrad's codecs by codec_id and wire_id (``register_codec``); plugins loaded in this
#: process apart from them (``available()`` and ``--help`` list mpigrad's codecs only).
CODECS: Registry[Codec] = Registry("codec", CodecError, id_attr="codec_id", keys=("wire_id",), base=Codec,
                                   base_name="mpigrad.codecs.Codec", admission=_admit_codec,
                                   plugin_hint=" (or a codec of your own: package.module:Class)")

def _as_float32_vector(x: Any) -> np.ndarray:
    """float32 C-contiguous 1-D view or copy of ``x``; CodecError for anything else."""
    if not isinstance(x, np.ndarray):
        raise CodecError(f"encode expects a numpy array, got {type(x).__name__}")
    if x.ndim != 1:
        raise CodecError(f"encode expects a 1-D array, got shape {x.shape}")
    if x.dtype != np.float32:
        if x.dtype.kind != "f":
            raise CodecError(f"encode expects floating-point values, got dtype {x.dtype}")
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


def non_finite_error(codec_id: str) -> CodecError:
    return CodecError(f"{codec_id}: input contains NaN or infinity; refusing to encode")
