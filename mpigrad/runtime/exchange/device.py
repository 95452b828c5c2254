"""The device path: gradients encoded and decoded where they live, only packed bytes cross.

With ``--device cuda`` and codecs that have GPU kernels (:mod:`mpigrad.codecs.device`), a
:class:`DeviceGradientCompressor` stands where the host's
:class:`~.compressor.GradientCompressor` stands, with the same frames: it encodes a shard
of a flat gradient that stays in device memory into a device frame buffer (the error
memory on the device too), copies the packed bytes, and nothing else, into a pinned host
frame, and writes the headers there; it decodes a received host frame by copying its bytes
to the device once, straight from the pinned buffer MPI received it into (:class:`FrameMemory`;
a frame encoded on the same rank is read where its encode left it), and adding every piece
into a device buffer.
The kernels flag their refusals into one status array per rank (:class:`DeviceStatus`), whose
copy back goes after the frames' kernels and copies on the same stream, all asynchronous: an
encode waits for the device once (its frame goes on the wire), and the runtime's decodes wait
for nothing, their status read once per iteration (:func:`check_decodes`).

Without a GPU the same path runs in Numba's CUDA simulator over CPU tensors
(``NUMBA_ENABLE_CUDASIM=1`` and ``MPIGRAD_DEVICE_CODECS=simulator``): how CI tests it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os

import numpy as np
import torch

from ...codecs import CodecError, HEADER_SIZE
from ...codecs.base import header_bytes
from ...codecs.device import DeviceUnavailable, device_codec, host_only, load_cuda
from ...counters import copied, launched, synchronized
from ...feedback import ErrorFeedback, FeedbackError
from .compressor import GradientCompressor
from ..plan.layout import Shard
from ..wire.messages import FrameHeader

#: ``MPIGRAD_DEVICE_CODECS=simulator`` runs the device path over CPU tensors in Numba's
#: CUDA simulator (tests without a GPU); ``host`` keeps a CUDA run on the host path.
ENVIRONMENT = "MPIGRAD_DEVICE_CODECS"


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for the GPU (``NUMBA_ENABLE_CUDASIM=1``);
    asks Numba's configuration, not numba.cuda, which a CPU run never imports."""
    from numba.core import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


def device_path(device: torch.device) -> bool:
    """Whether a replica on ``device`` takes the device path."""
    choice = os.environ.get(ENVIRONMENT, "")
    if device.type == "cuda":
        return choice != "host"
    return choice == "simulator" and simulated()


def host_reasons(codecs) -> list[str]:
    """Why each of ``codecs`` (host codec objects) keeps the host path, one line each."""
    return sorted({reason for reason in map(host_only, codecs) if reason})


def compressor_codecs(compressor: GradientCompressor) -> list:
    """The codec objects ``compressor`` encodes and decodes with."""
    return [compressor.decoder, compressor.rest_codec, *compressor.piece_codecs.values()]


def on_device(replica, *compressors) -> list:
    """``compressors`` as the replica's path takes them: on the device path (a replica on a
    GPU, or the simulator asked for), when every codec has kernels and numba-cuda loads,
    their device twins (one per distinct object) with the replica's codec buffers moved to
    the device, flagging into one :class:`DeviceStatus` (``replica.device_status``), their
    frames in one :class:`FrameMemory` (``replica.frame_memory``), and leaving their
    decodes' status to :func:`check_decodes`; the host compressors as they are where a codec
    has no kernels (rank 0's ``codecs:`` line says why).
    DeviceUnavailable (one line naming the extra, and ``MPIGRAD_DEVICE_CODECS=host``) where
    every codec has kernels but numba-cuda is missing, broken or sees no device: a run the
    user expects on the GPU is refused rather than silently run many times slower on the
    host."""
    if not device_path(replica.device) or host_reasons([c for comp in compressors for c in compressor_codecs(comp)]):
        return list(compressors)
    try:
        load_cuda()
    except DeviceUnavailable as exc:
        raise DeviceUnavailable(f"{exc} (or {ENVIRONMENT}=host: the codecs on the host, the whole gradient "
                                "copied out every iteration)") from None
    replica.use_device_codecs()
    if replica.device_status is None:
        replica.device_status = DeviceStatus(load_cuda(), replica.device)
        replica.frame_memory = FrameMemory(replica.device_status)
    twins: dict[int, DeviceGradientCompressor] = {}
    for c in compressors:
        if id(c) not in twins:
            twins[id(c)] = DeviceGradientCompressor(c, replica.device, replica.device_status,
                                                    defer_decode_checks=True, frame_memory=replica.frame_memory)
    return [twins[id(c)] for c in compressors]


def codec_path(config, codecs) -> str | None:
    """rank 0's start-up line on where the workers run ``codecs`` (the run's codec objects),
    for a run on a GPU or on the simulator's device path; None for a CPU run."""
    from ..plan.gpu import workers_device

    device = torch.device(workers_device(config))
    if device.type == "cuda" and os.environ.get(ENVIRONMENT) == "host":
        return f"codecs: on the host ({ENVIRONMENT}=host): the whole gradient is copied out every iteration"
    if not device_path(device):
        return None
    reasons = host_reasons(codecs)  # numba-cuda itself: the workers refused to start without it (on_device)
    if reasons:
        return f"codecs: on the host, the whole gradient copied out every iteration: {'; '.join(reasons)}"
    where = "in Numba's CUDA simulator" if device.type == "cpu" else "on the GPU"
    return (f"codecs: {where} (Numba CUDA kernels): gradients encoded and updates decoded in device memory, "
            "the packed frames staged through pinned host memory")


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

    def __init__(self, status: "DeviceStatus"):
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


class DeviceFeedback:
    """The error memory of :class:`~mpigrad.feedback.ErrorFeedback` in device memory, with
    the same float operations (so the same memory, bit for bit) and the same state_dict.
    Hyperparameters: the host memory's mode and decay, the pieces (their places in the flat
    gradient). State: the memory and the compensated gradient, each one flat device tensor
    laid out as the gradient (the table kernels compensate and remember in place), and the
    keys compensated so far, in order (the host memory's keys)."""

    def __init__(self, host: ErrorFeedback, device: torch.device, pieces):
        self.mode, self.decay, self.device = host.mode, host.decay, device
        self.places = {p.index: (p.offset, p.size) for p in pieces if p.quantized}
        total = max((offset + size for offset, size in self.places.values()), default=0)
        #: e, and p = g + decay * e, where the gradient's pieces are.
        self.memory = torch.zeros(total, dtype=torch.float32, device=device)
        self.compensated = torch.empty(total, dtype=torch.float32, device=device)
        self.used: dict[int, None] = {}

    @property
    def kernel_mode(self) -> int:
        """The mode as the table kernels take it (``kernels.RESIDUAL`` or ``ACCUMULATE``)."""
        from ...codecs.device import kernels

        return kernels.RESIDUAL if self.mode == "residual" else kernels.ACCUMULATE

    def error(self, key: int) -> torch.Tensor:
        offset, size = self.places[key]
        return self.memory[offset:offset + size]

    def remembered(self, key: int) -> None:
        """Record that ``key``'s memory is in use (compensated and updated by the table kernels)."""
        self.used.setdefault(key, None)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "decay": self.decay,
                "memory": {key: self.error(key).cpu().numpy().copy() for key in self.used}}

    def load_state_dict(self, state: dict) -> None:
        host = ErrorFeedback(self.mode, self.decay)
        host.load_state_dict(state)  # its checks
        for key in host.keys():  # all checked before any is loaded
            error = host.error(key)
            if key not in self.places or error.shape != (self.places[key][1],) or error.dtype != np.float32:
                raise FeedbackError(f"error feedback memory {key!r}: not a quantized piece of this layout, or "
                                    "not its size (float32)")
        self.memory.zero_()
        self.used = {}
        for key in host.keys():
            self.error(key).copy_(torch.from_numpy(host.error(key).copy()))
            self.remembered(key)


class DeviceGradientCompressor:
    """Hyperparameters: the host compressor it mirrors (pieces, codec configs and
    instances, RNG counters: its ``state_dict`` is the host one's), the device, the
    :class:`DeviceStatus` its frames flag into (its own unless given), whether a decode
    leaves its status to a later read (``defer_decode_checks``: the runtime's, which reads it
    once per iteration, :func:`check_decodes`) and the :class:`FrameMemory` of its host frames
    (its own unless given: the runtime's compressors share the replica's, so that a decode
    finds the frames the others encoded and the receive buffers). State: each codec
    instance's device twin, the device error memory, the device and pinned frame buffers.
    ``encode``/``decode`` take device tensors and host frames: a
    :class:`~.frames.FrameCompressor` whose ``device`` is the tensors'."""

    def __init__(self, host: GradientCompressor, device: torch.device, status: DeviceStatus | None = None,
                 defer_decode_checks: bool = False, frame_memory: FrameMemory | None = None):
        reasons = host_reasons(compressor_codecs(host))
        if reasons:
            raise CodecError("; ".join(reasons))
        self.host, self.device = host, device
        self.pieces = host.pieces
        self.feedback = DeviceFeedback(host.feedback, device, host.pieces) if host.feedback is not None else None
        self.cuda = load_cuda()
        self._twins: dict[int, object] = {}
        self.status = status if status is not None else DeviceStatus(self.cuda, device)
        self.defer_decode_checks = defer_decode_checks
        self.frame_memory = frame_memory if frame_memory is not None else FrameMemory(self.status)
        #: Decodes per shard since the status was last read (its ``reads`` at ``_slots_read``):
        #: each takes a pinned staging buffer of its own, which the host may not rewrite
        #: before that read (``_staging_key``).
        self._slots: dict = {}
        self._slots_read = -1
        self._device_frames: dict = {}
        self._staging: dict = {}
        self._host_frames: dict = {}
        self._host_staging: dict = {}
        #: Every frame goes by table: a fixed number of launches, whatever its pieces
        #: (:mod:`mpigrad.codecs.device.table`).
        from ...codecs.device import kernels, table  # numba's CUDA: only where a device path is built

        self._kernels, self._table = kernels, table
        self._tables = table.TableKernels(self.cuda, self._current_stream)
        self._table_buffers: dict = {}
        self._host_table_buffers: dict = {}
        #: Each shard's encode tables by its codecs (the last TEMPLATES_PER_SHARD used), and
        #: the one its device table buffer holds.
        self._templates: dict = {}
        self._device_tables: dict = {}

    @property
    def calls(self) -> list[int]:
        return self.host.calls

    def capacity(self, shard: Shard, bits: list[int]) -> int:
        return self.host.capacity(shard, bits)

    def exact_capacity(self, shard: Shard, bits: list[int]) -> int | None:
        return self.host.exact_capacity(shard, bits)

    def _twin(self, codec):
        twin = self._twins.get(id(codec))
        if twin is None or twin.codec is not codec:
            twin = self._twins[id(codec)] = device_codec(codec, self._current_stream)
        return twin

    def _buffers(self, key, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device frame buffer of ``key`` and its pinned host twin, grown as needed (the
        pair known to :attr:`frame_memory`)."""
        device, host = (self._device_buffer(self._device_frames, key, capacity),
                        self._pinned_buffer(self._host_frames, key, capacity))
        self.frame_memory.encoded((id(self), key), host, device)
        return device, host

    def _pinned_buffer(self, buffers: dict, key, capacity: int) -> torch.Tensor:
        """A host buffer of at least ``capacity`` bytes in pinned memory (a GPU's copies to
        and from it can be asynchronous), grown as needed."""
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < capacity:
            buffer = buffers[key] = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return buffer

    def _device_buffer(self, buffers: dict, key, capacity: int) -> torch.Tensor:
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < capacity:
            buffer = buffers[key] = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        return buffer

    def _view(self, tensor: torch.Tensor):
        return device_view(self.cuda, tensor)

    def _current_stream(self):
        """Where the next launch or copy goes (:func:`current_stream`); the twins ask it too."""
        return current_stream(self.cuda, self.device)

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, grad: torch.Tensor, bits: list[int], shard: Shard, out: np.ndarray | None = None) -> np.ndarray:
        """The host frame of ``shard``'s pieces of the flat device ``grad``: a view of a
        pinned buffer reused per shard (and bucket), valid until the next encode of it; or,
        with ``out`` (uint8, at least ``capacity`` bytes), that frame copied into ``out`` (a
        host copy) and a view of it returned.
        Unlike the host compressor, an encode refused (CodecError: a NaN, a range beyond
        float32) has advanced the RNG counters and the error memory already: the run ends
        there anyway (an error frame)."""
        if out is not None and out.size < self.capacity(shard, bits):
            raise ValueError(f"out= holds {out.size} bytes, the frame may need {self.capacity(shard, bits)}")
        frame = self.encode_shards(grad, bits, [shard])[0]
        if out is None:
            return frame
        out[:frame.size] = frame
        return out[:frame.size]

    def encode_shards(self, grad: torch.Tensor, bits: list[int], shards) -> list[np.ndarray]:
        """:meth:`encode` of each of ``shards``, in turn (the same frames, RNG draws and error
        memory), with one wait for the device for them all: every shard's kernels and copies
        are queued first (each shard has its own buffers), then the status covers them all
        (and any decode queued before, whose error it raises first)."""
        queued = self._queue_shards(grad, bits, shards)
        self.status.wait([twin for _, _, twins in queued for twin in twins])
        return _host_frames(queued)

    def queue_shards(self, grad: torch.Tensor, bits: list[int], shards) -> "QueuedFrames":
        """:meth:`encode_shards` without the wait: their kernels and copies queued, with the
        status slots' copy and an event behind them (:meth:`DeviceStatus.queue_read`, one
        pinned read buffer per first shard: at most one queue of it in flight); the frames
        come from :meth:`QueuedFrames.frames`. A pipelined backward queues each bucket from
        its hook and sends it once its event has completed, so that no hook waits."""
        queued = self._queue_shards(grad, bits, shards)
        pending = list(self.status.pending)
        host, event = self.status.queue_read((shards[0].server, shards[0].bucket))
        return QueuedFrames(self.status, queued, host, event, pending)

    def _queue_shards(self, grad: torch.Tensor, bits: list[int], shards) -> list:
        try:
            return [self._queue_encode(grad, bits, shard) for shard in shards]
        except BaseException:
            self.status.clear()
            raise

    def _queue_encode(self, grad: torch.Tensor, bits: list[int], shard: Shard):
        """Queue the kernels writing ``shard``'s frame and its asynchronous copy into the
        shard's pinned host frame; return that frame (as NumPy), the pieces' (position,
        header) and the codecs' twins. The host frame is valid once the stream is waited for."""
        host = self.host
        capacity = host.capacity(shard, bits)
        frame, host_frame = self._buffers((shard.server, shard.bucket), capacity)
        out = host_frame.numpy()
        frame_view = self._view(frame)
        pos = FrameHeader.size(len(shard.pieces))
        codecs = [host.codec_for(piece, bits[piece.layer]) for piece in shard.pieces]
        twins = [self._twin(codec) for codec in codecs]
        headers, pos = self._queue_table_encode(grad, shard, codecs, twins, frame_view, pos)
        copied("to_host", pos)
        # The packed bytes, and nothing else, into pinned memory: asynchronous on a GPU,
        # waited for with the status.
        host_frame[:pos].copy_(frame[:pos], non_blocking=True)
        return out, headers, twins

    def _queue_table_encode(self, grad: torch.Tensor, shard: Shard, codecs, twins, frame_view, pos: int):
        """Queue the frame's kernels by table (three launches, whatever its pieces); return
        the pieces' (position, header) and the frame's length. The table of a shard at given
        codecs (bits) is built once (:class:`EncodeTemplate`); a later frame only draws each
        stochastic piece's next RNG key into it, and copies to the device no more than the
        piece rows that hold those keys."""
        key = (shard.server, shard.bucket)
        templates = self._templates.setdefault(key, collections.OrderedDict())
        ident = tuple(map(id, codecs))
        template = templates.get(ident)
        if template is None:
            template = templates[ident] = self._build_template(shard, codecs, twins, pos)
            if len(templates) > TEMPLATES_PER_SHARD:
                templates.popitem(last=False)
        else:
            templates.move_to_end(ident)
            template.draw(self.host.calls, self.feedback)
        feedback = self.feedback
        device_table = self._device_table(template, key)
        memory = (self._view(feedback.memory), self._view(feedback.compensated)) if feedback else (None, None)
        self._tables.encode(template.table, device_table, self._view(grad), frame_view, self.status.slots, *memory)
        return template.headers, template.end

    def _build_template(self, shard: Shard, codecs, twins, pos: int) -> "EncodeTemplate":
        """The table of ``shard``'s frame at ``codecs``, its keys drawn for this frame (the
        RNG counters and the error memory's record advanced as every encode advances them)."""
        table, headers, calls, feedback = self._table.FrameTable(encode=True), [], self.host.calls, self.feedback
        mode = feedback.kernel_mode if feedback else self._kernels.NO_FEEDBACK
        draws = []
        for piece, codec, twin in zip(shard.pieces, codecs, twins):
            if piece.quantized:
                codec.calls = calls[piece.index]
                keys = table.key_count
                header = table.add_encode(twin, piece.offset, piece.size, pos + HEADER_SIZE, mode,
                                          feedback.decay if feedback else 1.0)
                draws.append((piece.index, codec, twin, keys if table.key_count > keys else None))
                calls[piece.index] = codec.calls
                if feedback:
                    feedback.remembered(piece.index)
            else:
                header = table.add_encode(twin, piece.offset, piece.size, pos + HEADER_SIZE)
            headers.append((pos, header))
            pos += HEADER_SIZE + header.payload_len
        draws = [(index, codec, twin, None if i is None else table.key_slot(i)) for index, codec, twin, i in draws]
        return EncodeTemplate(table, table.array(), headers, pos, draws)

    def _device_table(self, template: "EncodeTemplate", key):
        """An encode's table on the device (int64, a numba view), through the pinned buffer
        of ``key`` and one asynchronous copy (the encode waits before its next use): the
        whole table, or where the device buffer of ``key`` holds this template's already,
        only its section of piece rows (which holds the keys), and only if a key changed."""
        array, table = template.array, template.table
        pinned = self._pinned_buffer(self._host_table_buffers, key, array.nbytes)
        device = self._device_buffer(self._table_buffers, key, array.nbytes)
        start, stop = 0, array.size
        if self._device_tables.get(key) is template:
            start, stop = table.sections()["pieces"] if template.stochastic else (0, 0)
        self._device_tables.pop(key, None)  # until the copy is queued
        if stop > start:
            pinned[8 * start:8 * stop].numpy()[:] = array[start:stop].view(np.uint8)
            copied("to_device", 8 * (stop - start))
            device[8 * start:8 * stop].copy_(pinned[8 * start:8 * stop], non_blocking=True)
        self._device_tables[key] = template
        return self._view(device[:array.nbytes].view(torch.int64))

    def decode(self, frame: np.ndarray, shard: Shard, out: torch.Tensor, *, accumulate: bool = False) -> float:
        """Decode ``shard``'s host frame into the flat device ``out`` (or add to it); return
        the sender's encode seconds. As the host compressor's: a caller that gets an error
        must not use ``out``. The frame's header and lengths are checked here; its payload's
        scales and codes by the kernels, whose status this call waits for, or with
        ``defer_decode_checks`` leaves to the next read of :attr:`status` (an encode's wait,
        or :func:`check_decodes`): ``out`` is then to be used only after that read.
        Where ``frame`` lies in memory :attr:`frame_memory` knows, the device reads it from
        there: from a pinned receive buffer, which is then to be written again only through
        its ``ReceiveBuffers.take``; from an encode's host frame, whose payloads are read in
        the encode's device frame buffer, so that a change the host made to them after the
        encode is not seen (only the headers, read on the host, are the host frame's)."""
        encode_seconds, buffers = FrameHeader.read(frame, len(shard.pieces))
        checked = []
        for piece, buf in zip(shard.pieces, buffers):
            codec = (self.host.piece_codecs.get(piece.index, self.host.decoder) if piece.quantized
                     else self.host.rest_codec)
            twin = self._twin(codec)
            header = twin.check(buf)
            if header.n != piece.size:  # the kernels write n values where the piece has its size
                raise CodecError(f"out= holds {piece.size} elements, buffer encodes {header.n}")
            checked.append((piece, twin, header))
        twins = [twin for _, twin, _ in checked]
        first = FrameHeader.size(len(shard.pieces))
        table, pos = self._table.FrameTable(encode=False), first
        for piece, twin, header in checked:
            table.add_decode(twin, header, piece.offset, pos + HEADER_SIZE)
            pos += HEADER_SIZE + header.payload_len
        array = table.array().view(np.uint8)
        # The device staging: the frame, then its table (8-byte aligned); only the table where
        # the frame's payloads are on the device already (an encode's on this replica).
        located = self.frame_memory.locate(frame)
        buffer, offset = located if located is not None else (None, 0)
        resident = buffer is not None and buffer.device is not None
        at = 0 if resident else -(-frame.size // 8) * 8
        size = at + array.size
        # One device buffer per shard (the stream orders its reuse); a pinned one per frame.
        staging = self._device_buffer(self._staging, (shard.server, shard.bucket), size)
        staged = 0  # where the bytes staged through pinned memory begin
        if buffer is not None and not resident:  # received into pinned memory: copied from there
            copied("to_device", frame.size)
            staging[:frame.size].copy_(buffer.host[offset:offset + frame.size], non_blocking=True)
            self.frame_memory.copied_out(buffer, self._current_stream())
            staged = at
        # The rest through a pinned staging buffer: pinned[i] goes to staging[staged + i].
        pinned = self._pinned_buffer(self._host_staging, self._staging_key(shard), size - staged)
        if buffer is None:
            pinned[:frame.size].numpy()[:] = frame  # a host copy: the copy to the device is then asynchronous
        pinned[at - staged:size - staged].numpy()[:] = array
        copied("to_device", size - staged)
        staging[staged:size].copy_(pinned[:size - staged], non_blocking=True)  # waited for with the status
        view = self._view(buffer.device[offset:offset + frame.size] if resident else staging)
        try:
            self._tables.decode(table, self._view(staging[at:size].view(torch.int64)), view, self._view(out),
                                accumulate, self.status.slots)
        except BaseException:  # the copy out of the pinned buffer may still run: let it end first
            self.status.clear()
            raise
        if self.defer_decode_checks:
            self.status.pending.extend(twins[:1])
        else:
            self.status.wait(twins)
        return encode_seconds

    def _staging_key(self, shard: Shard) -> tuple:
        """The pinned staging buffer of the next decode of ``shard``'s frames: its own until
        the status is next read (the host writes it before the device has copied the previous
        frame out of it: a deferred decode's copy may still be queued). Deferred decodes and
        that read are on one stream (the runtime's iteration keeps one)."""
        if self._slots_read != self.status.reads:
            self._slots, self._slots_read = {}, self.status.reads
        key = (shard.server, shard.bucket)
        slot = self._slots[key] = self._slots.get(key, -1) + 1
        return (*key, slot)

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The host compressor's state, with the device error memory as its ``feedback``."""
        state = _without_feedback(self.host, lambda host: host.state_dict())
        if self.feedback is not None:
            state["feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        rest = {key: value for key, value in state.items() if key != "feedback"}
        _without_feedback(self.host, lambda host: host.load_state_dict(rest))
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])


#: Encode tables kept per shard: one per choice of bits a policy returns to (a fixed policy
#: uses one; an adaptive one moves between neighbouring choices).
TEMPLATES_PER_SHARD = 8


@dataclasses.dataclass
class EncodeTemplate:
    """A shard's frame table at one choice of codecs (:meth:`DeviceGradientCompressor.
    _build_template`): the table, its int64 array, the pieces' (position, header), the
    frame's length, and per quantized piece (its index, codec, twin, and the slot of its RNG
    key in the array where it rounds stochastically, else None)."""

    table: object
    array: np.ndarray
    headers: list
    end: int
    draws: list

    @property
    def stochastic(self) -> bool:
        """Whether a piece's key changes from frame to frame."""
        return any(slot is not None for *_, slot in self.draws)

    def draw(self, calls: list[int], feedback) -> None:
        """The next frame's keys into the array, with the state an encode advances: each
        quantized piece's RNG counter (``calls``) and the error memory's record of it."""
        for index, codec, twin, slot in self.draws:
            codec.calls = calls[index]
            if slot is not None:
                self.table.write_key(self.array, slot, twin.next_key())
            calls[index] = codec.calls
            if feedback:
                feedback.remembered(index)


def _host_frames(queued) -> list[np.ndarray]:
    """The host frames of ``queued`` encodes (``_queue_encode``'s), their copies complete:
    each piece's header and the frame's lengths written in front of the packed bytes."""
    frames = []
    for out, headers, _ in queued:
        for start, header in headers:
            out[start:start + HEADER_SIZE] = header_bytes(header)
        frames.append(out[:FrameHeader.write(out, [HEADER_SIZE + h.payload_len for _, h in headers])])
    return frames


class QueuedFrames:
    """Frames queued on the device (:meth:`DeviceGradientCompressor.queue_shards`): their
    kernels, their copies into pinned memory and the status slots' copy, with an event
    after them (None under the simulator: done at the call)."""

    def __init__(self, status: DeviceStatus, queued: list, host_slots, event, pending: list):
        self.status, self.queued, self.host_slots, self.event, self.pending = status, queued, host_slots, event, pending

    def ready(self) -> bool:
        """Whether the device has done them (asks the event; no synchronisation)."""
        return self.event is None or self.event.query()

    def wait(self, site: str = "frames after backward") -> None:
        """Wait for them (a synchronisation, counted at ``site``) unless :meth:`ready`."""
        if not self.ready():
            synchronized(site)
            self.event.synchronize()

    def frames(self) -> list[np.ndarray]:
        """The host frames, once :meth:`ready` (or waited for); CodecError where the status
        read behind them is flagged, as :meth:`DeviceStatus.wait` raises."""
        if not self.ready():
            raise RuntimeError("QueuedFrames.frames() before the device did them: wait() first")
        self.status.settle(self.host_slots, [twin for _, _, twins in self.queued for twin in twins], self.pending)
        return _host_frames(self.queued)


def _without_feedback(host: GradientCompressor, call):
    """``call(host)`` with the host's (unused) error memory set aside."""
    feedback, host.feedback = host.feedback, None
    try:
        return call(host)
    finally:
        host.feedback = feedback
