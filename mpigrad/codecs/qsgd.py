"""``qsgd``: stochastic unbiased quantization (Alistarh et al., 2017) with buckets.

Header: ``bits`` = 1 + bit_length(s) (sign + level width); flags bit 0: Elias coding,
bit 1: l2 norm; param_a: bucket size (0: one bucket); param_b: levels s.

Payload, fixed coding: ``nb`` float32 scales, then ceil(n * bits / 8) bytes of codes
(level in the low bits - 1 bits, sign on top; layout kernels.common.pack_block).
Payload, Elias coding: ``nb`` float32 scales, the nonzero count as uint64, then the
gap / sign / level stream of kernels.elias, zero-padded to a byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Codec, CodecError, Header, register_codec
from .checks import bucket_layout, check_bucket_size, check_choice, check_int, expect_payload, raise_status
from .kernels import common, elias, qsgd as kernels

FLAG_ELIAS = 0x01
FLAG_L2 = 0x02
NORMS = ("max", "l2")
CODINGS = ("fixed", "elias")
MAX_FIXED_LEVELS = 127
MAX_ELIAS_LEVELS = 2**24


@register_codec
class QSGD(Codec):
    """Q(v_i) = scale * sgn(v_i) * xi_i / s, xi_i in {l, l + 1} with E[Q(v)] = v.

    Give ``bits`` (2..8, sign included: s = 2**(bits-1) - 1; default 4) or ``levels``
    (s: 1..127 for fixed coding, 1..2**24 for Elias). ``bucket_size`` (default 512; None:
    one bucket per tensor); ``norm`` "max" (max |v| per bucket, the paper's practice) or
    "l2"; ``coding`` "fixed" (bits per element) or "elias" (the paper's sparse stream).
    """

    codec_id = "qsgd"
    wire_id = 4
    accepts_bits = True
    stochastic = True

    def __init__(self, *, bits: int | None = None, levels: int | None = None,
                 bucket_size: int | None = 512, norm: str = "max", coding: str = "fixed",
                 seed: int = 0, checksum: bool = False):
        super().__init__(checksum=checksum, seed=seed)
        self.norm = check_choice(self.codec_id, "norm", norm, NORMS)
        self.coding = check_choice(self.codec_id, "coding", coding, CODINGS)
        self.bucket_size = check_bucket_size(self.codec_id, bucket_size)
        if bits is not None and levels is not None:
            raise CodecError("qsgd: give bits or levels, not both")
        if levels is None:
            self.bits = check_int(self.codec_id, "bits", 4 if bits is None else bits, 2, 8)
            self.levels = 2 ** (self.bits - 1) - 1
            self._given = "bits"
        else:
            limit = MAX_ELIAS_LEVELS if self.coding == "elias" else MAX_FIXED_LEVELS
            self.levels = check_int(self.codec_id, "levels", levels, 1, limit)
            self.bits = code_bits(self.levels)
            self._given = "levels"

    @property
    def exact_size(self) -> bool:  # fixed-width codes; Elias's stream depends on the data
        return self.coding == "fixed"

    def _config(self) -> dict[str, Any]:
        size = {"bits": self.bits} if self._given == "bits" else {"levels": self.levels}
        return {**size, "bucket_size": self.bucket_size, "norm": self.norm, "coding": self.coding}

    def max_payload_size(self, n: int) -> int:
        _, nb = bucket_layout(self.bucket_size or 0, n)
        if self.coding == "elias":
            return 4 * nb + 8 + elias_stream_bound(n, self.levels)
        return 4 * nb + (n * self.bits + 7) // 8

    def _encode_payload(self, x, payload):
        bucket, nb = bucket_layout(self.bucket_size or 0, x.size)
        scales = payload[:4 * nb].view(np.float32)
        status = kernels.bucket_scales(x, x.view(np.int32), bucket, self.norm == "l2", scales)
        raise_status(self.codec_id, status)
        seed, counter = self._next_stream()
        flags = FLAG_L2 if self.norm == "l2" else 0
        if self.coding == "elias":
            stream = payload[4 * nb + 8:]
            nonzero, nbytes = elias.encode(x, bucket, self.levels, scales, seed, counter, stream)
            payload[4 * nb:4 * nb + 8] = np.frombuffer(int(nonzero).to_bytes(8, "little"), np.uint8)
            return self.bits, flags | FLAG_ELIAS, self.bucket_size or 0, self.levels, 4 * nb + 8 + nbytes
        kernels.encode_fixed(x, bucket, self.bits, self.levels, scales, seed, counter,
                             payload[4 * nb:])
        return self.bits, flags, self.bucket_size or 0, self.levels, 4 * nb + (x.size * self.bits + 7) // 8

    def _check_payload(self, header: Header, payload):
        parse_payload(header, payload)

    def _decode_payload(self, header: Header, payload, out):
        self._decode(header, payload, out, False)

    def _accumulate_payload(self, header: Header, payload, out):
        if header.flags & FLAG_ELIAS:
            # The stream's errors show only while decoding it: scratch, then add.
            super()._accumulate_payload(header, payload, out)
        else:
            self._decode(header, payload, out, True)

    def _decode(self, header: Header, payload, out, accumulate: bool) -> None:
        bucket, scales, rest, nonzero = parse_payload(header, payload)
        raise_status(self.codec_id, kernels.check_scales(scales))
        s, bits = header.param_b, header.bits
        if header.flags & FLAG_ELIAS:
            status = elias.decode(rest, nonzero, bucket, s, scales, out)
        else:
            if accumulate and s < 2 ** (bits - 1) - 1:
                # Codes can hold levels above s, which the kernel finds only after writing.
                raise_status(self.codec_id, kernels.check_levels(rest, header.n, bits, s))
            status = kernels.decode_fixed(rest, bucket, bits, s, scales, out, accumulate)
        raise_status(self.codec_id, status)


def code_bits(levels: int) -> int:
    """Bits of a fixed code for s levels: one sign bit plus bit_length(s)."""
    return 1 + int(levels).bit_length()


def elias_stream_bound(n: int, levels: int) -> int:
    """Worst-case stream bytes, plus the 8 bytes of slack the encoder's word stores need:
    omega(gap) costs at most 1.5 bits per position skipped, each nonzero adds a sign bit
    and omega(level) <= omega(s)."""
    return (n * (3 + int(common.omega_len(levels))) + 7) // 8 + 8


def parse_payload(header: Header, payload: np.ndarray):
    """Check a qsgd header against its payload; return (bucket, scales, codes, nonzero)."""
    s = header.param_b
    if not 1 <= s <= MAX_ELIAS_LEVELS or header.bits != code_bits(s):
        raise CodecError(f"qsgd: corrupted header (levels {s} with {header.bits} bits)")
    if header.flags & ~(FLAG_ELIAS | FLAG_L2):
        raise CodecError("qsgd: corrupted header (unknown flags)")
    bucket, nb = bucket_layout(header.param_a, header.n)
    if not header.flags & FLAG_ELIAS:
        if header.bits > 8:
            raise CodecError(f"qsgd: corrupted header (fixed coding with {header.bits} bits)")
        expect_payload("qsgd", header.payload_len, 4 * nb + (header.n * header.bits + 7) // 8,
                       f"{header.n} values at {header.bits} bits in {nb} buckets")
        return bucket, payload[:4 * nb].view(np.float32), payload[4 * nb:], 0
    if header.payload_len < 4 * nb + 8:
        raise CodecError(f"qsgd: payload of {header.payload_len} bytes is too short for "
                         f"{nb} scales and the nonzero count")
    stream = payload[4 * nb + 8:]
    nonzero = int.from_bytes(payload[4 * nb:4 * nb + 8].tobytes(), "little")
    if nonzero > header.n or 3 * nonzero > 8 * stream.size:
        raise CodecError(f"qsgd: corrupted payload ({nonzero} nonzeros announced for "
                         f"{header.n} values in a {stream.size}-byte stream)")
    if stream.size > elias_stream_bound(header.n, s):
        raise CodecError(f"qsgd: corrupted payload (a {stream.size}-byte stream is longer than "
                         f"{header.n} values can need)")
    return bucket, payload[:4 * nb].view(np.float32), stream, nonzero
