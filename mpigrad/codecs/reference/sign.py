"""NumPy twin of the ``sign`` codec."""

import numpy as np

from ..checks import bucket_layout
from ..sign import parse_payload
from . import numpy_kernels as nk
from .qsgd import bucket_max_abs, check_scales


class SignTwin:
    """``sign``'s payload methods in NumPy: its kernels' bytes (``reference.twin_of``; named by
    ``mpigrad.codecs.parts``)."""

    def encode_payload(self, codec, x, payload):
        n = x.size
        bucket, nb = bucket_layout(codec.bucket_size or 0, n)
        bucket_max_abs(codec.codec_id, x, bucket)  # raises on NaN / infinity
        counts = np.diff(np.append(nk.bucket_starts(n, bucket), n))
        scales = (nk.lane_sums(np.abs(x.astype(np.float64)), bucket) / counts).astype(np.float32)
        packed = nk.pack_codes((x < 0).astype(np.uint8), 1)
        payload[:4 * nb] = scales.view(np.uint8)
        payload[4 * nb:4 * nb + packed.size] = packed
        return 1, 0, codec.bucket_size or 0, 0, 4 * nb + packed.size

    def decode_payload(self, codec, header, payload, out):
        bucket, scales, codes = parse_payload(header, payload)
        check_scales(codec.codec_id, scales)
        scale = nk.per_element(scales, header.n, bucket)
        out[:] = np.where(nk.unpack_codes(codes, header.n, 1) == 1, -scale, scale)
