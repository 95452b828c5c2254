"""NumPy twin of the ``terngrad`` codec."""

import numpy as np

from ..checks import bucket_layout, raise_status
from ..kernels import common
from ..terngrad import BITS, parse_payload
from . import numpy_kernels as nk
from .qsgd import bucket_max_abs, check_scales


class TernGradTwin:
    """``terngrad``'s payload methods in NumPy: its kernels' bytes (``reference.twin_of``; named by
    ``mpigrad.codecs.parts``)."""

    def encode_payload(self, codec, x, payload):
        n = x.size
        bucket, nb = bucket_layout(codec.bucket_size or 0, n)
        scales = bucket_max_abs(codec.codec_id, x, bucket)
        if codec.clip > 0 and n:
            x64 = x.astype(np.float64)
            counts = np.diff(np.append(nk.bucket_starts(n, bucket), n))
            mean = nk.lane_sums(x64, bucket) / counts
            var = nk.lane_sums(x64 * x64, bucket) / counts - mean * mean
            clipped = (codec.clip * np.sqrt(np.maximum(var, 0.0))).astype(np.float32)
            scales = np.where(var > 0, np.minimum(scales, clipped), scales).astype(np.float32)
        seed, counter = codec._next_stream()
        zero = scales == 0
        pre, inv = nk.scaled_reciprocal(np.where(zero, np.float32(1.0), scales), 1)
        r = (np.abs(x) * nk.per_element(pre, n, bucket)) * nk.per_element(inv, n, bucket)
        keep = nk.uniform01(nk.stream_key(seed, counter), 0, n) < r
        keep &= ~nk.per_element(zero, n, bucket)
        codes = np.where(keep, np.where(x < 0, 2, 1), 0).astype(np.uint8)
        packed = nk.pack_codes(codes, BITS)
        payload[:4 * nb] = scales.view(np.uint8)
        payload[4 * nb:4 * nb + packed.size] = packed
        return BITS, 0, codec.bucket_size or 0, 0, 4 * nb + packed.size

    def decode_payload(self, codec, header, payload, out):
        bucket, scales, codes = parse_payload(header, payload)
        check_scales(codec.codec_id, scales)
        c = nk.unpack_codes(codes, header.n, BITS)
        scale = nk.per_element(scales, header.n, bucket)
        out[:] = np.where(c == 0, np.float32(0.0), np.where(c == 1, scale, -scale))
        if header.n and c.max() > 2:
            raise_status(codec.codec_id, common.ERR_BAD_CODE)
