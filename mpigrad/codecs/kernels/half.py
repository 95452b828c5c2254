"""float32 <-> IEEE half precision, as NumPy casts them (round to nearest, ties to even).

Numba has no float16, and NumPy's cast runs 7-10 ns per element here (8 ns for the encode,
33x the uniform codec's 8-bit encode: mpigrad/cost_model.json before this kernel). The
narrowing works on the float32's bits; the widening reads a table of all 65,536 halves,
which NumPy's own cast fills (so decoding is NumPy's, bit for bit, NaN payloads included).
"""

import numpy as np
from numba import njit, uint32

#: float32 value of every half bit pattern (NumPy's widening cast).
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, boundscheck=False)
def narrow(src_bits, dst_bits):
    """Write the half of each float32 (``src_bits``: its bits as uint32) into ``dst_bits``
    (uint16, at least as long). Returns the number of values whose half is not finite (a
    NaN or infinity, or beyond +-65504 after rounding)."""
    bad = 0
    for i in range(src_bits.size):
        f = src_bits[i]
        sign = (f >> uint32(16)) & uint32(0x8000)
        f &= uint32(0x7FFFFFFF)
        if f >= uint32(0x477FF000):           # >= 65520 rounds to infinity; or inf, NaN
            if f > uint32(0x7F800000):          # NaN: the top of the payload, and still a NaN
                h = uint32(0x7C00) + ((f & uint32(0x7FFFFF)) >> uint32(13))
                if h == uint32(0x7C00):
                    h += uint32(1)
            else:
                h = uint32(0x7C00)
            bad += 1
        elif f >= uint32(0x38800000):         # a normal half: rebias, round 13 bits to even
            h = (f - uint32(0x38000000) + uint32(0xFFF) + ((f >> uint32(13)) & uint32(1))) >> uint32(13)
        elif f >= uint32(0x33000001):         # a subnormal half (2^-25 itself rounds to 0)
            e = f >> uint32(23)
            m = (f & uint32(0x7FFFFF)) | uint32(0x800000)
            shift = uint32(126) - e            # 14..24: m >> shift in units of 2^-24
            h = m >> shift
            rest = m & ((uint32(1) << shift) - uint32(1))
            halfway = uint32(1) << (shift - uint32(1))
            if rest > halfway or (rest == halfway and (h & uint32(1)) == uint32(1)):
                h += uint32(1)
        else:
            h = uint32(0)
        dst_bits[i] = h | sign
    return bad


@njit(cache=True, boundscheck=False)
def widen(src_bits, table, out):
    """``out[i] = table[src_bits[i]]`` for the first ``out.size`` halves."""
    for i in range(out.size):
        out[i] = table[src_bits[i]]


@njit(cache=True, boundscheck=False)
def widen_add(src_bits, table, out):
    """``out[i] += table[src_bits[i]]`` (float32 adds, as NumPy's mixed add)."""
    for i in range(out.size):
        out[i] += table[src_bits[i]]
