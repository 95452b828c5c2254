"""``terngrad``: TernGrad's ternary codes (Wen et al., 2017), 2 bits per element.

Header: bits 2; param_a: bucket size (0: one bucket). Payload: ``nb`` float32 scales,
then ceil(n / 4) bytes of 2-bit codes 0 / 1 (+scale) / 2 (-scale) (layout
kernels.common.pack_block).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import CodecError, FusedCodec, Header, register_codec
from .checks import bucket_layout, check_bucket_size, expect_payload, raise_status
from .kernels import qsgd as qsgd_kernels, terngrad as kernels

BITS = kernels.BITS


@register_codec
class TernGrad(FusedCodec):
    """g' = scale * sign(g) * Bernoulli(|g| / scale), scale = min(max|g|, clip * std(g)).

    ``clip`` (default 2.5, the paper's 2.5 sigma; 0 disables clipping). When every value
    of a bucket is equal (std 0) the scale is max|g|, so constant input survives.
    ``bucket_size``: None (per tensor, the paper) or a bucket length.
    """

    codec_id = "terngrad"
    exact_size = True
    nominal_bits = 2
    wire_id = 5
    stochastic = True

    def __init__(self, *, clip: float = 2.5, bucket_size: int | None = None, seed: int = 0,
                 checksum: bool = False):
        super().__init__(checksum=checksum, seed=seed)
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (
                math.isfinite(clip) and clip >= 0):
            raise CodecError(f"terngrad: clip must be a finite number >= 0, got {clip!r}")
        self.clip = float(clip)
        self.bucket_size = check_bucket_size(self.codec_id, bucket_size)

    def _config(self) -> dict[str, Any]:
        return {"clip": self.clip, "bucket_size": self.bucket_size}

    def max_payload_size(self, n: int) -> int:
        return payload_size(n, self.bucket_size or 0)

    def _encode_payload(self, x, payload):
        bucket, nb = bucket_layout(self.bucket_size or 0, x.size)
        scales = payload[:4 * nb].view(np.float32)
        raise_status(self.codec_id, kernels.bucket_scales(x, x.view(np.int32), bucket, self.clip, scales))
        seed, counter = self._next_stream()
        kernels.encode(x, bucket, scales, seed, counter, payload[4 * nb:])
        return BITS, 0, self.bucket_size or 0, 0, payload_size(x.size, self.bucket_size or 0)

    def _check_payload(self, header: Header, payload):
        parse_payload(header, payload)

    def _decode(self, header: Header, payload, out, accumulate: bool) -> None:
        bucket, scales, codes = parse_payload(header, payload)
        raise_status(self.codec_id, qsgd_kernels.check_scales(scales))
        if accumulate:  # the kernel meets a code 3 only after writing: look for one first
            raise_status(self.codec_id, kernels.check_codes(codes, header.n))
        raise_status(self.codec_id, kernels.decode(codes, bucket, scales, out, accumulate))


def payload_size(n: int, param_a: int) -> int:
    _, nb = bucket_layout(param_a, n)
    return 4 * nb + (n * BITS + 7) // 8


def parse_payload(header: Header, payload: np.ndarray):
    if header.bits != BITS or header.flags or header.param_b:
        raise CodecError("terngrad: corrupted header (bits, flags or parameters)")
    bucket, nb = bucket_layout(header.param_a, header.n)
    expect_payload("terngrad", header.payload_len, payload_size(header.n, header.param_a),
                   f"{header.n} ternary values in {nb} buckets")
    return bucket, payload[:4 * nb].view(np.float32), payload[4 * nb:]
