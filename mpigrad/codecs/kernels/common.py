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
