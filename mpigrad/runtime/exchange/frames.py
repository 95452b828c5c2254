"""What the roles ask of a compressor: :class:`FrameCompressor`, the one protocol of the host's
:class:`~.compressor.GradientCompressor` and the device path's
:class:`~.device.DeviceGradientCompressor`.

A compressor turns a flat gradient into one frame per shard and a frame back into values
(the wire format, :class:`~.wire.messages.FrameHeader`, and the codecs' payloads, are the
same on both: a frame encoded on a GPU decodes on a CPU). The roles (worker.py, server.py,
pipeline.py, broadcast.py) hold either through this protocol and ask nothing else of it;
which one a replica gets is :func:`~.device.on_device`'s choice. What differs is where the
values live: ``grad`` and ``out`` are flat float32 NumPy arrays on the host path, flat
float32 device tensors (``compressor.device``) on the device path; frames are host uint8
arrays on both (what MPI sends and receives).

The contract, method by method:

- ``capacity(shard, bits)``: the most bytes a frame of ``shard`` at ``bits`` (one width per
  quantized layer) can take; ``exact_capacity(shard, bits)``: that size where the codecs fix
  it (every frame of it is that long), else None. Neither blocks.
- ``encode(grad, bits, shard, out=None)``: the frame of ``shard``'s pieces of ``grad``: a view
  of a buffer the compressor reuses per shard (and bucket), valid until the next encode of
  it; or of ``out`` (uint8, at least ``capacity`` bytes) when given. It advances the pieces'
  RNG counters and the error memory. CodecError where a codec refuses the values (a NaN, a
  range beyond float32). Blocks until the frame is on the host (the device path: one wait
  for the device).
- ``encode_shards(grad, bits, shards)``: ``encode`` of each of ``shards`` in turn, the same
  frames; blocks once for them all.
- ``queue_shards(grad, bits, shards)``: the same encodes, not waited for: a
  :class:`PendingFrames`, whose ``frames()`` are ``encode_shards``'s once it is ``ready()``.
  The host's are done at the call (:class:`EncodedFrames`); the device's are queued on the
  current stream and done when the device has done them. CodecError from the call, or
  (device) from ``frames()``. No shards: nothing queued, frames that are ready and empty
  (both paths).
- ``decode(frame, shard, out, *, accumulate=False)``: ``shard``'s frame into ``out`` (or,
  with ``accumulate``, added to it, bit for bit ``out + decoded``); returns the sender's
  encode seconds. CodecError or FrameError on a bad frame: ``out`` is then not to be used.
  The host's blocks for the decode; the device's waits for its status, unless built with
  ``defer_decode_checks`` (the runtime's), where ``out`` is to be used only after the
  replica's next status read (:func:`~.device.check_decodes`).
- ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint needs to continue bit for
  bit (the same dict on both paths: the device error memory as the host's ``feedback``).
- ``pieces``: the layout's pieces; ``device``: where ``grad`` and ``out`` live (None: host
  NumPy arrays); ``frame_memory``: the :class:`~.device_memory.FrameMemory` its frames and the
  receive buffers given it lie in (None on the host path: plain host buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..plan.layout import Piece, Shard

__all__ = ["FrameCompressor", "PendingFrames", "EncodedFrames"]


@runtime_checkable
class PendingFrames(Protocol):
    """Encodes not yet waited for (:meth:`FrameCompressor.queue_shards`)."""

    def ready(self) -> bool:
        """Whether the frames are done (never blocks)."""

    def wait(self, site: str = "frames after backward") -> None:
        """Block until they are done (counted at ``site`` where that makes the host wait)."""

    def frames(self) -> list[np.ndarray]:
        """The host frames, once :meth:`ready` or waited for (RuntimeError before)."""


@runtime_checkable
class FrameCompressor(Protocol):
    """A flat gradient <-> one frame per shard (the module's contract)."""

    pieces: list[Piece]
    #: Where ``grad`` and ``out`` live: a torch device (the device path), None (host arrays).
    device: Any
    #: The FrameMemory of its frames (the device path), None on the host path.
    frame_memory: Any

    def capacity(self, shard: Shard, bits: list[int]) -> int: ...

    def exact_capacity(self, shard: Shard, bits: list[int]) -> int | None: ...

    def encode(self, grad, bits: list[int], shard: Shard, out: np.ndarray | None = None) -> np.ndarray: ...

    def encode_shards(self, grad, bits: list[int], shards) -> list[np.ndarray]: ...

    def queue_shards(self, grad, bits: list[int], shards) -> PendingFrames: ...

    def decode(self, frame: np.ndarray, shard: Shard, out, *, accumulate: bool = False) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EncodedFrames:
    """Frames done at the call (the host path's :meth:`FrameCompressor.queue_shards`, or the
    error frames that stand for a refused encode): ready, nothing to wait for."""

    def __init__(self, frames: list[np.ndarray]):
        self._frames = list(frames)

    def ready(self) -> bool:
        return True

    def wait(self, site: str = "frames after backward") -> None:
        pass

    def frames(self) -> list[np.ndarray]:
        return list(self._frames)
