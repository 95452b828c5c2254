"""NumPy twin of the ``uniform`` codec."""

import numpy as np

from ..base import non_finite_error
from ..checks import bucket_layout, raise_status
from ..kernels.common import ERR_BAD_SCALE, ERR_RANGE
from ..uniform import parse_payload
from . import numpy_kernels as nk

_MIN_KEY, _MAX_KEY = -0x7F800000, 0x7F7FFFFF


class UniformTwin:
    """``uniform``'s payload methods in NumPy: its kernels' bytes (``reference.twin_of``; named by
    ``mpigrad.codecs.parts``)."""

    def encode_payload(self, codec, x, payload):
        n = x.size
        bucket, nb = bucket_layout(codec.bucket_size or 0, n)
        levels = (1 << codec.bits) - 1
        lohi = np.zeros((nb, 2), np.float32)
        if n:
            keys = nk.order_keys(x)
            starts = nk.bucket_starts(n, bucket)
            low_keys = np.minimum.reduceat(keys, starts)
            high_keys = np.maximum.reduceat(keys, starts)
            if low_keys.min() < _MIN_KEY or high_keys.max() > _MAX_KEY:
                raise non_finite_error(codec.codec_id)
            lohi[:, 0] = nk.key_floats(low_keys)
            lohi[:, 1] = nk.key_floats(high_keys)
        with np.errstate(over="ignore"):
            span = lohi[:, 1] - lohi[:, 0]
        if not np.isfinite(span).all():
            raise_status(codec.codec_id, ERR_RANGE)
        seed, counter = codec._next_stream() if codec.stochastic else (0, 0)
        flat = span == 0
        pre, inv = nk.scaled_reciprocal(np.where(flat, np.float32(1.0), span), levels)
        lo = nk.per_element(lohi[:, 0], n, bucket)
        t = ((x - lo) * nk.per_element(pre, n, bucket)) * nk.per_element(inv, n, bucket)
        if codec.stochastic:
            q = np.floor(t + nk.uniform01(nk.stream_key(seed, counter), 0, n))
        else:
            q = np.rint(t)
        q = np.minimum(q, np.float32(levels))
        codes = np.where(nk.per_element(flat, n, bucket), 0, q).astype(np.uint8)
        packed = nk.pack_codes(codes, codec.bits)
        payload[:8 * nb] = lohi.view(np.uint8).ravel()
        payload[8 * nb:8 * nb + packed.size] = packed
        return (codec.bits, int(codec.stochastic), codec.bucket_size or 0, 0,
                8 * nb + packed.size)

    def decode_payload(self, codec, header, payload, out):
        bucket, lohi, codes = parse_payload(header, payload)
        lo, hi = lohi[0::2], lohi[1::2]
        with np.errstate(over="ignore", invalid="ignore"):
            span = hi - lo
            ok = np.isfinite(lo) & np.isfinite(hi) & (lo <= hi) & np.isfinite(span)
        if not ok.all():
            raise_status(codec.codec_id, ERR_BAD_SCALE)
        step = span / np.float32((1 << header.bits) - 1)
        q = nk.unpack_codes(codes, header.n, header.bits).astype(np.float32)
        n = header.n
        out[:] = np.minimum(nk.per_element(lo, n, bucket) + q * nk.per_element(step, n, bucket),
                            nk.per_element(hi, n, bucket))
