"""``uniform``: MQGrad's min/max quantizer (TensorFlow MIN_COMBINED semantics, no range nudge).

Payload: ``nb`` (lo, hi) float32 pairs, one per bucket, then ceil(n * bits / 8) bytes of
bits-wide codes (layout: kernels.common.pack_block). Header: ``bits``; flags bit 0 set
when stochastic rounding produced the codes; param_a the bucket size (0: one bucket).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import CodecError, FusedCodec, Header, register_codec
from .checks import bucket_layout, check_bucket_size, check_choice, check_int, expect_payload, raise_status
from .kernels import uniform as kernels

FLAG_STOCHASTIC = 0x01
ROUNDINGS = ("nearest", "stochastic")


@register_codec
class Uniform(FusedCodec):
    """Min/max quantizer: q = round((x - lo) * R / (hi - lo)), x' = lo + q * (hi - lo) / R.

    ``bits`` 1..8 (R = 2**bits - 1); ``rounding`` "nearest" (half to even) or
    "stochastic" (floor(t + u), unbiased, draws from ``seed``; ``seed`` is ignored
    otherwise); ``bucket_size`` None (one (lo, hi) per tensor) or a bucket length.
    Constant input decodes exactly; decoded values never leave [lo, hi]. NaN, infinity
    and values whose range hi - lo overflows float32 raise CodecError.
    """

    codec_id = "uniform"
    exact_size = True
    wire_id = 3
    accepts_bits = True

    def __init__(self, *, bits: int = 8, rounding: str = "nearest", bucket_size: int | None = None,
                 seed: int = 0, checksum: bool = False):
        super().__init__(checksum=checksum, seed=seed)
        self.bits = check_int(self.codec_id, "bits", bits, 1, 8)
        self.rounding = check_choice(self.codec_id, "rounding", rounding, ROUNDINGS)
        self.stochastic = rounding == "stochastic"
        self.bucket_size = check_bucket_size(self.codec_id, bucket_size)

    def _config(self) -> dict[str, Any]:
        return {"bits": self.bits, "rounding": self.rounding, "bucket_size": self.bucket_size}

    def max_payload_size(self, n: int) -> int:
        return payload_size(n, self.bits, self.bucket_size or 0)

    def _encode_payload(self, x, payload):
        bucket, nb = bucket_layout(self.bucket_size or 0, x.size)
        lohi = payload[:8 * nb].view(np.float32)
        raise_status(self.codec_id, kernels.bucket_ranges(x.view(np.int32), bucket, lohi))
        seed, counter = self._next_stream() if self.stochastic else (0, 0)
        kernels.encode(x, bucket, self.bits, lohi, self.stochastic, seed, counter, payload[8 * nb:])
        return (self.bits, FLAG_STOCHASTIC if self.stochastic else 0, self.bucket_size or 0, 0,
                payload_size(x.size, self.bits, self.bucket_size or 0))

    def _check_payload(self, header: Header, payload):
        parse_payload(header, payload)

    def _decode(self, header: Header, payload, out, accumulate: bool) -> None:
        bucket, lohi, codes = parse_payload(header, payload)
        raise_status(self.codec_id, kernels.check_ranges(lohi))
        kernels.decode(codes, bucket, header.bits, lohi, out, accumulate)


def payload_size(n: int, bits: int, param_a: int) -> int:
    _, nb = bucket_layout(param_a, n)
    return 8 * nb + (n * bits + 7) // 8


def parse_payload(header: Header, payload: np.ndarray):
    """Check a uniform header against its payload; return (bucket, lohi, codes)."""
    if not 1 <= header.bits <= 8:
        raise CodecError(f"uniform: corrupted header (bits {header.bits} outside 1..8)")
    if header.flags & ~FLAG_STOCHASTIC or header.param_b != 0:
        raise CodecError("uniform: corrupted header (unknown flags or parameters)")
    bucket, nb = bucket_layout(header.param_a, header.n)
    expect_payload("uniform", header.payload_len, payload_size(header.n, header.bits, header.param_a),
                   f"{header.n} values at {header.bits} bits in {nb} buckets")
    return bucket, payload[:8 * nb].view(np.float32), payload[8 * nb:]
