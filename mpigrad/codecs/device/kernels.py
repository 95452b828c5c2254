"""Numba CUDA kernels of the device codecs: the host kernels' twins, payload for payload.

Fixed-width codes use the host's blocked byte planes (``kernels.common.pack_block``): a full
block of BLOCK = 8 * GROUPS codes is GROUPS little-endian group words, word m holding the
codes of elements ``j * GROUPS + m`` (j = 0..7), its byte p stored at ``p * GROUPS + m``.
One thread builds one word, so reads and writes are coalesced; the last, partial block is
an MSB-first bit stream (``pack_tail``), one thread per byte to write and one per code to
read. Payload bytes are written one at a time (a frame's pieces start at any byte), scales
go through an aligned float32 scratch array.

Scales: per-bucket min/max order keys (integer atomics: exact in any order; they give
uniform's ranges and the max |x| of qsgd and terngrad, and flag NaN/inf) and float64 sums
of x, |x| and x^2 over chunks (sign's mean, terngrad's std, qsgd's l2 norm: a different
order from the host's lanes, so within float noise). Decoding checks the codes a format
cannot hold (TernGrad's 3, QSGD levels above s) in a pass of its own before writing.

Float arithmetic is the host's, operation for operation: products and sums that the host
rounds separately go through ``fmul_rn``/``fadd_rn`` (``dmul_rn``/``dadd_rn`` in float64;
CUDA would otherwise fuse ``a * b + c`` into one rounding), divisions and square roots are
IEEE (Numba's default, no fastmath). Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the
same helpers are plain NumPy float32 (float64) operations.
"""

import math

import numpy as np
from numba import config, cuda

from ..kernels.common import BLOCK, GROUPS
from . import threads_per_block

SIMULATOR = bool(config.ENABLE_CUDASIM)
if SIMULATOR:
    from .simulator import install_unless_refused

    install_unless_refused()
    # What Numba's integer types do when called on a value in the simulator (their
    # ``cast_python_value``), without numba.core.types' dispatch and import on every call.
    int32, uint32, uint64 = np.int32, np.uint32, np.uint64
else:  # compiled: a GPU, or the PTX check (tests/device_ptx.py)
    from numba import int32, uint32, uint64
#: Threads per block: fewer under the simulator, where every thread is a Python thread
#: (``MPIGRAD_DEVICE_THREADS`` sets it for either: ``threads_per_block``).
THREADS = threads_per_block(SIMULATOR)
#: Elements one block reduces in the min/max pass (fewer than a bucket: several blocks).
CHUNK = THREADS * 32

ERR_NONFINITE = 0  # status slots (int32, set to 1 when the condition was met)
ERR_RANGE = 1
ERR_BAD_SCALE = 2
ERR_BAD_CODE = 3
STATUS_SLOTS = 4

#: The codes' kinds (pack_blocks, unpack_blocks): the ``kind_code`` of each codec's row in
#: ``mpigrad.codecs.parts``, where they are declared, kept here as literals (Numba freezes a
#: global into a kernel, and its cache is keyed by this file: tests/test_codec_parts.py checks).
UNIFORM, SIGN, TERNGRAD, QSGD = 0, 1, 2, 3
WRITE, ADD, CHECK = 0, 1, 2  # what unpack_blocks does with a code
SCALE_MAX_ABS, SCALE_L2, SCALE_CLIPPED = 0, 1, 2  # finish_scales' kinds

_I32_MAX = 0x7FFFFFFF
_I32_MIN = -0x80000000
_F32_MAX_KEY = 0x7F7FFFFF
_F32_MIN_KEY = -0x7F800000
_TINY = 2.0 ** -100
_UNTINY = 2.0 ** 100
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

if SIMULATOR:
    def _fmul(a, b):
        return np.float32(a) * np.float32(b)

    def _fadd(a, b):
        return np.float32(a) + np.float32(b)

    def _rint(a):
        return np.rint(np.float32(a))

    def _floor(a):
        return np.floor(np.float32(a))

    def _dmul(a, b):
        return np.float64(a) * np.float64(b)

    def _dadd(a, b):
        return np.float64(a) + np.float64(b)

    def _as_float(bits):
        return np.int32(bits).view(np.float32)

    def _as_int(value):
        return np.float32(value).view(np.int32)

    def _as_double(bits):
        return np.int64(bits).view(np.float64)
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _fmul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def _fadd(a, b):
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True)
    def _rint(a):
        return libdevice.rintf(a)

    @cuda.jit(device=True)
    def _floor(a):
        return libdevice.floorf(a)

    @cuda.jit(device=True)
    def _dmul(a, b):
        return libdevice.dmul_rn(a, b)

    @cuda.jit(device=True)
    def _dadd(a, b):
        return libdevice.dadd_rn(a, b)

    @cuda.jit(device=True)
    def _as_float(bits):
        return libdevice.int_as_float(bits)

    @cuda.jit(device=True)
    def _as_int(value):
        return libdevice.float_as_int(value)

    @cuda.jit(device=True)
    def _as_double(bits):
        return libdevice.longlong_as_double(bits)


# ---- helpers ------------------------------------------------------------------------------
@cuda.jit(device=True)
def _order_key(bits):
    return int32(bits ^ ((bits >> int32(31)) & int32(_I32_MAX)))


@cuda.jit(device=True)
def _store_f32(buf, offset, value):
    bits = uint32(_as_int(value))
    for p in range(4):
        buf[offset + p] = np.uint8((bits >> uint32(8 * p)) & uint32(0xFF))


@cuda.jit(device=True)
def _load_f32(buf, offset):
    bits = uint32(0)
    for p in range(4):
        bits |= uint32(buf[offset + p]) << uint32(8 * p)
    return _as_float(int32(bits))


@cuda.jit(device=True)
def _store(out, i, value, accumulate):
    if accumulate:
        out[i] = _fadd(out[i], value)
    else:
        out[i] = value


if SIMULATOR:
    _MASK64 = (1 << 64) - 1

    def _uniform01(key, index):
        """The same draw in Python integers (NumPy's uint64 scalars warn as they wrap)."""
        z = (int(key) + int(index) * _GOLDEN) & _MASK64
        z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
        z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
        r = z ^ (z >> 31)
        return _fmul(np.float32(r >> 40), np.float32(1.0 / (1 << 24)))
else:  # pragma: no cover - needs a GPU
    @cuda.jit(device=True)
    def _mix64(z):
        z = (z ^ (z >> uint64(30))) * uint64(_MIX1)
        z = (z ^ (z >> uint64(27))) * uint64(_MIX2)
        return z ^ (z >> uint64(31))

    @cuda.jit(device=True)
    def _uniform01(key, index):
        r = _mix64(key + uint64(index) * uint64(_GOLDEN))
        return _fmul(np.float32(r >> uint64(40)), np.float32(1.0 / (1 << 24)))


def stream_key(seed: int, counter: int) -> int:
    """The host's ``common.stream_key``, in Python: the key of one encode call."""
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * _MIX1) & mask
        z = ((z ^ (z >> 27)) * _MIX2) & mask
        return z ^ (z >> 31)

    return mix((seed * _GOLDEN + mix((counter + _GOLDEN) & mask)) & mask)


# ---- scales: per-bucket min/max and mean |x| ------------------------------------------------
@cuda.jit(cache=True)
def fill_keys(keys):
    i = cuda.grid(1)
    if i < keys.size:
        keys[i] = int32(_I32_MAX) if i % 2 == 0 else int32(_I32_MIN)


@cuda.jit(device=True)
def _block_range(x, start, stop):
    """The min and max order keys of ``x[start:stop]``, reduced by the whole block (every
    thread calls it; integers: any order gives the same result)."""
    t = cuda.threadIdx.x
    lo = int32(_I32_MAX)
    hi = int32(_I32_MIN)
    for i in range(start + t, stop, THREADS):
        k = _order_key(_as_int(x[i]))
        lo = min(lo, k)
        hi = max(hi, k)
    s_lo = cuda.shared.array(THREADS, int32)
    s_hi = cuda.shared.array(THREADS, int32)
    s_lo[t] = lo
    s_hi[t] = hi
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            s_lo[t] = min(s_lo[t], s_lo[t + step])
            s_hi[t] = max(s_hi[t], s_hi[t + step])
        cuda.syncthreads()
        step //= 2
    return s_lo[0], s_hi[0]


@cuda.jit(cache=True)
def range_keys(x, bucket, chunks, keys):
    """Block j reduces chunk ``j % chunks`` of bucket ``j // chunks`` to its min and max
    order keys and folds them into ``keys``."""
    j = cuda.blockIdx.x
    b = j // chunks
    start = b * bucket + (j - b * chunks) * CHUNK
    stop = min(start + CHUNK, (b + 1) * bucket, x.size)
    lo, hi = _block_range(x, start, stop)
    if cuda.threadIdx.x == 0 and start < stop:
        cuda.atomic.min(keys, 2 * b, lo)
        cuda.atomic.max(keys, 2 * b + 1, hi)


@cuda.jit(device=True)
def _range_of_keys(lo_key, hi_key, status):
    """(ok, lo, hi) of a bucket's min and max order keys; not ok, with the flag set, for
    NaN/inf values and spans beyond float32."""
    if lo_key < _F32_MIN_KEY or hi_key > _F32_MAX_KEY:
        status[ERR_NONFINITE] = 1
        return False, np.float32(0.0), np.float32(0.0)
    lo = _as_float(_order_key(lo_key))
    hi = _as_float(_order_key(hi_key))
    if not math.isfinite(hi - lo):
        status[ERR_RANGE] = 1
        return False, lo, hi
    return True, lo, hi


@cuda.jit(cache=True)
def finish_ranges(keys, lohi, status):
    """(lo, hi) floats of each bucket from its keys; flag NaN/inf and spans beyond float32."""
    b = cuda.grid(1)
    if b >= lohi.size // 2:
        return
    ok, lo, hi = _range_of_keys(keys[2 * b], keys[2 * b + 1], status)
    if ok:
        lohi[2 * b] = lo
        lohi[2 * b + 1] = hi


@cuda.jit(device=True)
def _block_sums(x, start, stop, absolute):
    """(sum of x (|x| with ``absolute``), sum of x^2, whether a value is NaN/inf) of
    ``x[start:stop]`` in float64, reduced by the whole block in a fixed order (every thread
    calls it; thread 0's sums are the block's)."""
    t = cuda.threadIdx.x
    s = 0.0
    q = 0.0
    bad = False
    for i in range(start + t, stop, THREADS):
        v = np.float64(x[i])
        if not math.isfinite(v):
            bad = True
        s += abs(v) if absolute else v
        q += v * v  # exact in float64: a fused multiply-add rounds it the same
    sums = cuda.shared.array(THREADS, np.float64)
    squares = cuda.shared.array(THREADS, np.float64)
    sums[t] = s
    squares[t] = q
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            sums[t] += sums[t + step]
            squares[t] += squares[t + step]
        cuda.syncthreads()
        step //= 2
    return sums[0], squares[0], bad


@cuda.jit(cache=True)
def sum_partials(x, bucket, chunks, absolute, partials, status):
    """Block j sums, in float64 over its chunk (as ``range_keys`` splits buckets), x (|x|
    with ``absolute``) into ``partials[2j]`` and x^2 into ``partials[2j + 1]``; flags NaN/inf."""
    j = cuda.blockIdx.x
    b = j // chunks
    start = b * bucket + (j - b * chunks) * CHUNK
    stop = min(start + CHUNK, (b + 1) * bucket, x.size)
    s, q, bad = _block_sums(x, start, stop, absolute)
    if bad:
        status[ERR_NONFINITE] = 1
    if cuda.threadIdx.x == 0:
        partials[2 * j] = s
        partials[2 * j + 1] = q


@cuda.jit(device=True)
def _bucket_sum(partials, first, chunks, which):
    """A bucket's sum (``which`` 0) or sum of squares (1), from the partials of its
    ``chunks`` chunks from chunk ``first``, in order."""
    s = 0.0
    for c in range(first, first + chunks):
        s += partials[2 * c + which]
    return s


@cuda.jit(cache=True)
def finish_means(partials, chunks, bucket, n, scales):
    """scale = (sum of the bucket's partials, in chunk order) / its length, as float32."""
    b = cuda.grid(1)
    if b >= scales.size:
        return
    count = min(bucket, n - b * bucket)
    scales[b] = np.float32(_bucket_sum(partials, b * chunks, chunks, 0) / count)


@cuda.jit(device=True)
def _scale_of(kind, lo_key, hi_key, partials, first, chunks, count, clip, status):
    """(ok, scale) of a bucket of ``count`` values from its min and max order keys (not ok,
    flagging NaN/inf, as the host's ``max_abs_bits`` does) and, for SCALE_L2 / SCALE_CLIPPED,
    the sum partials of its ``chunks`` chunks from ``first``: max |x| (SCALE_MAX_ABS, bit for
    bit: the larger magnitude of the bucket's min and max), float32(sqrt(sum x^2)) (SCALE_L2;
    ERR_RANGE beyond float32), or TernGrad's min(max |x|, float32(clip * std)) with the
    host's float64 operations (SCALE_CLIPPED)."""
    if lo_key < _F32_MIN_KEY or hi_key > _F32_MAX_KEY:
        status[ERR_NONFINITE] = 1
        return False, np.float32(0.0)
    top = max(_order_key(lo_key) & int32(_I32_MAX), _order_key(hi_key) & int32(_I32_MAX))
    scale = _as_float(top)
    if kind == SCALE_L2:
        scale = np.float32(math.sqrt(_bucket_sum(partials, first, chunks, 1)))
        if not math.isfinite(scale):
            status[ERR_RANGE] = 1
            return False, scale
    elif kind == SCALE_CLIPPED:
        mean = _bucket_sum(partials, first, chunks, 0) / count
        var = _dadd(_bucket_sum(partials, first, chunks, 1) / count, -_dmul(mean, mean))
        if var > 0.0:
            clipped = np.float32(_dmul(clip, math.sqrt(var)))
            if clipped < scale:
                scale = clipped
    return True, scale


@cuda.jit(cache=True)
def finish_scales(kind, keys, partials, chunks, bucket, n, clip, scales, status):
    """Each bucket's scale (``_scale_of``) from its ``range_keys`` and, for SCALE_L2 /
    SCALE_CLIPPED, its ``sum_partials``."""
    b = cuda.grid(1)
    if b >= scales.size:
        return
    ok, scale = _scale_of(kind, keys[2 * b], keys[2 * b + 1], partials, b * chunks, chunks,
                          min(bucket, n - b * bucket), clip, status)
    if ok:
        scales[b] = scale


@cuda.jit(cache=True)
def store_scales(scales, payload):
    """Write the float32 ``scales`` as the payload's first 4 * len bytes."""
    i = cuda.grid(1)
    if i < scales.size:
        _store_f32(payload, 4 * i, scales[i])


@cuda.jit(cache=True)
def load_scales(payload, scales, status):
    """Read the payload's scales into ``scales``; flag non-finite or negative ones (sign,
    pairs of which are not (lo, hi): the caller checks pairs with ``check_pairs``)."""
    i = cuda.grid(1)
    if i < scales.size:
        v = _load_f32(payload, 4 * i)
        scales[i] = v
        if not (math.isfinite(v) and v >= 0):
            status[ERR_BAD_SCALE] = 1


@cuda.jit(device=True)
def _load_pair(payload, at, lohi, b, status):
    """Read the (lo, hi) pair at ``payload[at:]`` into pair ``b`` of ``lohi``; flag one that
    the host's ``check_ranges`` refuses."""
    lo = _load_f32(payload, at)
    hi = _load_f32(payload, at + 4)
    lohi[2 * b] = lo
    lohi[2 * b + 1] = hi
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi and math.isfinite(hi - lo)):
        status[ERR_BAD_SCALE] = 1


@cuda.jit(cache=True)
def load_pairs(payload, lohi, status):
    """Read (lo, hi) pairs; flag any that the host's ``check_ranges`` refuses."""
    b = cuda.grid(1)
    if b < lohi.size // 2:
        _load_pair(payload, 8 * b, lohi, b, status)


# ---- fixed-width codes ----------------------------------------------------------------------
@cuda.jit(device=True)
def _reciprocal(span, levels):
    """The host's ``scaled_reciprocal``: (pre, inv), ``(v * pre) * inv`` ~ v * levels / span."""
    if span < np.float32(_TINY):
        pre = np.float32(_UNTINY)
        return pre, np.float32(levels) / _fmul(span, pre)
    return np.float32(1.0), np.float32(levels) / span


@cuda.jit(device=True)
def _uniform_code(x, i, bucket, lohi, levels, stochastic, key):
    b = i // bucket
    lo = lohi[2 * b]
    hi = lohi[2 * b + 1]
    span = hi - lo
    if span == np.float32(0.0):
        return 0
    pre, inv = _reciprocal(span, levels)
    t = _fmul(_fmul(x[i] - lo, pre), inv)
    if stochastic:
        q = _floor(_fadd(t, _uniform01(key, i)))
    else:
        q = _rint(t)
    return int32(min(q, np.float32(levels)))


@cuda.jit(device=True)
def _scaled_code(kind, x, i, bucket, scales, levels, bits, key):
    """TernGrad's code (0, 1: +scale, 2: -scale; kept with probability |x| / scale) or
    QSGD's (stochastic level of |x| * s / scale, sign bit on top when the level is > 0)."""
    scale = scales[i // bucket]
    if scale == np.float32(0.0):
        return 0
    pre, inv = _reciprocal(scale, levels)
    v = x[i]
    r = _fmul(_fmul(abs(v), pre), inv)
    u = _uniform01(key, i)
    if kind == TERNGRAD:
        if u < r:
            return 2 if v < np.float32(0.0) else 1
        return 0
    low = _floor(r)
    up = _fadd(low, np.float32(1.0)) if u < _fadd(r, -low) else low
    q = int32(min(up, np.float32(levels)))
    if v < np.float32(0.0) and q > 0:
        q |= int32(1) << int32(bits - 1)
    return q


@cuda.jit(device=True)
def _code(kind, x, i, bucket, scales, levels, bits, stochastic, key):
    if kind == UNIFORM:
        return _uniform_code(x, i, bucket, scales, levels, stochastic, key)
    if kind == SIGN:
        return int32(1) if x[i] < np.float32(0.0) else int32(0)  # 1 for x < 0
    return _scaled_code(kind, x, i, bucket, scales, levels, bits, key)


@cuda.jit(cache=True)
def pack_blocks(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos):
    """Thread g builds group word g % GROUPS of full block g // GROUPS and stores its bytes.
    ``kind``: UNIFORM (``scales`` the (lo, hi) pairs, ``levels`` 2**bits - 1), SIGN,
    TERNGRAD (bits 2, levels 1) or QSGD (levels s) codes."""
    g = cuda.grid(1)
    if g < (x.size // BLOCK) * GROUPS:
        _pack_group(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos, g, x, NO_FEEDBACK)


@cuda.jit(device=True)
def _remember(kind, code, x, i, bucket, scales, levels, bits, memory, feedback):
    """The error memory of value ``i`` after it was coded as ``code``: RESIDUAL x - decoded,
    ACCUMULATE x where decoded is 0 (else x * 0), as the host's ``ErrorFeedback.update``."""
    _set_memory(x[i], _value(kind, code, i, bucket, scales, levels, bits), memory, i, feedback)


@cuda.jit(device=True)
def _set_memory(p, v, memory, i, feedback):
    """``memory[i]`` after ``p`` was coded and decodes to ``v``: RESIDUAL p - v, ACCUMULATE p
    where v is 0 (else p * 0), as the host's ``ErrorFeedback.update``."""
    if feedback == RESIDUAL:
        memory[i] = _fadd(p, -v)
    elif v == np.float32(0.0):
        memory[i] = p
    else:
        memory[i] = _fmul(p, np.float32(0.0))


@cuda.jit(device=True)
def _pack_group(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos, g, memory, feedback):
    """pack_blocks' thread ``g``; with ``feedback`` (not NO_FEEDBACK) it also sets the error
    memory of the values it codes (``_remember``)."""
    k = g // GROUPS
    m = g - k * GROUPS
    word = uint64(0)
    for j in range(8):
        i = k * BLOCK + j * GROUPS + m
        c = _code(kind, x, i, bucket, scales, levels, bits, stochastic, key)
        if feedback != NO_FEEDBACK:
            _remember(kind, c, x, i, bucket, scales, levels, bits, memory, feedback)
        word |= uint64(c) << uint64(bits * j)
    base = pos + k * bits * GROUPS + m
    for p in range(bits):
        out[base + p * GROUPS] = np.uint8((word >> uint64(8 * p)) & uint64(0xFF))


@cuda.jit(cache=True)
def pack_tail(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos):
    """The codes after the last full block, MSB-first: thread t writes byte t."""
    t = cuda.grid(1)
    if t < ((x.size % BLOCK) * bits + 7) // 8:
        _pack_tail_byte(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos, t, x, NO_FEEDBACK)


@cuda.jit(device=True)
def _pack_tail_byte(kind, x, bucket, bits, levels, scales, stochastic, key, out, pos, t, memory, feedback):
    """pack_tail's thread ``t``; with ``feedback``, it sets the error memory of each value
    whose first bit is in its byte."""
    start = (x.size // BLOCK) * BLOCK
    count = x.size - start
    byte = 0
    e_cached = -1
    c = 0
    for q in range(8):
        p = 8 * t + q
        e = p // bits
        if e >= count:
            break
        if e != e_cached:
            c = _code(kind, x, start + e, bucket, scales, levels, bits, stochastic, key)
            e_cached = e
        r = p - e * bits
        if r == 0 and feedback != NO_FEEDBACK:
            _remember(kind, c, x, start + e, bucket, scales, levels, bits, memory, feedback)
        byte |= ((c >> (bits - 1 - r)) & 1) << (7 - q)
    out[pos + (start // BLOCK) * bits * GROUPS + t] = np.uint8(byte)


@cuda.jit(device=True)
def _value(kind, code, i, bucket, scales, levels, bits):
    if kind == UNIFORM:
        b = i // bucket
        lo = scales[2 * b]
        hi = scales[2 * b + 1]
        step = (hi - lo) / np.float32(levels)
        v = _fadd(lo, _fmul(np.float32(code), step))
        return hi if hi < v else v  # the host's min(v, hi), ties to v: CUDA's min.f32 picks -0.0 over +0.0
    scale = scales[i // bucket]
    if kind == SIGN:
        return -scale if code else scale
    if kind == TERNGRAD:
        return np.float32(0.0) if code == 0 else (scale if code == 1 else -scale)
    v = _fmul(np.float32(code & ((1 << (bits - 1)) - 1)), scale / np.float32(levels))  # QSGD
    return -v if code >> (bits - 1) else v


@cuda.jit(device=True)
def _use(kind, code, i, bucket, scales, levels, bits, out, op, status):
    """Write (WRITE) or add (ADD) code ``code``'s value at ``out[i]``, or (CHECK) flag
    ERR_BAD_CODE for a code the format cannot hold (TernGrad's 3, QSGD levels above s)."""
    if op == CHECK:
        if (kind == TERNGRAD and code == 3) or (kind == QSGD and code & ((1 << (bits - 1)) - 1) > levels):
            status[ERR_BAD_CODE] = 1
    else:
        _store(out, i, _value(kind, code, i, bucket, scales, levels, bits), op == ADD)


@cuda.jit(cache=True)
def unpack_blocks(kind, src, pos, bits, levels, bucket, scales, out, n, op, status):
    """Inverse of pack_blocks over the ``n`` codes' full blocks: ``op`` WRITE or ADD their
    values to ``out``, or CHECK them (``out`` is not touched: any float32 array will do)."""
    g = cuda.grid(1)
    if g < (n // BLOCK) * GROUPS:
        _unpack_group(kind, src, pos, bits, levels, bucket, scales, out, op, status, g)


@cuda.jit(device=True)
def _unpack_group(kind, src, pos, bits, levels, bucket, scales, out, op, status, g):
    """unpack_blocks' thread ``g``."""
    k = g // GROUPS
    m = g - k * GROUPS
    base = pos + k * bits * GROUPS + m
    word = uint64(0)
    for p in range(bits):
        word |= uint64(src[base + p * GROUPS]) << uint64(8 * p)
    mask = uint64((1 << bits) - 1)
    for j in range(8):
        code = int32((word >> uint64(bits * j)) & mask)
        _use(kind, code, k * BLOCK + j * GROUPS + m, bucket, scales, levels, bits, out, op, status)


@cuda.jit(cache=True)
def unpack_tail(kind, src, pos, bits, levels, bucket, scales, out, n, op, status):
    """The codes after the last full block: thread e reads code e of the MSB-first stream."""
    e = cuda.grid(1)
    if e < n % BLOCK:
        _unpack_tail_code(kind, src, pos, bits, levels, bucket, scales, out, n, op, status, e)


@cuda.jit(device=True)
def _unpack_tail_code(kind, src, pos, bits, levels, bucket, scales, out, n, op, status, e):
    """unpack_tail's thread ``e``."""
    start = (n // BLOCK) * BLOCK
    bit = e * bits
    pos += (start // BLOCK) * bits * GROUPS
    code = 0
    for r in range(bits):
        p = bit + r
        code = (code << 1) | ((int32(src[pos + (p >> 3)]) >> (7 - (p & 7))) & 1)
    _use(kind, code, start + e, bucket, scales, levels, bits, out, op, status)


# ---- float payloads -----------------------------------------------------------------------
@cuda.jit(cache=True)
def store_float32(x, out, pos, status):
    """out[pos + 4i ..] = the bytes of x[i]; flag NaN/inf."""
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        if not math.isfinite(v):
            status[ERR_NONFINITE] = 1
        _store_f32(out, pos + 4 * i, v)


@cuda.jit(cache=True)
def load_float32(src, pos, out, accumulate):
    i = cuda.grid(1)
    if i < out.size:
        _store(out, i, _load_f32(src, pos + 4 * i), accumulate)


@cuda.jit(cache=True)
def store_float16(x, out, pos, status):
    """The host's ``half.narrow``, bit for bit: round to nearest even; flag values whose
    half is not finite (ERR_RANGE; ERR_NONFINITE too for NaN/inf input)."""
    i = cuda.grid(1)
    if i < x.size:
        _store_half(out, pos + 2 * i, _narrow_half(x[i], status))


@cuda.jit(device=True)
def _narrow_half(v, status):
    """The half (as uint32) of float32 ``v``, as the host's ``half.narrow``; flags as
    ``store_float16``."""
    f = uint32(_as_int(v))
    sign = (f >> uint32(16)) & uint32(0x8000)
    f &= uint32(0x7FFFFFFF)
    if f >= uint32(0x477FF000):
        if f >= uint32(0x7F800000):
            status[ERR_NONFINITE] = 1
        status[ERR_RANGE] = 1
        if f > uint32(0x7F800000):
            h = uint32(0x7C00) + ((f & uint32(0x7FFFFF)) >> uint32(13))
            if h == uint32(0x7C00):
                h += uint32(1)
        else:
            h = uint32(0x7C00)
    elif f >= uint32(0x38800000):
        h = (f - uint32(0x38000000) + uint32(0xFFF) + ((f >> uint32(13)) & uint32(1))) >> uint32(13)
    elif f >= uint32(0x33000001):
        e = f >> uint32(23)
        m = (f & uint32(0x7FFFFF)) | uint32(0x800000)
        shift = uint32(126) - e
        h = m >> shift
        rest = m & ((uint32(1) << shift) - uint32(1))
        halfway = uint32(1) << (shift - uint32(1))
        if rest > halfway or (rest == halfway and (h & uint32(1)) == uint32(1)):
            h += uint32(1)
    else:
        h = uint32(0)
    return h | sign


@cuda.jit(device=True)
def _widen_half(h):
    """The float32 of the half ``h`` (as uint32), exactly: the host's table of every half
    (``_load_half``) computed, for an encode's error memory, which has no table."""
    e = (h >> uint32(10)) & uint32(0x1F)
    m = h & uint32(0x3FF)
    if e == uint32(0):  # zero or subnormal: m * 2^-24, exact in float32
        v = _fmul(np.float32(m), np.float32(5.9604644775390625e-08))
        return -v if h & uint32(0x8000) else v
    if e == uint32(0x1F):
        bits = uint32(0x7F800000) | (m << uint32(13))
    else:
        bits = ((e + uint32(112)) << uint32(23)) | (m << uint32(13))
    v = _as_float(int32(bits))
    return -v if h & uint32(0x8000) else v


@cuda.jit(device=True)
def _store_half(out, pos, h):
    out[pos] = np.uint8(h & uint32(0xFF))
    out[pos + 1] = np.uint8(h >> uint32(8))


@cuda.jit(device=True)
def _load_half(src, pos, halves):
    """The float32 of the half at byte ``pos`` of ``src``, from the host's table of all halves."""
    return halves[int32(src[pos]) | (int32(src[pos + 1]) << 8)]


@cuda.jit(cache=True)
def load_float16(src, pos, table, out, accumulate):
    """out[i] = (or +=) the float32 of half i, from the host's table of all halves."""
    i = cuda.grid(1)
    if i < out.size:
        _store(out, i, _load_half(src, pos + 2 * i, table), accumulate)


# ---- a frame's pieces by table: a fixed number of launches per frame ------------------------
#: The piece table's kinds beside the codes' (UNIFORM, SIGN, TERNGRAD, QSGD): float32
#: values, 4 bytes each, and half-precision ones (fp16), 2 bytes each (fp32's and fp16's
#: ``kind_code`` in ``mpigrad.codecs.parts``, literals as the codes' are).
FLOAT32, FLOAT16 = 4, 5
#: Error feedback's modes in the table (``mpigrad.feedback``): none, e = p - decoded, e = p
#: where decoded is 0.
NO_FEEDBACK, RESIDUAL, ACCUMULATE = 0, 1, 2
#: The piece table's columns (int64, a row per piece): its kind; its offset and size in the
#: flat values; bits, levels, bucket, stochastic rounding and its RNG key (two 32-bit
#: halves) of a bucketed piece (UNIFORM, SIGN, TERNGRAD, QSGD); the byte position of its
#: codes (FLOAT32: its values) in the frame; the index of its first bucket among the
#: frame's (its scales in ``lohi``: a UNIFORM piece's (lo, hi) pairs, the others' one scale
#: per bucket, from the same place); its error feedback (an encode's) and the bits of its
#: float32 decay; the ``finish_scales`` kind of a TERNGRAD or QSGD piece and the bits of
#: its float64 clip.
(P_KIND, P_OFFSET, P_SIZE, P_BITS, P_LEVELS, P_BUCKET, P_STOCHASTIC, P_KEY_HI, P_KEY_LO, P_CODES,
 P_PAIRS, P_FEEDBACK, P_DECAY, P_SCALE, P_CLIP) = range(15)
PIECE_COLUMNS = 15
#: The bucket table's columns (int64, a row per bucket of the frame's bucketed pieces): its
#: first chunk and chunk count in the chunk table (encode), the byte position of its scale
#: (pair), its piece's row.
B_FIRST, B_CHUNKS, B_AT, B_PIECE = range(4)
BUCKET_COLUMNS = 4
#: The chunk table's columns (an encode's, a row per chunk): its values' start and stop in
#: the flat values, its piece's row.
C_START, C_STOP, C_PIECE = range(3)
CHUNK_COLUMNS = 3


@cuda.jit(device=True)
def _piece_of(firsts, i):
    """The row e with ``firsts[e] <= i < firsts[e + 1]`` (``firsts`` ascending from 0)."""
    lo = 0
    hi = firsts.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if firsts[mid] <= i:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _piece_key(pieces, row):
    return (uint64(pieces[row + P_KEY_HI]) << uint64(32)) | uint64(pieces[row + P_KEY_LO])


@cuda.jit(device=True)
def _compensate(g, memory, p, start, stop, decay_bits):
    """This thread's values of ``p[start:stop]`` = g + e (decay 1) or e * decay + g, as the
    host's ``ErrorFeedback.compensate`` (the same thread reads them in ``_block_range``)."""
    decay = _as_float(int32(decay_bits))
    for i in range(start + cuda.threadIdx.x, stop, THREADS):
        if decay == np.float32(1.0):
            p[i] = _fadd(g[i], memory[i])
        else:
            p[i] = _fadd(_fmul(memory[i], decay), g[i])


@cuda.jit(device=True)
def _sums_needed(pieces, row):
    """Whether the piece of table row ``row`` takes its scales from sums (SIGN's mean |x|,
    TernGrad's clip, QSGD's l2 norm), and whether of |x|."""
    kind = pieces[row + P_KIND]
    if kind == SIGN:
        return True, True
    if kind == TERNGRAD or kind == QSGD:
        return pieces[row + P_SCALE] != SCALE_MAX_ABS, False
    return False, False


@cuda.jit(cache=True)
def table_range_keys(g, memory, compensated, chunks, pieces, keys, partials):
    """Block j reduces chunk j of the frame (the flat values ``[start, stop)`` of its chunk
    row, never empty) to its min and max order keys, ``keys[2j]`` and ``keys[2j + 1]``, and
    where its piece's scales need them, to its float64 sums, ``partials[2j]`` (x, or |x|)
    and ``partials[2j + 1]`` (x^2), as ``sum_partials``: of ``g``, or, where its piece has
    error feedback, of ``compensated``, which it writes first (g compensated with the error
    ``memory``)."""
    j = cuda.blockIdx.x
    start = chunks[j * CHUNK_COLUMNS + C_START]
    stop = chunks[j * CHUNK_COLUMNS + C_STOP]
    row = chunks[j * CHUNK_COLUMNS + C_PIECE] * PIECE_COLUMNS
    x = g
    if pieces[row + P_FEEDBACK] != NO_FEEDBACK:
        _compensate(g, memory, compensated, start, stop, pieces[row + P_DECAY])
        x = compensated
    lo, hi = _block_range(x, start, stop)
    if cuda.threadIdx.x == 0:
        keys[2 * j] = lo
        keys[2 * j + 1] = hi
    needed, absolute = _sums_needed(pieces, row)
    if needed:  # the same for the whole block: every thread reduces
        s, q, _ = _block_sums(x, start, stop, absolute)  # NaN/inf: flagged from the keys
        if cuda.threadIdx.x == 0:
            partials[2 * j] = s
            partials[2 * j + 1] = q


@cuda.jit(cache=True)
def table_finish_ranges(keys, partials, buckets, pieces, lohi, out, status):
    """Thread b: bucket b's scales from its chunks' keys (and sums) into ``lohi`` and, as
    float32 bytes, into the frame ``out`` at their position: a UNIFORM bucket's (lo, hi),
    flagged as ``finish_ranges``; a SIGN bucket's mean |x| (``finish_means``; NaN/inf
    flagged from the keys); a TERNGRAD or QSGD bucket's scale (``_scale_of``)."""
    b = cuda.grid(1)
    if b >= buckets.size // BUCKET_COLUMNS:
        return
    row = b * BUCKET_COLUMNS
    first = buckets[row + B_FIRST]
    chunks = buckets[row + B_CHUNKS]
    lo_key = int32(_I32_MAX)
    hi_key = int32(_I32_MIN)
    for c in range(first, first + chunks):
        lo_key = min(lo_key, keys[2 * c])
        hi_key = max(hi_key, keys[2 * c + 1])
    at = buckets[row + B_AT]
    piece = buckets[row + B_PIECE] * PIECE_COLUMNS
    kind = pieces[piece + P_KIND]
    if kind == UNIFORM:
        ok, lo, hi = _range_of_keys(lo_key, hi_key, status)
        if ok:
            lohi[2 * b] = lo
            lohi[2 * b + 1] = hi
            _store_f32(out, at, lo)
            _store_f32(out, at + 4, hi)
        return
    local = b - pieces[piece + P_PAIRS]
    bucket = pieces[piece + P_BUCKET]
    count = min(bucket, pieces[piece + P_SIZE] - local * bucket)
    if kind == SIGN:
        if lo_key < _F32_MIN_KEY or hi_key > _F32_MAX_KEY:
            status[ERR_NONFINITE] = 1
            return
        ok = True
        scale = np.float32(_bucket_sum(partials, first, chunks, 0) / count)
    else:
        clip = _as_double(pieces[piece + P_CLIP])
        ok, scale = _scale_of(pieces[piece + P_SCALE], lo_key, hi_key, partials, first, chunks, count, clip,
                              status)
    if ok:
        lohi[2 * pieces[piece + P_PAIRS] + local] = scale
        _store_f32(out, at, scale)


@cuda.jit(cache=True)
def table_pack(g, memory, compensated, firsts, pieces, lohi, out, status):
    """Thread i works for piece e (``firsts[e] <= i < firsts[e + 1]``) of the frame: a
    bucketed piece's thread j is pack_blocks' thread j, then pack_tail's, coding ``g`` or,
    with error feedback, ``compensated`` (``table_range_keys`` wrote it) and setting the
    error ``memory`` of what it codes; a FLOAT32 piece's stores value j of ``g`` (flagging
    NaN/inf, as ``store_float32``), a FLOAT16 piece's its half (as ``store_float16``), each,
    with error feedback, of g compensated with its memory (not written to ``compensated``),
    then setting that memory."""
    i = cuda.grid(1)
    if i >= firsts[firsts.size - 1]:
        return
    e = _piece_of(firsts, i)
    j = i - firsts[e]
    row = e * PIECE_COLUMNS
    offset = pieces[row + P_OFFSET]
    stop = offset + pieces[row + P_SIZE]
    feedback = pieces[row + P_FEEDBACK]
    xe = compensated[offset:stop] if feedback != NO_FEEDBACK else g[offset:stop]
    me = memory[offset:stop]
    at = pieces[row + P_CODES]
    kind = pieces[row + P_KIND]
    if kind == FLOAT32 or kind == FLOAT16:
        v = g[offset + j]
        if feedback != NO_FEEDBACK:  # compensated here: a float piece has no range pass
            decay = _as_float(int32(pieces[row + P_DECAY]))
            v = _fadd(v, me[j]) if decay == np.float32(1.0) else _fadd(_fmul(me[j], decay), v)
        if kind == FLOAT32:
            if not math.isfinite(v):
                status[ERR_NONFINITE] = 1
            _store_f32(out, at + 4 * j, v)
            decoded = v
        else:
            h = _narrow_half(v, status)
            _store_half(out, at + 2 * j, h)
            decoded = _widen_half(h)
        if feedback != NO_FEEDBACK:
            _set_memory(v, decoded, me, j, feedback)
        return
    bits = pieces[row + P_BITS]
    levels = pieces[row + P_LEVELS]
    bucket = pieces[row + P_BUCKET]
    stochastic = pieces[row + P_STOCHASTIC] != 0
    key = _piece_key(pieces, row)
    scales = lohi[2 * pieces[row + P_PAIRS]:]
    groups = (xe.size // BLOCK) * GROUPS
    if j < groups:
        _pack_group(kind, xe, bucket, bits, levels, scales, stochastic, key, out, at, j, me, feedback)
    else:
        _pack_tail_byte(kind, xe, bucket, bits, levels, scales, stochastic, key, out, at, j - groups, me,
                        feedback)


@cuda.jit(cache=True)
def table_load_pairs(src, buckets, pieces, lohi, status):
    """Thread b reads bucket b's scales from the frame ``src`` into ``lohi`` where
    ``table_finish_ranges`` puts them: a UNIFORM bucket's (lo, hi) pair (``load_pairs``),
    another's scale (``load_scales``)."""
    b = cuda.grid(1)
    if b >= buckets.size // BUCKET_COLUMNS:
        return
    at = buckets[b * BUCKET_COLUMNS + B_AT]
    piece = buckets[b * BUCKET_COLUMNS + B_PIECE] * PIECE_COLUMNS
    if pieces[piece + P_KIND] == UNIFORM:
        _load_pair(src, at, lohi, b, status)
        return
    first = pieces[piece + P_PAIRS]  # the piece's first bucket: its scales from lohi[2 * first]
    v = _load_f32(src, at)
    lohi[2 * first + (b - first)] = v
    if not (math.isfinite(v) and v >= 0):
        status[ERR_BAD_SCALE] = 1


@cuda.jit(cache=True)
def table_unpack(src, firsts, pieces, lohi, halves, out, op, status):
    """Thread i works for piece e of the frame ``src`` (as ``table_pack``), writing (WRITE)
    or adding (ADD) into ``out[offset:offset + size]``: a bucketed piece's thread j is
    unpack_blocks' thread j, then unpack_tail's (flagging, as CHECK does, a TernGrad or
    QSGD code the format cannot hold); a FLOAT32 piece's loads value j, a FLOAT16
    piece's half j (``halves``: the host's table of every half's float32)."""
    i = cuda.grid(1)
    if i >= firsts[firsts.size - 1]:
        return
    e = _piece_of(firsts, i)
    j = i - firsts[e]
    row = e * PIECE_COLUMNS
    offset = pieces[row + P_OFFSET]
    n = pieces[row + P_SIZE]
    oute = out[offset:offset + n]
    at = pieces[row + P_CODES]
    if pieces[row + P_KIND] == FLOAT32:
        _store(oute, j, _load_f32(src, at + 4 * j), op == ADD)
        return
    if pieces[row + P_KIND] == FLOAT16:
        _store(oute, j, _load_half(src, at + 2 * j, halves), op == ADD)
        return
    kind = pieces[row + P_KIND]
    bits = pieces[row + P_BITS]
    levels = pieces[row + P_LEVELS]
    bucket = pieces[row + P_BUCKET]
    scales = lohi[2 * pieces[row + P_PAIRS]:]
    groups = (n // BLOCK) * GROUPS
    # Codes the format forbids (TernGrad's 3; QSGD levels above s, where s leaves room for
    # them: the twins' _codes_may_be_bad), flagged in a pass of their own before the values.
    check = kind == TERNGRAD or (kind == QSGD and levels < (1 << (bits - 1)) - 1)
    if j < groups:
        if check:
            _unpack_group(kind, src, at, bits, levels, bucket, scales, oute, CHECK, status, j)
        _unpack_group(kind, src, at, bits, levels, bucket, scales, oute, op, status, j)
    else:
        if check:
            _unpack_tail_code(kind, src, at, bits, levels, bucket, scales, oute, n, CHECK, status, j - groups)
        _unpack_tail_code(kind, src, at, bits, levels, bucket, scales, oute, n, op, status, j - groups)


def blocks(n: int, threads: int = THREADS) -> int:
    """Blocks of ``threads`` covering ``n`` threads (at least one)."""
    return max(1, -(-n // threads))
