"""Uncompressed baselines: ``fp32`` (identity) and ``fp16`` (IEEE half precision)."""

from __future__ import annotations

import numpy as np

from .base import Codec, CodecError, Header, non_finite_error, register_codec
from .kernels import fp as fp_kernels, half


class _FloatCodec(Codec):
    dtype: np.dtype
    exact_size = True

    def __init__(self, *, checksum: bool = False):
        super().__init__(checksum=checksum)

    def _config(self):
        return {}

    def max_payload_size(self, n: int) -> int:
        return n * self.dtype.itemsize

    def _encode_payload(self, x, payload):
        nbytes = x.size * self.dtype.itemsize
        values = payload[:nbytes].view(self.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(values, x, casting="same_kind")
            finite_sum = np.isfinite(values.sum(dtype=np.float32))
        if not finite_sum and not np.isfinite(values).all():
            if np.isfinite(x).all():
                raise CodecError(f"{self.codec_id}: a value exceeds the format's range")
            raise non_finite_error(self.codec_id)
        return 0, 0, 0, 0, nbytes

    def _check_payload(self, header: Header, payload) -> None:
        if header.payload_len != header.n * self.dtype.itemsize:
            raise CodecError(f"{self.codec_id}: payload of {header.payload_len} bytes cannot hold "
                             f"{header.n} values")

    def _decode_payload(self, header: Header, payload, out):
        np.copyto(out, payload.view(self.dtype), casting="same_kind")

    def _accumulate_payload(self, header: Header, payload, out):
        # float16 widens to float32 exactly, then one float32 add: out + decode bit for bit.
        np.add(out, payload.view(self.dtype), out=out, casting="same_kind")


@register_codec
class Float32(_FloatCodec):
    """No compression: 4 bytes per element (the paper's uncompressed baseline)."""

    codec_id = "fp32"
    wire_id = 1
    dtype = np.dtype(np.float32)
    nominal_bits = 32

    def _encode_payload(self, x, payload):
        nbytes = 4 * x.size
        if fp_kernels.copy_count_nonfinite(x.view(np.uint32), payload[:nbytes].view(np.uint32)):
            raise non_finite_error(self.codec_id)
        return 0, 0, 0, 0, nbytes


@register_codec
class Float16(_FloatCodec):
    """IEEE half precision, round to nearest; values beyond +-65504 are rejected. The casts
    are Numba kernels (kernels/half.py), NumPy's to the bit and 10x faster here."""

    codec_id = "fp16"
    wire_id = 2
    dtype = np.dtype(np.float16)
    nominal_bits = 16

    def _encode_payload(self, x, payload):
        nbytes = x.size * 2
        if half.narrow(x.view(np.uint32), payload[:nbytes].view(np.uint16)):
            if np.isfinite(x).all():
                raise CodecError(f"{self.codec_id}: a value exceeds the format's range")
            raise non_finite_error(self.codec_id)
        return 0, 0, 0, 0, nbytes

    def _decode_payload(self, header: Header, payload, out):
        half.widen(payload[:header.n * 2].view(np.uint16), half.HALF_TO_FLOAT, out[:header.n])

    def _accumulate_payload(self, header: Header, payload, out):
        half.widen_add(payload[:header.n * 2].view(np.uint16), half.HALF_TO_FLOAT, out[:header.n])
