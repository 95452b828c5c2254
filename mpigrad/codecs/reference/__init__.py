"""Plain NumPy twins of the Numba codecs: the same bytes, no Numba.

A twin implements a codec's two private payload methods with NumPy alone::

    class UniformTwin:
        def encode_payload(self, codec, x, payload) -> (bits, flags, param_a, param_b, payload_len)
        def decode_payload(self, codec, header, payload, out) -> None

and the codec's row in :data:`mpigrad.codecs.parts.BUILTIN_CODECS` names it (its ``twin``:
``"mpigrad.codecs.reference.uniform:UniformTwin"``): that row is the only place a twin is
found from, so a twin needs no registration of its own.

``twin_of(codec)`` returns a codec object that runs the twin instead of the kernels,
so ``twin_of(c).encode(x)`` must equal ``c.encode(x)`` byte for byte (same seed, same
call count). Tests compare the two; ``mpigrad bench codecs`` reports the speed-up.
"""

from __future__ import annotations

import copy

import numpy as np

from ..base import Codec
from ..parts import parts_of, resolve

#: codec id -> its twin, one instance per codec, built on first use from its row.
_TWINS: dict[str, object] = {}


def has_twin(codec_id: str) -> bool:
    """True where built-in ``codec_id``'s row names a NumPy twin."""
    parts = parts_of(codec_id)
    return parts is not None and parts.twin is not None


def _twin(codec_id: str):
    """The twin instance of ``codec_id`` (KeyError where it has none)."""
    impl = _TWINS.get(codec_id)
    if impl is None:
        if not has_twin(codec_id):
            raise KeyError(codec_id)
        impl = _TWINS[codec_id] = resolve(parts_of(codec_id).twin)()
    return impl


def twin_of(codec: Codec) -> Codec:
    """A copy of ``codec`` (same config and RNG counter) whose payload methods are NumPy;
    KeyError where its codec has no twin (``has_twin``)."""
    impl = _twin(codec.codec_id)
    twin = copy.copy(codec)
    twin._encode_payload = lambda x, payload: impl.encode_payload(twin, x, payload)
    twin._decode_payload = lambda header, payload, out: impl.decode_payload(twin, header, payload, out)
    # decode(accumulate=True) on a twin: the twin's decode into scratch, then np.add,
    # i.e. literally ``out + decode(buf)``, the reference for the fused kernels.
    twin._accumulate_payload = lambda header, payload, out: Codec._accumulate_payload(
        twin, header, payload, out)
    twin._scratch = np.empty(0, np.float32)
    return twin
