"""Shared Numba primitives: counter-based RNG and MSB-first bit streams.

Only ``@njit`` functions live in the kernels package. Kernels never allocate
gradient-sized arrays and never trust a length they were not handed by a wrapper
that validated it; readers that walk variable-length codes check every read
against the stream end themselves and return a negative status instead.
"""

import numpy as np
from numba import njit, uint64

_GOLDEN = uint64(0x9E3779B97F4A7C15)
_MIX1 = uint64(0xBF58476D1CE4E5B9)
_MIX2 = uint64(0x94D049BB133111EB)
_INV_2_24 = np.float32(1.0 / (1 << 24))

#: Status codes returned by stream-reading kernels (wrappers raise CodecError).
OK = 0
ERR_OVERRUN = -1      # a code ran past the end of the stream
ERR_BAD_CODE = -2     # a code that the format cannot contain
ERR_COUNT = -3        # decoded element count differs from the header
ERR_TRAILING = -4     # bits left over after the last element


@njit(inline="always")
def mix64(z):
    """splitmix64 finaliser: a bijective avalanche mix of a uint64."""
    z = (z ^ (z >> uint64(30))) * _MIX1
    z = (z ^ (z >> uint64(27))) * _MIX2
    return z ^ (z >> uint64(31))


@njit(inline="always")
def stream_key(seed, counter):
    """Key of one encode call: a hash of (seed, call counter)."""
    return mix64(uint64(seed) * _GOLDEN + mix64(uint64(counter) + _GOLDEN))


@njit(inline="always")
def uniform01(key, index):
    """Uniform float32 in [0, 1) for element ``index`` of the stream ``key``.

    Counter-based: depends only on (key, index), so any thread order gives the same draws.
    """
    r = mix64(key + uint64(index) * _GOLDEN)
    return np.float32(r >> uint64(40)) * _INV_2_24


@njit(inline="always")
def put_bits(buf, bitpos, value, nbits):
    """Write the low ``nbits`` (0..57) of ``value`` MSB-first at ``bitpos``; return new bitpos.

    The caller guarantees ``bitpos + nbits <= 8 * buf.size`` and that the buffer was
    zeroed where it writes (bits are OR-ed in).
    """
    v = uint64(value)
    remaining = nbits
    pos = bitpos
    while remaining > 0:
        byte = pos >> 3
        free = 8 - (pos & 7)
        take = remaining if remaining < free else free
        chunk = (v >> uint64(remaining - take)) & uint64((1 << take) - 1)
        buf[byte] |= np.uint8(chunk << uint64(free - take))
        remaining -= take
        pos += take
    return pos


@njit(inline="always")
def get_bits(buf, bitpos, nbits):
    """Read ``nbits`` (0..57) MSB-first at ``bitpos``; the caller checks the bounds."""
    v = uint64(0)
    remaining = nbits
    pos = bitpos
    while remaining > 0:
        byte = pos >> 3
        avail = 8 - (pos & 7)
        take = remaining if remaining < avail else avail
        chunk = (uint64(buf[byte]) >> uint64(avail - take)) & uint64((1 << take) - 1)
        v = (v << uint64(take)) | chunk
        remaining -= take
        pos += take
    return v


# ---- more status codes ----------------------------------------------------------------
ERR_NONFINITE = -5    # encode input holds NaN or infinity
ERR_RANGE = -6        # a scale or value range does not fit in float32
ERR_BAD_SCALE = -7    # a decoded scale is negative, non-finite or inconsistent

_F32_MAX_KEY = np.int32(0x7F7FFFFF)    # order key of +FLT_MAX
_F32_MIN_KEY = np.int32(-0x7F800000)   # order key of -FLT_MAX
_TINY = np.float32(2.0 ** -100)
_UNTINY = np.float32(2.0 ** 100)

#: Fixed-width codes are packed in blocks of BLOCK = 8 * GROUPS elements (see pack_block).
GROUPS = 512
BLOCK = 8 * GROUPS


# ---- float32 order keys -------------------------------------------------------------------
@njit(inline="always")
def order_key(bits):
    """int32 key of a float32 bit pattern, ordered like the floats (-0.0 just below +0.0).

    Integer min/max vectorise where float min/max do not. NaNs land outside the keys
    of finite floats: below ``order_key(-FLT_MAX)`` or above ``order_key(FLT_MAX)``.
    """
    return np.int32(bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(inline="always")
def key_float(key):
    """Inverse of order_key: the float32 whose key is ``key``."""
    return np.int32(key ^ ((key >> np.int32(31)) & np.int32(0x7FFFFFFF))).view(np.float32)


@njit(cache=True)
def key_range(xbits, start, stop):
    """(min key, max key) of ``xbits[start:stop]`` (int32 view of float32 values)."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    xs = xbits[start:stop]
    for i in range(xs.size):
        k = order_key(xs[i])
        lo = min(lo, k)
        hi = max(hi, k)
    return lo, hi


@njit(inline="always")
def keys_finite(lo, hi):
    return lo >= _F32_MIN_KEY and hi <= _F32_MAX_KEY


@njit(cache=True)
def max_abs_bits(xbits, start, stop):
    """Largest ``bits & 0x7FFFFFFF`` of the slice: the max-abs float's pattern.

    A result above 0x7F7FFFFF means the slice holds NaN or infinity.
    """
    m = np.int32(0)
    xs = xbits[start:stop]
    for i in range(xs.size):
        m = max(m, np.int32(xs[i] & np.int32(0x7FFFFFFF)))
    return m


# ---- deterministic float64 sums ---------------------------------------------------------
SUM_PLAIN = 0
SUM_ABS = 1
SUM_SQUARES = 2


@njit(inline="always")
def _term(v, mode):
    if mode == SUM_ABS:
        return abs(v)
    if mode == SUM_SQUARES:
        return v * v
    return v


@njit(cache=True)
def lane_sum(x, start, stop, mode):
    """Sum of x, |x| or x^2 (``mode`` SUM_*) over ``x[start:stop]`` in float64, fixed order.

    Element ``start + i`` is added to lane ``i % 8`` in index order; the lanes are then
    combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). The NumPy twins reproduce this
    order exactly, so scales derived from these sums are bit-identical.
    """
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    i = start
    while i + 8 <= stop:
        s0 += _term(np.float64(x[i]), mode)
        s1 += _term(np.float64(x[i + 1]), mode)
        s2 += _term(np.float64(x[i + 2]), mode)
        s3 += _term(np.float64(x[i + 3]), mode)
        s4 += _term(np.float64(x[i + 4]), mode)
        s5 += _term(np.float64(x[i + 5]), mode)
        s6 += _term(np.float64(x[i + 6]), mode)
        s7 += _term(np.float64(x[i + 7]), mode)
        i += 8
    rest = stop - i
    if rest > 0:
        s0 += _term(np.float64(x[i]), mode)
    if rest > 1:
        s1 += _term(np.float64(x[i + 1]), mode)
    if rest > 2:
        s2 += _term(np.float64(x[i + 2]), mode)
    if rest > 3:
        s3 += _term(np.float64(x[i + 3]), mode)
    if rest > 4:
        s4 += _term(np.float64(x[i + 4]), mode)
    if rest > 5:
        s5 += _term(np.float64(x[i + 5]), mode)
    if rest > 6:
        s6 += _term(np.float64(x[i + 6]), mode)
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(inline="always")
def scaled_reciprocal(span, levels):
    """(pre, inv) with ``(v * pre) * inv == v * levels / span`` up to float32 rounding.

    ``span > 0``. For spans below 2**-100, ``levels / span`` would overflow float32, so
    values are first scaled up by ``pre = 2**100`` (exact: a power of two).
    """
    if span < _TINY:
        return _UNTINY, np.float32(levels) / (span * _UNTINY)
    return np.float32(1.0), np.float32(levels) / span


# ---- fixed-width codes: blocked byte planes ---------------------------------------------
@njit(cache=True)
def pack_block(codes, bits, out, pos, words):
    """Pack BLOCK ``bits``-wide codes (``codes[0:BLOCK]``) into ``bits * GROUPS`` bytes.

    Element ``j * GROUPS + m`` (j = 0..7) sits at bits ``bits*j ..`` of the little-endian
    group word ``W_m``; byte ``p * GROUPS + m`` of the block is byte p of ``W_m``. Every
    loop runs over m, so all of them vectorise. ``words``: uint64 scratch of GROUPS.
    """
    M = GROUPS
    b = uint64(bits)
    for m in range(M):
        words[m] = (uint64(codes[m])
                    | (uint64(codes[M + m]) << b)
                    | (uint64(codes[2 * M + m]) << (b * uint64(2)))
                    | (uint64(codes[3 * M + m]) << (b * uint64(3)))
                    | (uint64(codes[4 * M + m]) << (b * uint64(4)))
                    | (uint64(codes[5 * M + m]) << (b * uint64(5)))
                    | (uint64(codes[6 * M + m]) << (b * uint64(6)))
                    | (uint64(codes[7 * M + m]) << (b * uint64(7))))
    for p in range(bits):
        shift = uint64(8 * p)
        dst = out[pos + p * M:pos + (p + 1) * M]
        for m in range(M):
            dst[m] = np.uint8(words[m] >> shift)


@njit(cache=True)
def unpack_block(src, pos, bits, codes, words):
    """Inverse of pack_block: ``bits * GROUPS`` bytes at ``src[pos:]`` -> ``codes[0:BLOCK]``."""
    M = GROUPS
    for m in range(M):
        words[m] = uint64(src[pos + m])
    for p in range(1, bits):
        shift = uint64(8 * p)
        plane = src[pos + p * M:pos + (p + 1) * M]
        for m in range(M):
            words[m] |= uint64(plane[m]) << shift
    mask = uint64((1 << bits) - 1)
    for j in range(8):
        shift = uint64(bits * j)
        dst = codes[j * M:(j + 1) * M]
        for m in range(M):
            dst[m] = np.uint8((words[m] >> shift) & mask)


@njit(cache=True)
def pack_tail(codes, count, bits, out, pos):
    """Pack ``codes[0:count]`` (count < BLOCK) MSB-first into ceil(count*bits/8) bytes."""
    nbytes = (count * bits + 7) >> 3
    out[pos:pos + nbytes] = 0
    bitpos = pos * 8
    for i in range(count):
        bitpos = put_bits(out, bitpos, codes[i], bits)


@njit(cache=True)
def unpack_tail(src, pos, count, bits, codes):
    bitpos = pos * 8
    for i in range(count):
        codes[i] = np.uint8(get_bits(src, bitpos, bits))
        bitpos += bits


@njit(inline="always")
def store(dst, i, value, accumulate):
    """``dst[i] = value``, or with ``accumulate`` ``dst[i] += value`` (float32, so the result
    is ``dst + decoded`` bit for bit). The flag is loop-invariant: LLVM unswitches the loop
    into a plain and an accumulating copy (measured as fast as two hand-written loops)."""
    if accumulate:
        dst[i] += value
    else:
        dst[i] = value


@njit(cache=True)
def packed_nbytes(n, bits):
    """Bytes taken by n ``bits``-wide codes: ceil(n * bits / 8)."""
    return (n * bits + 7) >> 3


# ---- Elias omega (recursive) code ---------------------------------------------------------
#: Largest group length get_omega accepts: values up to 2**57 - 1.
OMEGA_MAX_GROUP = 56


@njit(inline="always")
def bit_length(v):
    n = 0
    while v > 0:
        v >>= 1
        n += 1
    return n


def _omega_table(size):
    """Omega codes of 0 < v < size, as omega_code computes them (entry 0 unused)."""
    codes = np.zeros(size, np.uint64)
    lengths = np.zeros(size, np.int64)
    for v in range(1, size):
        code, length, rest = 0, 1, v
        while rest > 1:
            code |= rest << length
            length += rest.bit_length()
            rest = rest.bit_length() - 1
        codes[v], lengths[v] = code, length
    return codes, lengths


# A table for small values: the loop's data-dependent branches cost more than the code.
_OMEGA_CODES, _OMEGA_LENGTHS = _omega_table(1024)


@njit(inline="always")
def omega_code(v):
    """(code, length) of the Elias omega code of ``1 <= v < 2**40`` as one right-aligned word."""
    if v < 1024:
        return _OMEGA_CODES[v], _OMEGA_LENGTHS[v]
    code = uint64(0)
    length = 1
    while v > 1:
        nb = (np.float64(v).view(np.int64) >> 52) - 1022  # bit length; exact below 2**53
        code |= uint64(v) << uint64(length)
        length += nb
        v = nb - 1
    return code, length


@njit(cache=True)
def omega_len(v):
    """Length in bits of the Elias omega code of ``v >= 1``."""
    length = 1
    while v > 1:
        nb = bit_length(v)
        length += nb
        v = nb - 1
    return length


@njit(cache=True)
def get_omega(buf, bitpos, endbit):
    """Read an Elias omega code at ``bitpos``; never reads at or past ``endbit``.

    Returns (value, new bitpos); value is ERR_OVERRUN or ERR_BAD_CODE (< 0) on failure.
    """
    v = 1
    pos = bitpos
    while True:
        if pos >= endbit:
            return ERR_OVERRUN, pos
        if (buf[pos >> 3] >> (7 - (pos & 7))) & 1 == 0:
            return v, pos + 1
        if v > OMEGA_MAX_GROUP:
            return ERR_BAD_CODE, pos
        if pos + v + 1 > endbit:
            return ERR_OVERRUN, pos
        nbits = v + 1
        v = np.int64(get_bits(buf, pos, nbits))
        pos += nbits
