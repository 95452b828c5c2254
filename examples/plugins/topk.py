"""A codec in one file: top-k sparsification in NumPy.

Keeps the k = ceil(ratio * n) entries of largest magnitude, exactly, and drops the rest;
the payload is their indices (uint32, ascending) then their values (float32), 8k bytes for
any n. Biased by design: pair it with error feedback, which carries what was dropped into
the next iteration (Stich et al., *Sparsified SGD with memory*). From the repository root::

    PYTHONPATH=examples/plugins mpiexec -n 3 python -m mpi4py -m mpigrad train \\
        --codec topk:TopK --codec-opt ratio=0.05 --error-feedback residual --policy fixed \\
        --trace runs/topk.h5

The contract (docs/extending.rst): subclass ``Codec``, set ``codec_id`` and a ``wire_id``
in 128..255, take the options as keyword-only ``__init__`` arguments, implement
``_config``, ``max_payload_size``, ``error_bound``, ``_encode_payload`` and
``_decode_payload`` (``_check_payload`` runs before the output is allocated), raising
``CodecError`` for anything a buffer cannot hold. The base
class writes and checks the header; ``decode(..., accumulate=True)`` and ``out=`` come with
it. No Numba here (a plugin may use it): the NumPy code is its own reference twin.
"""

from __future__ import annotations

import math

import numpy as np

from mpigrad.codecs import Codec, CodecError


class TopK(Codec):
    codec_id = "topk"
    wire_id = 200

    def __init__(self, *, ratio: float = 0.01, checksum: bool = False):
        super().__init__(checksum=checksum)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise CodecError(f"topk: ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def _config(self):
        return {"ratio": self.ratio}

    def kept(self, n: int) -> int:
        """k: how many entries of n are kept (at least one of a non-empty vector)."""
        return min(n, max(1, math.ceil(self.ratio * n)))

    def max_payload_size(self, n: int) -> int:
        return 8 * self.kept(n)

    def error_bound(self, x: np.ndarray) -> float:
        # Kept entries are exact; every dropped one is no larger than the largest dropped.
        k = self.kept(x.size)
        if k >= x.size:
            return 0.0
        return float(np.partition(np.abs(x), x.size - k - 1)[x.size - k - 1])

    def _encode_payload(self, x, payload):
        n = x.size
        if not np.isfinite(x).all():
            raise CodecError("topk: input contains NaN or infinity; refusing to encode")
        if n >= 2**32:
            raise CodecError(f"topk: {n} values do not fit uint32 indices")
        k = self.kept(n)
        index = np.sort(np.argpartition(np.abs(x), n - k)[n - k:]).astype("<u4")
        payload[:4 * k] = index.view(np.uint8)
        payload[4 * k:8 * k] = x[index].astype("<f4").view(np.uint8)
        return 0, 0, k, 0, 8 * k          # bits, flags, param_a = k, param_b, payload length

    def _check_payload(self, header, payload):
        # Before decode allocates its output: the header's fields against each other.
        n, k = header.n, header.param_a
        if header.bits or header.flags or header.param_b or k > n or (n and not k) or n >= 2**32:
            raise CodecError("topk: corrupted header (bits, flags or parameters)")
        if header.payload_len != 8 * k:
            raise CodecError(f"topk: payload of {header.payload_len} bytes, but {k} entries take {8 * k}")

    def _decode_payload(self, header, payload, out):
        n, k = header.n, header.param_a
        index = payload[:4 * k].view("<u4")
        values = payload[4 * k:8 * k].view("<f4")
        if k and (index[-1] >= n or (np.diff(index.astype(np.int64)) <= 0).any()):
            raise CodecError("topk: corrupted payload (indices out of range or out of order)")
        if not np.isfinite(values).all():
            raise CodecError("topk: corrupted payload (a value is NaN or infinity)")
        out[:] = 0.0
        out[index] = values
