"""The device path's streams and its status: where its launches and copies go, and how the host
learns what the kernels flagged.

- :func:`current_stream`: the stream a launch or copy goes on (torch's current stream, as a
  numba stream; under the simulator :func:`simulated_stream`'s); :func:`device_view` a numba
  array over a tensor's memory; :func:`simulated` whether Numba's CUDA simulator stands in.
- The counted waits for the device: :func:`synchronize` (the current stream) and
  :func:`finite` (a value read back).
- :class:`DeviceStatus`: the status slots one replica's device frames flag into, read once per
  encode (:meth:`DeviceStatus.wait`) or behind queued frames (:meth:`DeviceStatus.queue_read`),
  and the deferred decodes' read once per iteration (:func:`check_decodes`).

Every launch, synchronisation and copy here is counted (:mod:`mpigrad.counters`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...codecs import CodecError
from ...counters import copied, launched, synchronized

__all__ = ["simulated", "finite", "device_view", "current_stream", "simulated_stream", "synchronize",
           "DeviceStatus", "check_decodes"]


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for the GPU (``NUMBA_ENABLE_CUDASIM=1``);
    asks Numba's configuration, not numba.cuda, which a CPU run never imports."""
    from numba.core import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


def finite(x) -> bool:
    """Whether every value of a host array or a tensor is finite."""
    if isinstance(x, torch.Tensor):
        launched("torch", 2)
        synchronized("finite check")
        return bool(torch.isfinite(x).all())
    return bool(np.isfinite(x).all())


def device_view(cuda, tensor: torch.Tensor):
    """A numba device array over ``tensor``'s memory (no copy): a CUDA tensor's, or under
    the simulator a CPU tensor's; ``cuda`` is the loaded ``numba.cuda`` (:func:`load_cuda`)."""
    tensor = tensor.detach()
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(tensor.numpy())
    return cuda.as_cuda_array(tensor)


#: Numba's view of each torch stream the path has launched on, by its CUDA handle.
_EXTERNAL_STREAMS: dict[int, object] = {}
#: The streams made current by :func:`simulated_stream` (innermost last).
_SIMULATED_STREAMS: list = []


def current_stream(cuda, device: torch.device | None = None):
    """The stream the device path's next kernel or copy goes on: torch's current stream of
    ``device`` (the tensors'; else the current device) at the call, as a numba stream over
    the same CUDA stream, so that it is ordered with the backward that wrote the gradient
    and the torch operations (copies, error memory) that run on that stream too, whichever
    stream the caller has made current. Under the simulator, the innermost
    :func:`simulated_stream`'s, else the default stream."""
    if simulated():
        return _SIMULATED_STREAMS[-1] if _SIMULATED_STREAMS else cuda.default_stream()
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _EXTERNAL_STREAMS.get(handle)
    if stream is None:
        stream = _EXTERNAL_STREAMS[handle] = cuda.external_stream(handle)
    return stream


@contextlib.contextmanager
def simulated_stream(stream):
    """Under Numba's CUDA simulator, ``stream`` (a ``numba.cuda.stream()``) is the device
    path's current stream inside the block: the simulator's stand-in for ``with
    torch.cuda.stream(s):``, which needs CUDA. Tests use it to check that every launch and
    copy goes on the stream current at the call."""
    if not simulated():
        raise RuntimeError("simulated_stream is the simulator's: on a GPU use torch.cuda.stream")
    _SIMULATED_STREAMS.append(stream)
    try:
        yield stream
    finally:
        _SIMULATED_STREAMS.pop()


def synchronize(device: torch.device) -> None:
    synchronized("stream")
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DeviceStatus:
    """The status slots a rank's device frames flag into (:mod:`mpigrad.codecs.device.kernels`:
    NaN or infinity, a range beyond float32, a corrupt scale or code), shared by the
    compressors of one replica (``on_device``), so that one read covers every frame queued
    before it. Kernels only set slots; a read that finds them all clear leaves them so, and one
    that finds a flag raises and queues them cleared again.

    State: the slots (device int32), their pinned host copy, the device codecs whose frames
    may have flagged since the last read (``pending``: deferred decodes) and the number of
    reads so far (``reads``: a compressor's decode staging is reused only after one)."""

    def __init__(self, cuda, device: torch.device):
        from ...codecs.device import kernels as k

        self.cuda, self.device = cuda, device
        #: The slots only a decode sets (a corrupt scale or code).
        self._decode_slots = [k.ERR_BAD_SCALE, k.ERR_BAD_CODE]
        self._zeros = cuda.pinned_array(k.STATUS_SLOTS, np.int32)
        self._zeros[:] = 0
        self.slots = cuda.to_device(self._zeros)
        #: The slots read back, in pinned memory: the copy is asynchronous, waited for once.
        self._host = cuda.pinned_array(k.STATUS_SLOTS, np.int32)
        #: Pinned slots of the reads queued without a wait (:meth:`queue_read`), by key.
        self._reads: dict = {}
        self.pending: list = []
        self.reads = 0

    def stream(self):
        """The stream current at the call (:func:`current_stream`)."""
        return current_stream(self.cuda, self.device)

    def wait(self, twins=(), site: str = "frame and status") -> None:
        """One wait for the device: the slots copied back (asynchronously, into pinned memory)
        behind everything queued on the current stream (the frames' kernels and copies), then
        one synchronisation of that stream. CodecError where a slot is set, in the wording of
        the first of the pending decodes' codecs, else of ``twins`` (the frames just queued)."""
        copied("to_host", self._zeros.nbytes)
        stream = self.stream()
        status = self.slots.copy_to_host(self._host, stream=stream)
        synchronized(site)
        if not simulated():
            stream.synchronize()
        self.reads += 1
        pending, self.pending = self.pending, []
        self._raise_flags(status, twins, pending)

    def queue_read(self, key):
        """Queue the slots' copy into the pinned buffer of ``key`` (its own: reads of several
        keys may be in flight) behind everything queued on the current stream, then the
        slots cleared (unless decodes wait for a read), so that the next queued read covers
        only what is queued after this one, and an event; return (that buffer, the event:
        None under the simulator, where everything ran at the call). :meth:`settle` reads it
        once the event has completed."""
        host = self._reads.get(key)
        if host is None:
            host = self._reads[key] = self.cuda.pinned_array(len(self._zeros), np.int32)
        copied("to_host", self._zeros.nbytes)
        stream = self.stream()
        self.slots.copy_to_host(host, stream=stream)
        if not self.pending:
            copied("to_device", self._zeros.nbytes)
            self.slots.copy_to_device(self._zeros, stream=stream)
        if simulated():
            return host, None
        event = self.cuda.event(timing=False)
        event.record(stream)
        return host, event

    def settle(self, host, twins, pending) -> None:
        """A queued read's slots (:meth:`queue_read`, its event completed): CodecError as
        :meth:`wait` raises, ``pending`` being the decodes queued before it. A clear read
        counts as no read of the status (``reads`` and ``pending`` unchanged: decodes queued
        after it are left to the next :meth:`wait`); a flagged one clears the slots and
        forgets the pending decodes, as a flagged wait does (the run ends with the error)."""
        if host.any():
            self._raise_flags(host, twins, pending)

    def _raise_flags(self, status, twins, pending) -> None:
        """Nothing where ``status`` (the slots as read) is clear; else queue the slots
        cleared and raise CodecError in the words of the first of ``pending`` (a decode's
        flag, or no frame just queued) or of ``twins``."""
        if not status.any():
            return
        flags = status.copy()
        copied("to_device", self._zeros.nbytes)
        self.slots.copy_to_device(self._zeros, stream=self.stream())
        self.pending = []
        if pending and (flags[self._decode_slots].any() or not twins):  # a decode's flag
            try:
                pending[0].raise_status(flags)
            except CodecError as exc:
                raise CodecError(f"a frame decoded on the device since its status was last read (once per "
                                 f"iteration, so the sender is not known) is corrupt: {exc}") from None
        if not twins:
            raise CodecError(f"the device codecs flagged {flags.tolist()} with no frame queued since the last read")
        twins[0].raise_status(flags)

    def clear(self) -> None:
        """After a frame's launches failed part-way: wait for what was queued, then clear the
        slots and forget the pending decodes (their run ends with that failure), so that no
        later frame is blamed for their flags."""
        stream = self.stream()
        synchronized("failed frame")
        if not simulated():
            stream.synchronize()
        copied("to_device", self._zeros.nbytes)
        self.slots.copy_to_device(self._zeros, stream=stream)
        self.pending = []

    def check(self) -> None:
        """:meth:`wait` where a decode has been queued since the last read (``pending``), with
        its own site in the counts; nothing otherwise (no synchronisation)."""
        if self.pending:
            self.wait(site="decodes' status")


def check_decodes(replica) -> None:
    """Read the status of every device decode ``replica``'s compressors queued since the last
    wait (:meth:`DeviceStatus.check`): once per iteration, before its update is applied;
    CodecError where one found a corrupt scale or code. Nothing on the host path."""
    status = getattr(replica, "device_status", None)
    if status is not None:
        status.check()
