"""NumPy twin of the ``qsgd`` codec (fixed and Elias coding)."""

import numpy as np

from ..base import non_finite_error
from ..checks import bucket_layout, raise_status
from ..kernels import common
from ..qsgd import FLAG_ELIAS, FLAG_L2, parse_payload
from . import numpy_kernels as nk

_F32_MAX_BITS = 0x7F7FFFFF


def bucket_max_abs(codec_id, x, bucket):
    """Per-bucket max |x| through the bit patterns, as the kernels take it."""
    if not x.size:
        return np.zeros(0, np.float32)
    top = np.maximum.reduceat(x.view(np.int32) & np.int32(0x7FFFFFFF), nk.bucket_starts(x.size, bucket))
    if top.max() > _F32_MAX_BITS:
        raise non_finite_error(codec_id)
    return top.astype(np.int32).view(np.float32)


def check_scales(codec_id, scales):
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise_status(codec_id, common.ERR_BAD_SCALE)


class QSGDTwin:
    """``qsgd``'s payload methods in NumPy: its kernels' bytes (``reference.twin_of``; named by
    ``mpigrad.codecs.parts``)."""

    def encode_payload(self, codec, x, payload):
        n = x.size
        bucket, nb = bucket_layout(codec.bucket_size or 0, n)
        scales = bucket_max_abs(codec.codec_id, x, bucket)
        if codec.norm == "l2":
            x64 = x.astype(np.float64)
            with np.errstate(over="ignore"):
                scales = np.sqrt(nk.lane_sums(x64 * x64, bucket)).astype(np.float32)
            if not np.isfinite(scales).all():
                raise_status(codec.codec_id, common.ERR_RANGE)
        seed, counter = codec._next_stream()
        s = codec.levels
        zero = scales == 0
        pre, inv = nk.scaled_reciprocal(np.where(zero, np.float32(1.0), scales), s)
        r = (np.abs(x) * nk.per_element(pre, n, bucket)) * nk.per_element(inv, n, bucket)
        low = np.floor(r)
        u = nk.uniform01(nk.stream_key(seed, counter), 0, n)
        up = np.where(u < r - low, low + np.float32(1.0), low)
        level = np.where(nk.per_element(zero, n, bucket), 0, np.minimum(up, np.float32(s)))
        level = level.astype(np.int64)
        payload[:4 * nb] = scales.view(np.uint8)
        flags = FLAG_L2 if codec.norm == "l2" else 0
        if codec.coding == "elias":
            where = np.flatnonzero(level)
            gap_values, gap_widths = nk.omega_fields(np.diff(where, prepend=-1))
            level_values, level_widths = nk.omega_fields(level[where])
            signs = (x[where] < 0).astype(np.uint64)[:, None]
            values = np.concatenate([gap_values, signs, level_values], axis=1)
            widths = np.concatenate([gap_widths, np.ones_like(signs, np.int64), level_widths], axis=1)
            stream = nk.msb_pack(values, widths)
            payload[4 * nb:4 * nb + 8] = np.array([where.size], "<u8").view(np.uint8)
            payload[4 * nb + 8:4 * nb + 8 + stream.size] = stream
            return codec.bits, flags | FLAG_ELIAS, codec.bucket_size or 0, s, 4 * nb + 8 + stream.size
        sign_bit = 1 << (codec.bits - 1)
        codes = (level | np.where((x < 0) & (level > 0), sign_bit, 0)).astype(np.uint8)
        packed = nk.pack_codes(codes, codec.bits)
        payload[4 * nb:4 * nb + packed.size] = packed
        return codec.bits, flags, codec.bucket_size or 0, s, 4 * nb + packed.size

    def decode_payload(self, codec, header, payload, out):
        bucket, scales, rest, nonzero = parse_payload(header, payload)
        check_scales(codec.codec_id, scales)
        s = header.param_b
        step = scales / np.float32(s)
        if header.flags & FLAG_ELIAS:
            _decode_elias(codec.codec_id, rest, nonzero, bucket, s, step, out)
            return
        codes = nk.unpack_codes(rest, header.n, header.bits)
        sign_bit = np.uint8(1 << (header.bits - 1))
        level = codes & np.uint8(sign_bit - 1)
        v = level.astype(np.float32) * nk.per_element(step, header.n, bucket)
        out[:] = np.where(codes & sign_bit, -v, v)
        if header.n and level.max() > s:
            raise_status(codec.codec_id, common.ERR_BAD_CODE)


def _decode_elias(codec_id, stream, nonzero, bucket, s, step, out):
    """Walk the gap / sign / level stream bit by bit (plain Python: the twin favours clarity)."""
    bits = np.unpackbits(stream).tolist()
    end = len(bits)
    pos = 0

    def omega():
        nonlocal pos
        v = 1
        while True:
            if pos >= end:
                raise_status(codec_id, common.ERR_OVERRUN)
            if bits[pos] == 0:
                pos += 1
                return v
            if v > common.OMEGA_MAX_GROUP:
                raise_status(codec_id, common.ERR_BAD_CODE)
            if pos + v + 1 > end:
                raise_status(codec_id, common.ERR_OVERRUN)
            group = bits[pos:pos + v + 1]
            pos += v + 1
            v = int("".join(map(str, group)), 2)

    out[:] = 0
    index = -1
    for _ in range(nonzero):
        gap = omega()
        if gap > out.size - 1 - index:
            raise_status(codec_id, common.ERR_BAD_CODE)
        index += gap
        if pos >= end:
            raise_status(codec_id, common.ERR_OVERRUN)
        negative = bits[pos]
        pos += 1
        q = omega()
        if q > s:
            raise_status(codec_id, common.ERR_BAD_CODE)
        v = np.float32(q) * step[index // bucket]
        out[index] = -v if negative else v
    if end - pos >= 8 or any(bits[pos:]):
        raise_status(codec_id, common.ERR_TRAILING)
