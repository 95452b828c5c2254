"""Gradient codecs: numcodecs-style classes with an id, a JSON config and a registry.

    codec = get_codec({"id": "qsgd", "bits": 4, "bucket_size": 512})
    buf = codec.encode(x)          # 1-D float32 -> 1-D uint8, self-describing
    y = codec.decode(buf)          # -> 1-D float32 of the encoded length

Where each built-in codec's parts live (host class, Numba kernels, NumPy twin, device twin
and its kind code) is one table, :data:`.parts.BUILTIN_CODECS`.
"""

import importlib

from .base import (HEADER_SIZE, Codec, CodecError, available, codec_class, get_codec,
                   read_header, register_codec)
from .parts import host_modules

# Each built-in's host module, as the table of the codecs' parts names it (:mod:`.parts`):
# importing one registers its classes (``register_codec``).
for _module in host_modules():
    importlib.import_module(_module)
del _module

__all__ = ["Codec", "CodecError", "HEADER_SIZE", "available", "codec_class", "get_codec",
           "read_header", "register_codec"]
