"""Gradient codecs: numcodecs-style classes with an id, a JSON config and a registry.

    codec = get_codec({"id": "qsgd", "bits": 4, "bucket_size": 512})
    buf = codec.encode(x)          # 1-D float32 -> 1-D uint8, self-describing
    y = codec.decode(buf)          # -> 1-D float32 of the encoded length
"""

from .base import (HEADER_SIZE, Codec, CodecError, available, codec_class, get_codec,
                   read_header, register_codec)
from . import fp  # noqa: F401  (registers fp32, fp16)
from . import qsgd, sign, terngrad, uniform  # noqa: F401,E401  (register the Numba codecs)
from . import mcgq  # noqa: F401  (registers mcgq)
from . import powersgd  # noqa: F401  (registers powersgd, the factors of the low-rank family)

__all__ = ["Codec", "CodecError", "HEADER_SIZE", "available", "codec_class", "get_codec",
           "read_header", "register_codec"]
