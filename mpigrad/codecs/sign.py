"""``sign``: one bit per element and a float32 scale (mean |g|), for use with error feedback.

Header: bits 1; param_a: bucket size (0: one bucket). Payload: ``nb`` float32 scales,
then ceil(n / 8) bytes of sign bits, 1 for x < 0 (layout kernels.common.pack_block).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import CodecError, FusedCodec, Header, register_codec
from .checks import bucket_layout, check_bucket_size, expect_payload, raise_status
from .kernels import qsgd as qsgd_kernels, sign as kernels


@register_codec
class Sign(FusedCodec):
    """g' = scale * sgn(g) with scale = mean |g| per bucket (1-bit SGD / EF-signSGD scaling).

    sgn(0) = +1: zeros (and -0.0) decode to +scale; error feedback carries the difference.
    ``bucket_size``: None (one scale per tensor) or a bucket length.
    """

    codec_id = "sign"
    exact_size = True
    nominal_bits = 1
    wire_id = 6

    def __init__(self, *, bucket_size: int | None = None, checksum: bool = False):
        super().__init__(checksum=checksum)
        self.bucket_size = check_bucket_size(self.codec_id, bucket_size)

    def _config(self) -> dict[str, Any]:
        return {"bucket_size": self.bucket_size}

    def max_payload_size(self, n: int) -> int:
        return payload_size(n, self.bucket_size or 0)

    def _encode_payload(self, x, payload):
        bucket, nb = bucket_layout(self.bucket_size or 0, x.size)
        scales = payload[:4 * nb].view(np.float32)
        raise_status(self.codec_id, kernels.bucket_scales(x, x.view(np.int32), bucket, scales))
        kernels.encode(x, payload[4 * nb:])
        return 1, 0, self.bucket_size or 0, 0, payload_size(x.size, self.bucket_size or 0)

    def _check_payload(self, header: Header, payload):
        parse_payload(header, payload)

    def _decode(self, header: Header, payload, out, accumulate: bool) -> None:
        bucket, scales, codes = parse_payload(header, payload)
        raise_status(self.codec_id, qsgd_kernels.check_scales(scales))
        kernels.decode(codes, bucket, scales, out, accumulate)


def payload_size(n: int, param_a: int) -> int:
    _, nb = bucket_layout(param_a, n)
    return 4 * nb + (n + 7) // 8


def parse_payload(header: Header, payload: np.ndarray):
    if header.bits != 1 or header.flags or header.param_b:
        raise CodecError("sign: corrupted header (bits, flags or parameters)")
    bucket, nb = bucket_layout(header.param_a, header.n)
    expect_payload("sign", header.payload_len, payload_size(header.n, header.param_a),
                   f"{header.n} sign bits in {nb} buckets")
    return bucket, payload[:4 * nb].view(np.float32), payload[4 * nb:]
