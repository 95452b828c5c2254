"""Plain NumPy twins of the Numba codecs: the same bytes, no Numba.

A twin implements a codec's two private payload methods with NumPy alone::

    @register_twin("uniform")
    class UniformTwin:
        def encode_payload(self, codec, x, payload) -> (bits, flags, param_a, param_b, payload_len)
        def decode_payload(self, codec, header, payload, out) -> None

``twin_of(codec)`` returns a codec object that runs the twin instead of the kernels,
so ``twin_of(c).encode(x)`` must equal ``c.encode(x)`` byte for byte (same seed, same
call count). Tests compare the two; ``mpigrad bench codecs`` reports the speed-up.
"""

from __future__ import annotations

import copy
import importlib

import numpy as np

from ..base import Codec

_TWINS: dict[str, object] = {}
_MODULES = ("fp", "uniform", "qsgd", "terngrad", "sign", "mcgq")


def register_twin(codec_id: str):
    def decorator(cls):
        _TWINS[codec_id] = cls()
        return cls
    return decorator


def has_twin(codec_id: str) -> bool:
    _load()
    return codec_id in _TWINS


def twin_of(codec: Codec) -> Codec:
    """A copy of ``codec`` (same config and RNG counter) whose payload methods are NumPy."""
    _load()
    impl = _TWINS[codec.codec_id]
    twin = copy.copy(codec)
    twin._encode_payload = lambda x, payload: impl.encode_payload(twin, x, payload)
    twin._decode_payload = lambda header, payload, out: impl.decode_payload(twin, header, payload, out)
    # decode(accumulate=True) on a twin: the twin's decode into scratch, then np.add,
    # i.e. literally ``out + decode(buf)``, the reference for the fused kernels.
    twin._accumulate_payload = lambda header, payload, out: Codec._accumulate_payload(
        twin, header, payload, out)
    twin._scratch = np.empty(0, np.float32)
    return twin


def _load() -> None:
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")
