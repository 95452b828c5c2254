"""NumPy twins of fp32 and fp16 (the codecs are NumPy already; the twin is the obvious loop-free cast)."""

import numpy as np

from ..base import CodecError, non_finite_error


class _FloatTwin:
    """A float codec's payload methods in NumPy: a cast to the codec's dtype and back."""

    def encode_payload(self, codec, x, payload):
        if not np.isfinite(x).all():
            raise non_finite_error(codec.codec_id)
        with np.errstate(over="ignore"):
            values = x.astype(codec.dtype)
        if not np.isfinite(values).all():
            raise CodecError(f"{codec.codec_id}: a value exceeds the format's range")
        raw = values.view(np.uint8)
        payload[:raw.size] = raw
        return 0, 0, 0, 0, raw.size

    def decode_payload(self, codec, header, payload, out):
        if header.payload_len != header.n * codec.dtype.itemsize:
            raise CodecError(f"{codec.codec_id}: bad payload length")
        out[:] = payload.view(codec.dtype).astype(np.float32)


class Float32Twin(_FloatTwin):
    """``fp32``'s twin (named by ``mpigrad.codecs.parts``)."""


class Float16Twin(_FloatTwin):
    """``fp16``'s twin (named by ``mpigrad.codecs.parts``)."""
