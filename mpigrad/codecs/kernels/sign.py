"""Kernels of the ``sign`` codec: one bit per element (1: x < 0) and a mean-|x| scale."""

import numpy as np
from numba import njit

from .common import (BLOCK, ERR_NONFINITE, GROUPS, OK, SUM_ABS, lane_sum, max_abs_bits,
                     pack_block, pack_tail, store, unpack_block, unpack_tail)

_F32_MAX_BITS = np.int32(0x7F7FFFFF)


@njit(cache=True)
def bucket_scales(x, xbits, bucket, scales):
    """scale = mean |x| per bucket (float64 sum in lane_sum order, rounded to float32)."""
    n = x.size
    for b in range(scales.size):
        start = b * bucket
        stop = min(start + bucket, n)
        if max_abs_bits(xbits, start, stop) > _F32_MAX_BITS:
            return ERR_NONFINITE
        scales[b] = np.float32(lane_sum(x, start, stop, SUM_ABS) / (stop - start))
    return OK


@njit(cache=True)
def encode(x, out):
    n = x.size
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        xs = x[start:stop]
        for i in range(xs.size):
            codes[i] = np.uint8(xs[i] < np.float32(0.0))
        if stop - start == BLOCK:
            pack_block(codes, 1, out, pos, words)
            pos += GROUPS
        else:
            pack_tail(codes, stop - start, 1, out, pos)


@njit(cache=True)
def decode(src, bucket, scales, out, accumulate):
    """Write -scale (bit 1) or +scale to ``out``, or with ``accumulate`` add it to ``out``
    (float32 adds: ``out + decode`` bit for bit)."""
    n = out.size
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        if stop - start == BLOCK:
            unpack_block(src, pos, 1, codes, words)
            pos += GROUPS
        else:
            unpack_tail(src, pos, stop - start, 1, codes)
        seg = start
        while seg < stop:
            b = seg // bucket
            seg_stop = min((b + 1) * bucket, stop)
            scale = scales[b]
            dst = out[seg:seg_stop]
            cs = codes[seg - start:seg_stop - start]
            for i in range(dst.size):
                store(dst, i, -scale if cs[i] else scale, accumulate)
            seg = seg_stop
