"""Numba kernels of MCGQ: stratified importance sampling over an integer CDF, and RLE.

Sampling (see ``mpigrad/codecs/mcgq.py`` for the contract): element k carries the
integer weight ``w_k = int(|x_k| * factor + 0.5)``; ``C_k`` is the running sum of the
weights up to and including k, ``total`` the sum of all. Sample i sits at
``(xi + i) * total / N``; the number of samples below ``C`` is
``ceil(C * ratio - xi)`` (``ratio = N / total``), forced to N at ``C == total``. Element
k's hit count is that number at ``C_k`` minus the number at ``C_{k-1}``: one monotone
pass, no search, no stored CDF. The signed counts go to a scratch array that the RLE
kernels then read (fusing sampling with the RLE bookkeeping measured 2-3x slower).

RLE stream (MSB-first): 32-bit B_g, 32-bit B_RLE, then per token either a non-zero value
(sign bit, then |v| in B_g - 1 bits) or a zero run (B_g zero bits, then the run length
in B_RLE bits). The writers emit whole bytes (no OR into the buffer, so it need not be
zeroed); the reader checks every read against the stream end.
"""

import math

import numpy as np
from numba import njit, uint64

from .common import ERR_BAD_CODE, ERR_COUNT, ERR_OVERRUN, ERR_TRAILING, OK, stream_key, uniform01

#: The decoded magnitudes add up to more than the sample count allows.
ERR_SAMPLES = -20

_ABS_MASK = np.uint32(0x7FFFFFFF)


# ---- scalar helpers -------------------------------------------------------------------------
@njit(inline="always")
def _weight(v, factor):
    return np.int64(abs(np.float64(v)) * factor + 0.5)


@njit(inline="always")
def _below(c, total, ratio, xi, n_samples):
    """Number of samples strictly below cumulative weight ``c`` (0 <= c <= total)."""
    if c >= total:
        return n_samples
    return min(np.int64(math.ceil(np.float64(c) * ratio - xi)), n_samples)


@njit(inline="always")
def _put(stream, acc, nacc, pos, value, nbits):
    """Append the low ``nbits`` (<= 57) of ``value``; flush whole bytes. Returns the state."""
    acc = (acc << uint64(nbits)) | uint64(value)
    nacc += nbits
    while nacc >= 8:
        nacc -= 8
        stream[pos] = np.uint8((acc >> uint64(nacc)) & uint64(0xFF))
        pos += 1
    return acc, nacc, pos


@njit(inline="always")
def _flush(stream, acc, nacc, pos):
    """Write the last partial byte, zero-padded; return the stream length in bits."""
    nbits = 8 * pos + nacc
    if nacc > 0:
        stream[pos] = np.uint8((acc << uint64(8 - nacc)) & uint64(0xFF))
    return nbits


@njit(inline="always")
def _take(stream, end, acc, nacc, pos, nbits):
    """Read ``nbits`` (<= 57); value -1 when the stream ends first. Returns (value, state)."""
    while nacc < nbits:
        if pos >= end:
            return np.int64(-1), acc, nacc, pos
        acc = (acc << uint64(8)) | uint64(stream[pos])
        pos += 1
        nacc += 8
    nacc -= nbits
    value = np.int64((acc >> uint64(nacc)) & uint64((1 << nbits) - 1))
    return value, acc, nacc, pos


# ---- sampling ---------------------------------------------------------------------------------
@njit(cache=True)
def sampling_offset(seed, counter):
    """The stratified samples' common offset xi in [0, 1) for encode call ``counter``."""
    return np.float64(uniform01(stream_key(seed, counter), 0))


@njit(cache=True)
def max_abs_bits(xbits):
    """Largest ``bits & 0x7FFFFFFF`` over a uint32 view of float32 values (> 0x7F7FFFFF: non-finite)."""
    m = np.uint32(0)
    for i in range(xbits.size):
        m = max(m, xbits[i] & _ABS_MASK)
    return m


@njit(cache=True)
def weight_total(x, factor):
    """Sum of the integer weights of ``x``."""
    total = np.int64(0)
    for i in range(x.size):
        total += _weight(x[i], factor)
    return total


@njit(cache=True)
def sample_counts(x, factor, total, ratio, xi, n_samples, counts):
    """Signed hit counts of the N stratified samples into ``counts`` (int32 or int64)."""
    c = np.int64(0)
    below_prev = np.int64(0)
    for k in range(x.size):
        c += _weight(x[k], factor)
        below = _below(c, total, ratio, xi, n_samples)
        count = below - below_prev
        below_prev = below
        negative = np.int64(x[k] < 0)
        counts[k] = (count ^ -negative) + negative


# ---- RLE of given integers ----------------------------------------------------------------------
@njit(cache=True)
def int_stats(values):
    """(max |v|, longest zero run, non-zero count, zero-run count) of integer ``values``.

    Branch-free: the zero/non-zero pattern of sampled counts is unpredictable.
    """
    run = longest = max_mag = zeros = runs = np.int64(0)
    was_zero = np.int64(0)
    for k in range(values.size):
        v = np.int64(values[k])
        is_zero = np.int64(v == 0)
        run = (run + 1) & -is_zero
        longest = max(longest, run)
        max_mag = max(max_mag, abs(v))
        zeros += is_zero
        runs += is_zero & (1 - was_zero)
        was_zero = is_zero
    return max_mag, longest, values.size - zeros, runs


@njit(cache=True)
def int_write(values, value_bits, run_bits, stream):
    """Write the RLE stream of integer ``values`` (|v| < 2**56); return its length in bits."""
    acc = uint64(0)
    nacc = 0
    pos = 0
    acc, nacc, pos = _put(stream, acc, nacc, pos, value_bits, 32)
    acc, nacc, pos = _put(stream, acc, nacc, pos, run_bits, 32)
    sign_bit = np.int64(1) << (value_bits - 1)
    run = np.int64(0)
    for k in range(values.size):
        v = np.int64(values[k])
        if v == 0:
            run += 1
            continue
        if run > 0:
            acc, nacc, pos = _put(stream, acc, nacc, pos, 0, value_bits)
            acc, nacc, pos = _put(stream, acc, nacc, pos, run, run_bits)
            run = 0
        code = -v | sign_bit if v < 0 else v
        acc, nacc, pos = _put(stream, acc, nacc, pos, code, value_bits)
    if run > 0:
        acc, nacc, pos = _put(stream, acc, nacc, pos, 0, value_bits)
        acc, nacc, pos = _put(stream, acc, nacc, pos, run, run_bits)
    return _flush(stream, acc, nacc, pos)


@njit(cache=True)
def rle_read(stream, value_bits, run_bits, scale, max_total, out):
    """Decode the codes after the 64-bit preamble of ``stream`` into ``out`` (v * scale).

    ``value_bits`` in 1..57, ``run_bits`` in 0..57 (checked by the caller). Every read is
    checked against the stream end, every run against the elements left, the magnitudes'
    sum against ``max_total``. Returns (status, sum of |v|, max |v|, longest zero run).
    """
    n = out.size
    end = stream.size
    acc = uint64(0)
    nacc = 0
    pos = 8
    sign_bit = np.int64(1) << (value_bits - 1)
    mag_mask = sign_bit - 1
    total = max_mag = longest = np.int64(0)
    after_run = False
    k = 0
    while k < n:
        code, acc, nacc, pos = _take(stream, end, acc, nacc, pos, value_bits)
        if code < 0:
            return ERR_OVERRUN, total, max_mag, longest
        if code == 0:
            if after_run:
                return ERR_BAD_CODE, total, max_mag, longest   # two runs in a row
            run, acc, nacc, pos = _take(stream, end, acc, nacc, pos, run_bits)
            if run < 0:
                return ERR_OVERRUN, total, max_mag, longest
            if run == 0:
                return ERR_BAD_CODE, total, max_mag, longest
            if run > n - k:
                return ERR_COUNT, total, max_mag, longest
            for j in range(k, k + run):
                out[j] = 0
            k += run
            longest = max(longest, run)
            after_run = True
            continue
        mag = code & mag_mask
        if mag == 0:
            return ERR_BAD_CODE, total, max_mag, longest       # "negative zero"
        if mag > max_total - total:
            return ERR_SAMPLES, total, max_mag, longest
        total += mag
        max_mag = max(max_mag, mag)
        out[k] = (-mag if code & sign_bit else mag) * scale
        k += 1
        after_run = False
    if pos != end or acc & uint64((1 << nacc) - 1) != 0:
        return ERR_TRAILING, total, max_mag, longest
    return OK, total, max_mag, longest


# ---- dynamic sampling ---------------------------------------------------------------------------
@njit(cache=True)
def wasserstein1_index(g, q):
    """W1 between |g|/||g||_1 and |q|/||q||_1 on the points k/n (both norms > 0)."""
    n = g.size
    sg = 0.0
    sq = 0.0
    for k in range(n):
        sg += abs(np.float64(g[k]))
        sq += abs(np.float64(q[k]))
    inv_g = 1.0 / sg
    inv_q = 1.0 / sq
    cg = 0.0
    cq = 0.0
    area = 0.0
    for k in range(n - 1):
        cg += abs(np.float64(g[k]))
        cq += abs(np.float64(q[k]))
        area += abs(cg * inv_g - cq * inv_q)
    return area / n
