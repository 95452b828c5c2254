"""``powersgd``: low-rank compression (Vogels et al., *PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization*, NeurIPS 2019), the codec of its factors.

PowerSGD does not encode one vector on its own: each worker sends P_i = M_i Q (M_i its
gradient matrix plus its error-feedback memory, Q a shared m x r matrix), the server
averages and orthogonalises the P_i and broadcasts P^, each worker sends Q_i = M_i^T P^,
the server averages and broadcasts Q, and every rank applies P^ Q^T. The runtime runs those
two rounds (``mpigrad/runtime/lowrank.py``, the ``gradients2``/``broadcast2`` phases of
``runtime/iteration.py``); this class is the family's configuration (``rank``,
``min_compression_rate``, ``start``), the rule that says which layers it compresses
(torch's ``_should_compress``), and the wire format of a factor: float32, 4 bytes per
element, like ``fp32`` under its own wire id (the factors are exact; the compression is the
rank). Before iteration ``start`` every layer travels as float32 in one round, as torch's
hook all-reduces before ``start_powerSGD_iter``.
"""

from __future__ import annotations

import numpy as np

from .base import CodecError, register_codec
from .checks import check_int
from .fp import _FloatCodec


@register_codec
class PowerSGD(_FloatCodec):
    """Low-rank factors, float32. ``rank``: the approximation's rank r (at most min(n, m) per
    layer); ``min_compression_rate``: a layer viewed as n x m (n its first dimension) is
    compressed when (n + m) r * min_compression_rate < n m (torch's rule, default 2);
    ``start``: the first compressed iteration (before it, every layer float32)."""

    codec_id = "powersgd"
    wire_id = 8
    dtype = np.dtype(np.float32)
    nominal_bits = 32
    #: The runtime exchanges this codec's layers in two rounds (P, then Q).
    two_rounds = True

    def __init__(self, *, rank: int = 1, min_compression_rate: float = 2.0, start: int = 0,
                 checksum: bool = False):
        super().__init__(checksum=checksum)
        self.rank = check_int(self.codec_id, "rank", rank, 1, 1 << 16)
        try:
            rate = float(min_compression_rate)
        except (TypeError, ValueError):
            raise CodecError(f"powersgd: min_compression_rate must be a number, got {min_compression_rate!r}") from None
        if not (np.isfinite(rate) and rate >= 1.0):
            raise CodecError(f"powersgd: min_compression_rate must be at least 1, got {min_compression_rate!r}")
        self.min_compression_rate = rate
        self.start = check_int(self.codec_id, "start", start, 0, 2**62)

    def _config(self):
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "start": self.start}

    @staticmethod
    def matrix_shape(shape) -> tuple[int, int]:
        """A tensor of ``shape`` as the n x m matrix PowerSGD compresses (n = shape[0])."""
        shape = tuple(int(d) for d in shape)
        n = shape[0] if shape else 1
        return n, int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1

    def matrix_rank(self, n: int, m: int) -> int:
        return min(n, m, self.rank)

    def compresses(self, shape) -> bool:
        """True for a tensor of at least 2 dimensions whose n x m view PowerSGD compresses:
        (n + m) r * min_compression_rate < n m, r = min(n, m, rank) (torch's ``_should_compress``)."""
        if len(tuple(shape)) < 2:
            return False
        n, m = self.matrix_shape(shape)
        return (n + m) * self.matrix_rank(n, m) * self.min_compression_rate < n * m

    def active(self, iteration: int) -> bool:
        """True when iteration ``iteration`` is compressed (from ``start`` on)."""
        return iteration >= self.start
