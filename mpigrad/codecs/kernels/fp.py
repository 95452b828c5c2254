"""The ``fp32`` codec's encode: a copy that checks finiteness in the same pass.

A value is NaN or infinity when its exponent bits are all set; counting those while copying
the bit patterns reads the input once (NumPy's copy and then a sum over the copy read it
twice: 1.8x a plain copy's time, measured with ``mpigrad bench codecs``).
"""

from numba import njit, uint32

_EXPONENT = uint32(0x7F800000)


@njit(cache=True, boundscheck=False)
def copy_count_nonfinite(src_bits, dst_bits):
    """``dst_bits[i] = src_bits[i]`` (float32 bit patterns as uint32); return how many of
    them are NaN or infinity."""
    bad = 0
    for i in range(src_bits.size):
        b = src_bits[i]
        dst_bits[i] = b
        bad += (b & _EXPONENT) == _EXPONENT
    return bad
