"""The wire header every encoded buffer starts with, its checks and the codecs' one error
class: the part of the codec format a reader needs without any codec class (the contract
check, the device codecs, a decoder of a frame from the wire).

Every encoded buffer is a fixed 40-byte header followed by a codec payload::

    offset size  field
    0      2     magic b"MG"
    2      1     format version (FORMAT_VERSION)
    3      1     codec wire id (one per codec class: mpigrad's 1..127, plugins' 128..255)
    4      1     bits (codec-specific; 0 when unused)
    5      1     codec flags (codec-specific bit flags)
    6      1     header flags (bit 0: payload CRC-32 present)
    7      1     reserved, zero
    8      4     param_a, uint32 (codec-specific, e.g. bucket size)
    12     4     param_b, uint32 (codec-specific, e.g. QSGD levels)
    16     8     element count, uint64
    24     8     payload length in bytes, uint64
    32     4     payload CRC-32 (zero when absent)
    36     4     CRC-32 of bytes 0..35

All integers are little-endian. ``read_header`` validates the header and the buffer length
before any kernel runs.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import numpy as np

from ..plugins import _describe

__all__ = ["CodecError", "PluginFault", "Header", "read_header", "header_bytes", "HEADER_SIZE", "FORMAT_VERSION",
           "MAX_ELEMENTS", "BUILTIN_WIRE_IDS", "PLUGIN_WIRE_IDS"]

FORMAT_VERSION = 1
MAGIC = b"MG"
HEADER_SIZE = 40
MAX_ELEMENTS = 2**34
_HEADER = struct.Struct("<2sBBBBBBIIQQI")
_CRC = struct.Struct("<I")
_FLAG_PAYLOAD_CRC = 0x01
#: Wire ids of mpigrad's own codecs (``register_codec``) and of codecs loaded as plugins
#: (``package.module:Class``): disjoint, so a plugin's buffer is never taken for a built-in's.
BUILTIN_WIRE_IDS = range(1, 128)
PLUGIN_WIRE_IDS = range(128, 256)
assert _HEADER.size + _CRC.size == HEADER_SIZE


class CodecError(ValueError):
    """A buffer or input that a codec cannot accept; the message says what is wrong."""


class PluginFault(CodecError):
    """An exception other than CodecError from a plugin's own code in ``encode`` or
    ``decode``, as one line naming the plugin; ``cause`` is that exception in words."""

    def __init__(self, codec: object, what: str, exc: BaseException):
        cls = type(codec)
        self.cause = _describe(exc)
        super().__init__(f"codec {cls.__module__}:{cls.__qualname__}: {what} raised {self.cause}")


class Header(NamedTuple):
    wire_id: int
    bits: int
    flags: int
    param_a: int
    param_b: int
    n: int
    payload_len: int


def read_header(buf: np.ndarray) -> Header:
    """Parse and validate the header of ``buf`` (1-D uint8); raise CodecError if bad."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise CodecError("encoded buffer must be a 1-D numpy uint8 array")
    if buf.size < HEADER_SIZE:
        raise CodecError(f"buffer of {buf.size} bytes is shorter than the {HEADER_SIZE}-byte header")
    raw = buf[:HEADER_SIZE].tobytes()
    (magic, version, wire_id, bits, flags, hflags, reserved, param_a, param_b, n,
     payload_len, payload_crc) = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CodecError("not an mpigrad codec buffer (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported buffer format version {version} (this mpigrad reads {FORMAT_VERSION})")
    (header_crc,) = _CRC.unpack_from(raw, _HEADER.size)
    if zlib.crc32(raw[:_HEADER.size]) != header_crc:
        raise CodecError("corrupted buffer header (header CRC mismatch)")
    if reserved != 0 or hflags & ~_FLAG_PAYLOAD_CRC:
        raise CodecError("corrupted buffer header (reserved bits set)")
    if n > MAX_ELEMENTS:
        raise CodecError(f"element count {n} exceeds the limit of {MAX_ELEMENTS}")
    if payload_len != buf.size - HEADER_SIZE:
        raise CodecError(
            f"truncated or padded buffer: header announces {payload_len} payload bytes, "
            f"buffer holds {buf.size - HEADER_SIZE}")
    if hflags & _FLAG_PAYLOAD_CRC:
        if zlib.crc32(buf[HEADER_SIZE:]) != payload_crc:
            raise CodecError("corrupted payload (payload CRC mismatch)")
    elif payload_crc != 0:
        raise CodecError("corrupted buffer header (CRC field set without its flag)")
    return Header(wire_id, bits, flags, param_a, param_b, n, payload_len)


def _write_header(out: np.ndarray, h: Header, with_crc: bool) -> None:
    payload_crc = zlib.crc32(out[HEADER_SIZE:HEADER_SIZE + h.payload_len]) if with_crc else 0
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, h.wire_id, h.bits, h.flags,
                        _FLAG_PAYLOAD_CRC if with_crc else 0, 0, h.param_a, h.param_b,
                        h.n, h.payload_len, payload_crc)
    out[:_HEADER.size] = np.frombuffer(head, np.uint8)
    out[_HEADER.size:HEADER_SIZE] = np.frombuffer(_CRC.pack(zlib.crc32(head)), np.uint8)


def header_bytes(h: Header) -> np.ndarray:
    """The 40 bytes of header ``h``, without a payload CRC (the device codecs write their
    payload on the GPU and this header on the host)."""
    out = np.zeros(HEADER_SIZE, np.uint8)
    _write_header(out, h, False)
    return out
