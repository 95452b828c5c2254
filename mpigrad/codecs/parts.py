"""Where each of mpigrad's built-in codecs lives: one row per codec, the one place its parts
are named (issue 61, item 6).

A built-in codec has up to four parts, in four parallel trees: its host class
(``mpigrad/codecs/<x>.py``, registered by ``register_codec``), the Numba kernels that class
calls (``mpigrad/codecs/kernels/``), its plain NumPy twin (``mpigrad/codecs/reference/``:
the same bytes, to check the kernels) and its CUDA device twin
(``mpigrad/codecs/device/codecs.py``, whose kernels in ``device/kernels.py`` are shared by
every device codec and told apart by the integer kind code). :data:`BUILTIN_CODECS` names
them all, and every lookup of a part reads it:

- ``mpigrad.codecs`` imports each row's host module (:func:`host_modules`), which registers
  its classes; the registry (``base.CODECS``, by ``codec_id`` and ``wire_id``) is then the
  lookup of host classes, as it is for plugins;
- ``mpigrad.codecs.reference`` finds a codec's twin from its row (``has_twin``, ``twin_of``);
- ``mpigrad.codecs.device`` builds ``DEVICE_CODECS`` (codec id -> how the device twin's
  frames compare with the host's) from the rows that have a device twin, and
  ``device_codec`` builds the twin its row names;
- the device twins' ``kind`` (what the frame table's ``P_KIND`` column and the kernels'
  ``kind`` argument carry) is the row's ``kind_code``.

Why one table, not one folder per codec: the trees are split by what a part needs, not by
codec. The host modules import Numba's CPU kernels; the reference twins import NumPy alone;
the device package imports ``numba.cuda`` only on demand, and its kernels are one module
shared by six codecs (a codec is a ``kind`` branch inside them, not a file of its own); the
kernels share ``kernels/common.py`` and sign and TernGrad reuse QSGD's. A folder per codec
would cut through those shared modules and move every file (history, Numba's on-disk cache
keys, every import), for a layout the table gives without moving any.

The integer kind codes are declared here. ``device/kernels.py`` keeps its own copies
(``UNIFORM, SIGN, TERNGRAD, QSGD = 0, 1, 2, 3``; ``FLOAT32, FLOAT16 = 4, 5``) as literals on
purpose: Numba freezes a global into a kernel when it compiles, and its on-disk cache
(``cache=True``) is keyed by the kernel's own source file, so a code derived from this
module could change without invalidating kernels compiled with the old one.
``tests/test_codec_parts.py`` checks that the kernels' constants, the device twins' kinds
and this table agree, and that the table is complete.

Wire ids are not in the table: a codec's wire id is its class's ``wire_id`` (as a plugin's
is), and ``base.CODECS.by("wire_id", ...)`` is its lookup.

A leaf: this module imports nothing from mpigrad, so every codec module may import it. The
parts are named by dotted path (``package.module:Name``); :func:`resolve` imports one when
a caller asks for it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["BUILTIN_CODECS", "CodecParts", "KIND_CODES", "host_modules", "parts_of", "resolve"]


@dataclass(frozen=True)
class CodecParts:
    """One built-in codec's parts.

    ``codec_id``: the codec's id (``get_codec({"id": codec_id})``). ``host``: its class,
    ``"module:Class"``. ``kernels``: the Numba modules (``mpigrad.codecs.kernels.*``) its
    host module imports for it, beyond the shared ``kernels.common`` (empty: NumPy only).
    ``twin``: its NumPy twin's class (``reference.twin_of``), or None: it has none.
    ``device``: its device twin's class (``device.device_codec``), or None: it runs on the
    host only. ``kind_code`` and ``kind_name``: the device twin's kind, the integer the
    device kernels and the frame table's piece rows tell it by, and the name of the device
    kernels' constant equal to it (``device/kernels.py``); None without a device twin.
    ``device_agreement``: how the device twin's frames compare with the host codec's (the
    value of ``device.DEVICE_CODECS``); None without a device twin."""

    codec_id: str
    host: str
    kernels: tuple[str, ...] = ()
    twin: str | None = None
    device: str | None = None
    kind_code: int | None = None
    kind_name: str | None = None
    device_agreement: str | None = None

    def __post_init__(self):
        device_fields = (self.device, self.kind_code, self.kind_name, self.device_agreement)
        if any(field is None for field in device_fields) and any(field is not None for field in device_fields):
            raise ValueError(f"codec {self.codec_id!r}: a device twin needs its class, kind code, kind name "
                             "and agreement together (or none of them)")

    @property
    def host_module(self) -> str:
        """The module that defines (and, imported, registers) the host class."""
        return self.host.partition(":")[0]


_CODECS = "mpigrad.codecs"
_DEVICE = f"{_CODECS}.device.codecs"
_KERNELS = f"{_CODECS}.kernels"
_REFERENCE = f"{_CODECS}.reference"

#: mpigrad's own codecs, in wire-id order, each row naming every part of the codec.
#: Scales taken from a bucket's max |g| are exact on the device (an integer max of the
#: float32 bit patterns, in any order); scales taken from float64 sums are not: the host
#: sums each bucket in a fixed sequential lane order, which a parallel reduction cannot
#: reproduce, so the device sums in another order and the float32 scale can differ in its
#: last bit (rarely: the float64 sums differ by ~1e-16 relative). The random draws are the
#: host's (the same counter-based stream, element by element), so wherever the scales agree
#: the codes do too.
BUILTIN_CODECS: tuple[CodecParts, ...] = (
    CodecParts("fp32", f"{_CODECS}.fp:Float32", (f"{_KERNELS}.fp",), f"{_REFERENCE}.fp:Float32Twin",
               f"{_DEVICE}:DeviceFloat32", 4, "FLOAT32", "bit-identical"),
    CodecParts("fp16", f"{_CODECS}.fp:Float16", (f"{_KERNELS}.half",), f"{_REFERENCE}.fp:Float16Twin",
               f"{_DEVICE}:DeviceFloat16", 5, "FLOAT16", "bit-identical"),
    CodecParts("uniform", f"{_CODECS}.uniform:Uniform", (f"{_KERNELS}.uniform",),
               f"{_REFERENCE}.uniform:UniformTwin", f"{_DEVICE}:DeviceUniform", 0, "UNIFORM",
               "bit-identical (nearest and stochastic rounding)"),
    CodecParts("qsgd", f"{_CODECS}.qsgd:QSGD", (f"{_KERNELS}.qsgd", f"{_KERNELS}.elias"),
               f"{_REFERENCE}.qsgd:QSGDTwin", f"{_DEVICE}:DeviceQSGD", 3, "QSGD",
               "bit-identical with norm='max' (fixed coding); within float noise with norm='l2' "
               "(the sum of g^2 in another order); coding='elias' runs on the host"),
    CodecParts("terngrad", f"{_CODECS}.terngrad:TernGrad", (f"{_KERNELS}.terngrad", f"{_KERNELS}.qsgd"),
               f"{_REFERENCE}.terngrad:TernGradTwin", f"{_DEVICE}:DeviceTernGrad", 2, "TERNGRAD",
               "within float noise: the 2.5 sigma clip's std comes from float64 sums of g and "
               "g^2 in another order (equal scales, hence codes, in nearly every bucket; a "
               "bucket whose variance cancels to about zero can clip differently); "
               "bit-identical with clip=0 (scale max |g|)"),
    CodecParts("sign", f"{_CODECS}.sign:Sign", (f"{_KERNELS}.sign", f"{_KERNELS}.qsgd"),
               f"{_REFERENCE}.sign:SignTwin", f"{_DEVICE}:DeviceSign", 1, "SIGN",
               "within float noise: the per-bucket mean |g| is summed in another order "
               "(float64, then rounded to float32: equal in nearly every bucket)"),
    CodecParts("mcgq", f"{_CODECS}.mcgq:MCGQ", (f"{_KERNELS}.mcgq",), f"{_REFERENCE}.mcgq:MCGQTwin"),
    # The factors' frames are fp32's, fp16's or uniform's (docs/codecs.rst): no kernels or
    # twins of its own.
    CodecParts("powersgd", f"{_CODECS}.powersgd:PowerSGD"),
)

_BY_ID = {parts.codec_id: parts for parts in BUILTIN_CODECS}
if len(_BY_ID) != len(BUILTIN_CODECS):
    raise ValueError("a codec id appears twice in BUILTIN_CODECS")

#: codec id -> the device kind code, of the codecs with a device twin.
KIND_CODES: dict[str, int] = {p.codec_id: p.kind_code for p in BUILTIN_CODECS if p.kind_code is not None}
if len(set(KIND_CODES.values())) != len(KIND_CODES):
    raise ValueError("a device kind code appears twice in BUILTIN_CODECS")


def parts_of(codec_id: str) -> CodecParts | None:
    """The parts of built-in codec ``codec_id``; None for any other id (a plugin's, or none)."""
    return _BY_ID.get(codec_id) if isinstance(codec_id, str) else None


def host_modules() -> list[str]:
    """The host modules of the built-ins, each once, in table order (importing them
    registers every built-in codec class)."""
    return list(dict.fromkeys(parts.host_module for parts in BUILTIN_CODECS))


def resolve(path: str):
    """The object a ``"package.module:Name"`` path of the table names (its module imported)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
