"""Wire protocol between rank 0 (server) and the workers, one round per iteration.

Per iteration m:

1. worker -> 0, tag LOSS: ``LossMessage`` (float64[5]: loss, compute seconds (CPU),
   compute seconds (wall), parameter checksum or -1, status).
2. 0 -> all, Bcast: ``Control`` (int64[CONTROL_FIXED + L]: command, iteration, bits per layer).
3. worker -> 0, tag GRAD: one gradient *frame* (uint8): a frame header then one codec buffer
   per segment (the quantized layers in order, then one fp32 buffer of the small layers).
4. 0 -> all, Bcast: int64 frame length, then the averaged, re-encoded frame.

The frame header is 16 bytes plus 8 per segment: magic b"MGFR", segment count (uint32),
the sender's encode time in seconds (float64), then each segment's byte length (uint64).
Segments are validated again by their codec when decoded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

TAG_LOSS = 11
TAG_GRAD = 12

# Control commands.
CONTINUE = 1
STOP_AFTER = 2   # finish this iteration, then checkpoint and exit for requeue
CHECKPOINT_AFTER = 3  # finish this iteration, checkpoint, go on (--checkpoint-every)
CONTROL_FIXED = 3

# Loss message status.
STATUS_OK = 0.0
STATUS_NONFINITE_LOSS = 1.0
LOSS_FIELDS = 5

_FRAME_MAGIC = b"MGFR"
_ERROR_MAGIC = b"MGER"
_FRAME_HEAD = struct.Struct("<4sId")


class FrameError(ValueError):
    """A gradient frame that does not parse."""


def frame_capacity(segment_capacities: list[int]) -> int:
    return _FRAME_HEAD.size + 8 * len(segment_capacities) + sum(segment_capacities)


def frame_segments_offset(n_segments: int) -> int:
    return _FRAME_HEAD.size + 8 * n_segments


def write_frame_header(frame: np.ndarray, lengths: list[int], encode_seconds: float) -> int:
    """Write the header for segments already placed back to back; return the frame length."""
    head = _FRAME_HEAD.pack(_FRAME_MAGIC, len(lengths), encode_seconds)
    frame[:_FRAME_HEAD.size] = np.frombuffer(head, np.uint8)
    frame[_FRAME_HEAD.size:_FRAME_HEAD.size + 8 * len(lengths)] = np.frombuffer(
        np.asarray(lengths, dtype="<u8").tobytes(), np.uint8)
    return frame_segments_offset(len(lengths)) + sum(lengths)


def read_frame(frame: np.ndarray, n_segments: int) -> tuple[float, list[np.ndarray]]:
    """Split a frame into its segment buffers (views); FrameError if it does not add up."""
    if frame.size < frame_segments_offset(n_segments):
        raise FrameError(f"gradient frame of {frame.size} bytes is shorter than its header")
    magic, count, encode_seconds = _FRAME_HEAD.unpack_from(frame[:_FRAME_HEAD.size].tobytes())
    if magic != _FRAME_MAGIC or count != n_segments:
        raise FrameError(f"bad gradient frame header (magic {magic!r}, {count} segments, "
                         f"expected {n_segments})")
    lengths = [int(n) for n in np.frombuffer(frame[_FRAME_HEAD.size:frame_segments_offset(count)].tobytes(), "<u8")]
    offset = frame_segments_offset(count)
    if min(lengths, default=1) == 0 or sum(lengths) != frame.size - offset:
        raise FrameError(f"gradient frame segments of {lengths} bytes do not fill the "
                         f"{frame.size - offset} bytes the frame carries")
    segments = []
    for length in lengths:
        segments.append(frame[offset:offset + length])
        offset += length
    return encode_seconds, segments


@dataclass
class LossMessage:
    loss: float
    compute_cpu: float
    compute_wall: float
    checksum: float
    status: float

    def pack(self, buf: np.ndarray) -> np.ndarray:
        buf[:] = (self.loss, self.compute_cpu, self.compute_wall, self.checksum, self.status)
        return buf

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "LossMessage":
        return cls(*(float(v) for v in buf[:LOSS_FIELDS]))


def error_frame() -> np.ndarray:
    """The frame a worker sends instead of its gradient when the gradient is not finite."""
    return np.frombuffer(_ERROR_MAGIC + bytes(12), np.uint8).copy()


def is_error_frame(frame: np.ndarray) -> bool:
    return frame.size == 16 and frame[:4].tobytes() == _ERROR_MAGIC
