"""The device path: gradients encoded and decoded where they live, only packed bytes cross.

With ``--device cuda`` and codecs that have GPU kernels (:mod:`mpigrad.codecs.device`), a
:class:`DeviceGradientCompressor` stands where the host's
:class:`~.compressor.GradientCompressor` stands, with the same frames and the same protocol
(:class:`~.frames.FrameCompressor`): it encodes a shard of a flat gradient that stays in
device memory into a device frame buffer (the error memory on the device too,
:mod:`.device_feedback`), copies the packed bytes, and nothing else, into a pinned host frame,
and writes the headers there; it decodes a received host frame by copying its bytes to the
device once, straight from the pinned buffer MPI received it into (:class:`FrameMemory`,
:mod:`.device_memory`; a frame encoded on the same rank is read where its encode left it),
and adding every piece into a device buffer. Every frame goes by table
(:mod:`.device_tables`): a fixed number of launches, whatever its pieces.
The kernels flag their refusals into one status array per rank (:class:`DeviceStatus`,
:mod:`.device_stream`, with the streams the path launches on), whose copy back goes after the
frames' kernels and copies on the same stream, all asynchronous: an encode waits for the
device once (its frame goes on the wire), and the runtime's decodes wait for nothing, their
status read once per iteration (:func:`check_decodes`).

This module keeps the compressor and the choice of path (:func:`on_device`,
:func:`codec_path`; the hierarchical exchange keeps the codecs on the host, its slices host
arrays: :func:`exchange_host_reason`); the names the roles import from it (``on_device``,
``check_decodes``, ``finite``, ``current_stream``, ``device_view``, ``synchronize``,
``DeviceStatus``, ``FrameMemory``, ...) stay importable from here.

Without a GPU the same path runs in Numba's CUDA simulator over CPU tensors
(``NUMBA_ENABLE_CUDASIM=1`` and ``MPIGRAD_DEVICE_CODECS=simulator``): how CI tests it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ...codecs import CodecError, HEADER_SIZE
from ...codecs.base import header_bytes
from ...codecs.device import DeviceUnavailable, device_codec, host_only, load_cuda
from ...counters import copied, synchronized
from .compressor import GradientCompressor
from .device_feedback import DeviceFeedback
from .device_memory import FrameMemory, HostBuffer, StagingSlots, device_buffer, pinned_buffer
from .device_stream import (DeviceStatus, check_decodes, current_stream, device_view, finite, simulated,
                            simulated_stream, synchronize)
from .build import hierarchical_exchange
from .device_tables import TEMPLATES_PER_SHARD, EncodeTables, EncodeTemplate
from .frames import EncodedFrames
from ..plan.layout import Shard
from ..wire.messages import FrameHeader

__all__ = ["ENVIRONMENT", "device_path", "exchange_host_reason", "host_reasons", "compressor_codecs", "on_device",
           "codec_path", "DeviceGradientCompressor", "QueuedFrames",
           # re-exported from the device_* modules, where they live
           "simulated", "finite", "device_view", "current_stream", "simulated_stream", "synchronize",
           "DeviceStatus", "check_decodes", "HostBuffer", "FrameMemory", "DeviceFeedback", "EncodeTemplate",
           "TEMPLATES_PER_SHARD", "load_cuda"]

#: ``MPIGRAD_DEVICE_CODECS=simulator`` runs the device path over CPU tensors in Numba's
#: CUDA simulator (tests without a GPU); ``host`` keeps a CUDA run on the host path.
ENVIRONMENT = "MPIGRAD_DEVICE_CODECS"


def device_path(device: torch.device) -> bool:
    """Whether a replica on ``device`` takes the device path."""
    choice = os.environ.get(ENVIRONMENT, "")
    if device.type == "cuda":
        return choice != "host"
    return choice == "simulator" and simulated()


def exchange_host_reason(config) -> str | None:
    """Why a run of ``config`` keeps its codecs on the host whatever its device (its way of
    aggregating works on host arrays: the hierarchical exchange's slices), else None."""
    if hierarchical_exchange(config):
        return "the hierarchical exchange's slices are host arrays"
    return None


def host_reasons(codecs) -> list[str]:
    """Why each of ``codecs`` (host codec objects) keeps the host path, one line each."""
    return sorted({reason for reason in map(host_only, codecs) if reason})


def compressor_codecs(compressor: GradientCompressor) -> list:
    """The codec objects ``compressor`` encodes and decodes with."""
    return [compressor.decoder, compressor.rest_codec, *compressor.piece_codecs.values()]


def on_device(replica, *compressors, host_reason: str | None = None) -> list:
    """``compressors`` as the replica's path takes them: on the device path (a replica on a
    GPU, or the simulator asked for), unless the run's exchange keeps them on the host
    (``host_reason``, :func:`exchange_host_reason`), when every codec has kernels and
    numba-cuda loads, their device twins (one per distinct object) with the replica's codec
    buffers moved to the device, flagging into one :class:`DeviceStatus` (``replica.device_status``), their
    frames in one :class:`FrameMemory` (``replica.frame_memory``), and leaving their
    decodes' status to :func:`check_decodes`; the host compressors as they are where a codec
    has no kernels (rank 0's ``codecs:`` line says why).
    DeviceUnavailable (one line naming the extra, and ``MPIGRAD_DEVICE_CODECS=host``) where
    every codec has kernels but numba-cuda is missing, broken or sees no device: a run the
    user expects on the GPU is refused rather than silently run many times slower on the
    host."""
    if (not device_path(replica.device) or host_reason is not None
            or host_reasons([c for comp in compressors for c in compressor_codecs(comp)])):
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
    exchange = exchange_host_reason(config)
    # numba-cuda itself is no reason here: the workers refused to start without it (on_device)
    reasons = ([exchange] if exchange else []) + host_reasons(codecs)
    if reasons:
        return f"codecs: on the host, the whole gradient copied out every iteration: {'; '.join(reasons)}"
    where = "in Numba's CUDA simulator" if device.type == "cpu" else "on the GPU"
    return (f"codecs: {where} (Numba CUDA kernels): gradients encoded and updates decoded in device memory, "
            "the packed frames staged through pinned host memory")



class DeviceGradientCompressor:
    """Hyperparameters: the host compressor it mirrors (pieces, codec configs and
    instances, RNG counters: its ``state_dict`` is the host one's), the device, the
    :class:`DeviceStatus` its frames flag into (its own unless given), whether a decode
    leaves its status to a later read (``defer_decode_checks``: the runtime's, which reads it
    once per iteration, :func:`check_decodes`) and the :class:`FrameMemory` of its host frames
    (its own unless given: the runtime's compressors share the replica's, so that a decode
    finds the frames the others encoded and the receive buffers). State: each codec
    instance's device twin, the device error memory, the device and pinned frame buffers,
    the encode tables (:class:`~.device_tables.EncodeTables`).
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
        #: Each decode's pinned staging buffer of its own until the status is next read.
        self._slots = StagingSlots()
        self._device_frames: dict = {}
        self._staging: dict = {}
        self._host_frames: dict = {}
        self._host_staging: dict = {}
        #: Every frame goes by table: a fixed number of launches, whatever its pieces
        #: (:mod:`mpigrad.codecs.device.table`).
        from ...codecs.device import kernels, table  # numba's CUDA: only where a device path is built

        self._table = table
        self._tables = table.TableKernels(self.cuda, self._current_stream)
        self._encode_tables = EncodeTables(table, kernels.NO_FEEDBACK, device, self._view)

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
        device, host = (device_buffer(self._device_frames, key, capacity, self.device),
                        pinned_buffer(self._host_frames, key, capacity, self.device))
        self.frame_memory.encoded((id(self), key), host, device)
        return device, host

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

    def queue_shards(self, grad: torch.Tensor, bits: list[int], shards) -> "QueuedFrames | EncodedFrames":
        """:meth:`encode_shards` without the wait: their kernels and copies queued, with the
        status slots' copy and an event behind them (:meth:`DeviceStatus.queue_read`, one
        pinned read buffer per first shard: at most one queue of it in flight); the frames
        come from :meth:`QueuedFrames.frames`. A pipelined backward queues each bucket from
        its hook and sends it once its event has completed, so that no hook waits. No shards:
        nothing queued, frames that are ready (:class:`~.frames.EncodedFrames`), as the host's."""
        if not shards:
            return EncodedFrames([])
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
        codecs (bits) is built once (:class:`~.device_tables.EncodeTables`); a later frame only
        draws each stochastic piece's next RNG key into it, and copies to the device no more
        than the piece rows that hold those keys."""
        template = self._encode_tables.template(shard, codecs, twins, pos, self.host.calls, self.feedback)
        feedback = self.feedback
        device_table = self._encode_tables.on_device(template, (shard.server, shard.bucket))
        memory = (self._view(feedback.memory), self._view(feedback.compensated)) if feedback else (None, None)
        self._tables.encode(template.table, device_table, self._view(grad), frame_view, self.status.slots, *memory)
        return template.headers, template.end

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
        encode_seconds, table, twins = self._decode_table(frame, shard)
        array = table.array().view(np.uint8)
        # The device staging: the frame, then its table (8-byte aligned); only the table where
        # the frame's payloads are on the device already (an encode's on this replica).
        located = self.frame_memory.locate(frame)
        buffer, offset = located if located is not None else (None, 0)
        resident = buffer is not None and buffer.device is not None
        at = 0 if resident else -(-frame.size // 8) * 8
        size = at + array.size
        # One device buffer per shard (the stream orders its reuse); a pinned one per frame.
        staging = device_buffer(self._staging, (shard.server, shard.bucket), size, self.device)
        staged = 0  # where the bytes staged through pinned memory begin
        if buffer is not None and not resident:  # received into pinned memory: copied from there
            copied("to_device", frame.size)
            staging[:frame.size].copy_(buffer.host[offset:offset + frame.size], non_blocking=True)
            self.frame_memory.copied_out(buffer, self._current_stream())
            staged = at
        # The rest through a pinned staging buffer: pinned[i] goes to staging[staged + i].
        pinned = pinned_buffer(self._host_staging, self._staging_key(shard), size - staged, self.device)
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

    def _decode_table(self, frame: np.ndarray, shard: Shard):
        """The sender's encode seconds, the decode table of ``shard``'s host ``frame`` (its
        header and lengths checked here, CodecError or FrameError where they are bad) and the
        pieces' twins."""
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
        table, pos = self._table.FrameTable(encode=False), FrameHeader.size(len(shard.pieces))
        for piece, twin, header in checked:
            table.add_decode(twin, header, piece.offset, pos + HEADER_SIZE)
            pos += HEADER_SIZE + header.payload_len
        return encode_seconds, table, [twin for _, twin, _ in checked]

    def _staging_key(self, shard: Shard) -> tuple:
        """The pinned staging buffer of the next decode of ``shard``'s frames: its own until
        the status is next read (:class:`~.device_memory.StagingSlots`)."""
        return self._slots.key((shard.server, shard.bucket), self.status.reads)

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
