"""Kernels of ``qsgd`` with Elias coding: the paper's gap / sign / level stream.

For each element with a nonzero level, in index order: omega(gap), one sign bit (1 for
negative), omega(level), where gap = index - previous nonzero index (the first is
index + 1), so both numbers are >= 1 and omega's lack of a code for 0 never bites.
The stream is untrusted on decode: every read is bounds-checked.
"""

import numpy as np
from numba import njit, uint64

from .common import (ERR_BAD_CODE, ERR_OVERRUN, ERR_TRAILING, OK, get_omega, omega_code,
                     scaled_reciprocal, stream_key, uniform01)
from .qsgd import level


@njit(inline="always")
def _append(out, pos, acc, pending, code, length):
    """Append ``length`` (<= 56) bits of ``code`` after the ``pending`` (< 8) bits at the top
    of ``acc``; store acc's 8 bytes at ``pos`` unconditionally (no unpredictable branch:
    ``out`` has 8 bytes of slack) and advance past the whole bytes."""
    acc |= code << uint64(64 - pending - length)
    pending += length
    for k in range(8):
        out[pos + k] = np.uint8(acc >> uint64(56 - 8 * k))
    whole = pending >> 3
    return pos + whole, acc << uint64(8 * whole), pending & 7


@njit(cache=True)
def encode(x, bucket, levels, scales, seed, counter, out):
    """Write the stream for ``x`` into ``out``; return (nonzero count, bytes written).

    ``out`` must hold the codec's worst case plus 8 bytes (qsgd.elias_stream_bound).
    """
    n = x.size
    key = stream_key(seed, counter)
    top = np.float32(levels)
    pos = 0
    acc = uint64(0)
    pending = 0
    nonzero = 0
    previous = -1
    for b in range((n + bucket - 1) // bucket):
        scale = scales[b]
        if scale == np.float32(0.0):
            continue
        pre, inv = scaled_reciprocal(scale, levels)
        for i in range(b * bucket, min((b + 1) * bucket, n)):
            v = x[i]
            q = np.int64(level(abs(v), pre, inv, top, uniform01(key, i)))
            if q == 0:
                continue
            code, length = omega_code(i - previous)
            pos, acc, pending = _append(out, pos, acc, pending, code, length)
            code, length = omega_code(q)
            code |= uint64(v < np.float32(0.0)) << uint64(length)
            pos, acc, pending = _append(out, pos, acc, pending, code, length + 1)
            previous = i
            nonzero += 1
    if pending:
        out[pos] = np.uint8(acc >> uint64(56))
        pos += 1
    return nonzero, pos


@njit(cache=True)
def decode(src, nonzero, bucket, levels, scales, out):
    """Decode ``nonzero`` (gap, sign, level) triples from ``src`` into zero-filled ``out``.

    Returns a status: ERR_OVERRUN, ERR_BAD_CODE (gap past the end, level 0 or > levels),
    ERR_TRAILING (the stream does not end right after the last triple, or its padding
    bits are not zero).
    """
    n = out.size
    endbit = src.size * 8
    out[:] = 0
    pos = 0
    index = -1
    s = np.float32(levels)
    for _ in range(nonzero):
        gap, pos = get_omega(src, pos, endbit)
        if gap < 0:
            return gap
        if gap > n - 1 - index:
            return ERR_BAD_CODE
        index += gap
        if pos >= endbit:
            return ERR_OVERRUN
        negative = (src[pos >> 3] >> (7 - (pos & 7))) & 1
        pos += 1
        q, pos = get_omega(src, pos, endbit)
        if q < 0:
            return q
        if q > levels:
            return ERR_BAD_CODE
        v = np.float32(q) * (scales[index // bucket] / s)
        out[index] = -v if negative else v
    if endbit - pos >= 8:
        return ERR_TRAILING
    while pos < endbit:
        if (src[pos >> 3] >> (7 - (pos & 7))) & 1:
            return ERR_TRAILING
        pos += 1
    return OK
