"""The precision of a hierarchical exchange's slices inside a node (``--intra-codec``,
:mod:`.hierarchical`): what a node's workers send each other in its reduce-scatter and
all-gather. Only what crosses a NIC goes through mpigrad's codecs; inside the node a cheap,
exact-size format.

``int8`` (issue 62's "8 bits" inside the node, as SDP4Bit's intra-node step): block-wise
absmax scaling. The slice is cut into blocks of :data:`INT8_BLOCK` (256) consecutive values,
the last one shorter where ``n`` is not a multiple; block b's scale is
``s_b = float32(max |x| over the block) / 127`` (float32 arithmetic) and each of its values
goes as ``q = rint(x / s_b)`` (rounded to nearest, ties to even; clipped to [-127, 127]),
decoded as ``float32(q) * s_b``: at most ``s_b / 2`` from x (plus float32's own rounding of
the division and the product, below 2e-5 of s_b; and, where the block's absmax is below
about 1e-36 and its scale subnormal, a few 1e-45 more). A slice of n values is
``nbytes(n) = 4 * ceil(n / 256) + n`` bytes, 1 + 4/256 = 1.016 bytes a value (3.94 times
fewer than fp32's 4): the little-endian float32 scales first, then the int8 values. 256
values a block keeps that overhead under 2 % while one large value (a block that straddles
two layers of different magnitudes, an outlier) coarsens the grid of at most 255
neighbours, and the blocks stay few enough (4096 for 1M values) for NumPy's per-row
reductions to cost little. A block of zeros has scale 0 and decodes to zeros. A block that
holds a NaN or an infinity has scale NaN and all its values 0: it decodes to NaN
throughout, so a non-finite gradient stays non-finite (the run's non-finite checks name its
worker; which value was which, and the sign of an infinity, are lost). Every step is IEEE
float32 (exact reductions, correctly rounded division and product), so every rank decodes
the same bytes to the same values, bit for bit.
"""

from __future__ import annotations

import numpy as np

from ...config import INTRA_CODECS
from ...errors import UsageError

__all__ = ["IntraCodec", "INT8_BLOCK"]

#: Values per block of ``int8`` (one float32 scale each).
INT8_BLOCK = 256
_SCALE_BYTES = 4
_SCALE = np.dtype("<f4")
_LEVELS = np.float32(127)
#: The largest scale whose 127 steps stay finite: a block whose absmax is float32's largest
#: (3.4028235e38) would otherwise round its scale up and decode its top value to infinity.
_SCALE_MAX = np.nextafter(np.float32(np.finfo(np.float32).max) / _LEVELS, np.float32(0))


class IntraCodec:
    """The precision of the slices inside a node: ``fp32`` (exact), ``fp16`` (IEEE half,
    rounded to nearest even), ``bf16`` (the top 16 bits of a float32, rounded to nearest
    even) or ``int8`` (block-wise absmax scaling, the module's docstring). ``encode(values,
    out)`` writes ``values`` (float32, ``n`` of them) into ``out`` (``buffer(n)``);
    ``decode(buf)`` gives their float32 values (``n`` of them, for ``int8`` from ``len(buf)``:
    :meth:`values_in`)."""

    def __init__(self, name: str):
        if name not in INTRA_CODECS:
            raise UsageError(f"intra_codec must be one of {', '.join(INTRA_CODECS)}, got {name!r}")
        self.name = name
        self.dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.uint8}[name]
        #: int8: float32 scratch of the quotients, one per slice size (no allocation per encode;
        #: one codec per worker thread, as each HierarchicalWorker holds its own)
        self._quotients: dict[int, np.ndarray] = {}

    def nbytes(self, n: int) -> int:
        """The bytes of ``buffer(n)``: one slice of ``n`` values as it goes to another worker."""
        if self.name == "int8":
            return _SCALE_BYTES * -(-n // INT8_BLOCK) + n
        return n * np.dtype(self.dtype).itemsize

    def values_in(self, nbytes: int) -> int:
        """The ``n`` whose ``buffer(n)`` has ``nbytes`` bytes (``nbytes`` strictly increases
        with n, so one at most); UsageError for a size no slice has."""
        if self.name != "int8":
            n, rest = divmod(nbytes, np.dtype(self.dtype).itemsize)
        else:
            blocks = -(-nbytes // (INT8_BLOCK + _SCALE_BYTES))
            n = nbytes - _SCALE_BYTES * blocks
            rest = 0 if n >= 0 and self.nbytes(n) == nbytes else 1
        if rest or n < 0:
            raise UsageError(f"{nbytes} bytes are no {self.name} slice")
        return n

    def buffer(self, n: int) -> np.ndarray:
        return np.empty(self.nbytes(n) if self.name == "int8" else n, self.dtype)

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        if self.name == "int8":
            self._encode_int8(values, out)
        elif self.name == "bf16":
            bits = values.view(np.uint32)
            rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
            nan = np.isnan(values)
            np.right_shift(rounded, np.uint32(16), out=rounded)
            out[:] = rounded
            out[nan] = 0x7FC0  # a NaN stays one (rounding could carry it into infinity)
        else:
            with np.errstate(over="ignore"):  # beyond fp16's range: infinity, as torch's cast gives
                out[:] = values

    def decode(self, buf: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``buf``'s float32 values; ``int8`` writes them into ``out`` (float32, ``n`` of
        them) where given, else into a new array."""
        if self.name == "int8":
            return self._decode_int8(buf, out)
        if self.name == "bf16":
            return (buf.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return buf.astype(np.float32, copy=False)

    # ---- int8 ----------------------------------------------------------------------------------
    def _parts(self, buf: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``buf``'s scales (float32, one a block) and values (int8, ``n``): views, no copy."""
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != self.nbytes(n):
            raise UsageError(f"an int8 slice of {n} values is a uint8 buffer of {self.nbytes(n)} bytes, got "
                             f"{buf.dtype} {buf.shape}")
        head = _SCALE_BYTES * -(-n // INT8_BLOCK)
        return buf[:head].view(_SCALE), buf[head:].view(np.int8)

    @staticmethod
    def _blocks(a: np.ndarray, n: int) -> list[tuple[np.ndarray, slice]]:
        """``a``'s first ``n`` values as (blocks x values) views: the whole blocks, then the
        shorter last one (each with its blocks' slice of the scales)."""
        whole = n // INT8_BLOCK
        parts = []
        if whole:
            parts.append((a[:whole * INT8_BLOCK].reshape(whole, INT8_BLOCK), slice(0, whole)))
        if n > whole * INT8_BLOCK:
            parts.append((a[whole * INT8_BLOCK:n].reshape(1, n - whole * INT8_BLOCK), slice(whole, whole + 1)))
        return parts

    def _encode_int8(self, values: np.ndarray, out: np.ndarray) -> None:
        if values.dtype != np.float32 or values.ndim != 1:
            raise UsageError(f"int8 encodes a float32 vector, got {values.dtype} {values.shape}")
        n = values.size
        scales, codes = self._parts(out, n)
        quotients = self._quotients.get(n)
        if quotients is None:
            quotients = self._quotients[n] = np.empty(n, np.float32)
        for (block, rows), (quotient, _) in zip(self._blocks(values, n), self._blocks(quotients, n)):
            scale = scales[rows]
            # max |x| without a full-size |x|: the larger of max and -min (NaN if any is NaN)
            absmax = np.maximum(block.max(axis=1), -block.min(axis=1))
            np.abs(absmax, out=absmax)  # a block of zeros: +0, not -0 (the max of 0 and -0 may be either)
            bad = ~np.isfinite(absmax)
            np.divide(absmax, _LEVELS, out=scale)
            np.minimum(scale, _SCALE_MAX, out=scale)
            divisor = np.where((scale > 0) & ~bad, scale, np.float32(1))  # zeros (and NaN blocks): / 1
            np.divide(block, divisor[:, None], out=quotient)
            if bad.any():
                scale[bad] = np.nan
                quotient[bad] = 0  # no NaN into an int8 cast
            np.rint(quotient, out=quotient)
            np.clip(quotient, -_LEVELS, _LEVELS, out=quotient)  # a subnormal scale's rounding
        codes[:] = quotients  # float32 integers in [-127, 127]: exact

    def _decode_int8(self, buf: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        n = self.values_in(buf.size)
        scales, codes = self._parts(buf, n)
        if out is None:
            out = np.empty(n, np.float32)
        elif out.dtype != np.float32 or out.shape != (n,):
            raise UsageError(f"an int8 slice decodes into float32[{n}], got {out.dtype} {out.shape}")
        with np.errstate(over="ignore", invalid="ignore"):  # scales no encode gives (from the wire): inf, NaN
            for (code, rows), (value, _) in zip(self._blocks(codes, n), self._blocks(out, n)):
                np.multiply(code, scales[rows][:, None], out=value, dtype=np.float32)
        return out
