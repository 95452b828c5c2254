"""Where the device path's host frames lie: :class:`FrameMemory` (the pinned receive buffers and
the encodes' pinned frames of one replica, each a :class:`HostBuffer`, and where else their
bytes are), and the reused pinned and device byte buffers of a device compressor
(:func:`pinned_buffer`, :func:`device_buffer`, and :class:`StagingSlots`, which gives each
deferred decode a pinned staging buffer of its own until the status is next read).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...counters import synchronized
from .device_stream import DeviceStatus, simulated

__all__ = ["HostBuffer", "FrameMemory", "pinned_buffer", "device_buffer", "StagingSlots"]


@dataclasses.dataclass(eq=False)
class HostBuffer:
    """One host buffer frames lie in (:class:`FrameMemory`): pinned ``host`` memory, its
    ``device`` twin (an encode's device frame buffer) or None (a receive buffer), and the
    last copy queued out of it to the device: the status read count then (``copied_at``,
    None if none since the buffer was last written) and the event recorded behind it (the
    buffer's one, made at its first copy; None under the simulator)."""

    host: torch.Tensor
    device: torch.Tensor | None
    copied_at: int | None = None
    event: object = None


class FrameMemory:
    """The host buffers that frames lie in on one replica's device path, and where else their
    bytes are, so that a decode copies a frame to the device from where it lies, or not at all
    (:meth:`DeviceGradientCompressor.decode`):

    - receive buffers (:class:`~.wire.ReceiveBuffers` given this memory) are pinned, so the
      decode's copy goes to the device straight from them, asynchronously, with no host copy
      first. MPI must not write one again while that copy is still queued:
      :meth:`before_write` waits for its event where the status has not been read since (a
      read synchronises the stream, which covers the copy; the decodes and that read go on
      one stream, as the staging buffers' rule assumes);
    - an encode's host frame (a device compressor's pinned frame buffer) still has its
      payloads in the encode's device frame buffer: a decode on this replica (a colocated
      server's own worker's frame, a worker's own shard's broadcast) reads them there, and
      copies nothing. Only the headers are the host's (the decode reads them on the host).

    State: the buffers by key (:class:`HostBuffer`)."""

    def __init__(self, status: DeviceStatus):
        self.status = status
        self._buffers: dict = {}
        self._by_address: dict[int, HostBuffer] = {}

    def allocate(self, size: int, key) -> np.ndarray:
        """A pinned receive buffer of ``size`` bytes for ``key`` (replacing its last one)."""
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.status.device.type == "cuda")
        self._register(key, HostBuffer(host, None))
        return host.numpy()

    def encoded(self, key, host: torch.Tensor, device: torch.Tensor) -> None:
        """An encode's pinned host frame buffer for ``key`` and the device frame buffer whose
        payloads it copies."""
        known = self._buffers.get(key)
        if known is None or known.host is not host or known.device is not device:
            self._register(key, HostBuffer(host, device))

    def _register(self, key, buffer: HostBuffer) -> None:
        old = self._buffers.get(key)
        if old is not None and self._by_address.get(old.host.data_ptr()) is old:
            del self._by_address[old.host.data_ptr()]
        self._buffers[key] = buffer
        if buffer.host.numel():  # an empty buffer has no address of its own
            self._by_address[buffer.host.data_ptr()] = buffer

    def before_write(self, key) -> None:
        """Before ``key``'s receive buffer is written again: wait for a copy out of it still
        queued (one synchronisation, counted), where the status was not read since."""
        buffer = self._buffers[key]
        if buffer.copied_at is not None and buffer.copied_at == self.status.reads:
            synchronized("receive buffer reused before the status read")
            if buffer.event is not None:
                buffer.event.synchronize()
        buffer.copied_at = None

    def locate(self, frame: np.ndarray) -> tuple[HostBuffer, int] | None:
        """The buffer ``frame`` lies in and its offset there, or None (memory of no buffer here)."""
        address = frame.__array_interface__["data"][0]
        buffer = self._by_address.get(address)
        if buffer is not None and frame.size <= buffer.host.numel():
            return buffer, 0
        for buffer in self._buffers.values():  # a frame behind its length (a broadcast's message)
            start = buffer.host.data_ptr()
            if buffer.host.numel() and start <= address and address + frame.size <= start + buffer.host.numel():
                return buffer, address - start
        return None

    def copied_out(self, buffer: HostBuffer, stream) -> None:
        """A copy out of ``buffer`` was queued on ``stream``: :meth:`before_write` waits for it."""
        buffer.copied_at = self.status.reads
        if not simulated():
            if buffer.event is None:
                buffer.event = self.status.cuda.event(timing=False)
            buffer.event.record(stream)


def pinned_buffer(buffers: dict, key, capacity: int, device: torch.device) -> torch.Tensor:
    """``buffers[key]``: a host byte buffer of at least ``capacity`` bytes, in pinned memory
    where ``device`` is a GPU (its copies to and from it can then be asynchronous), grown
    (replaced) as needed."""
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < capacity:
        buffer = buffers[key] = torch.empty(capacity, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return buffer


def device_buffer(buffers: dict, key, capacity: int, device: torch.device) -> torch.Tensor:
    """``buffers[key]``: a byte buffer of at least ``capacity`` bytes on ``device``, grown
    (replaced) as needed."""
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < capacity:
        buffer = buffers[key] = torch.empty(capacity, dtype=torch.uint8, device=device)
    return buffer


class StagingSlots:
    """Which pinned staging buffer the next decode of a shard's frames takes: its own until the
    status is next read, since the host writes it before the device has copied the previous
    frame out of it (a deferred decode's copy may still be queued). Deferred decodes and that
    read are on one stream (the runtime's iteration keeps one). State: the decodes per shard
    since the status's read count was ``read``."""

    def __init__(self):
        self._slots: dict = {}
        self._read = -1

    def key(self, shard_key: tuple, reads: int) -> tuple:
        """The staging buffer's key for the next decode of ``shard_key``'s frames, the
        status having been read ``reads`` times: ``(*shard_key, n)``, n the decodes of it
        since that read (0 after each read: the buffers are reused)."""
        if self._read != reads:
            self._slots, self._read = {}, reads
        slot = self._slots[shard_key] = self._slots.get(shard_key, -1) + 1
        return (*shard_key, slot)
