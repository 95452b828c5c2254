"""The device path: gradients encoded and decoded where they live, only packed bytes cross.

With ``--device cuda`` and codecs that have GPU kernels (:mod:`mpigrad.codecs.device`), a
:class:`DeviceGradientCompressor` stands where the host's
:class:`~.compressor.GradientCompressor` stands, with the same frames: it encodes a shard
of a flat gradient that stays in device memory into a device frame buffer (the error
memory on the device too), copies the packed bytes, and nothing else, into a pinned host
frame, and writes the headers there; it decodes a received host frame by copying its bytes
to the device once (through pinned memory) and adding every piece into a device buffer.
One status array per frame carries the kernels' refusals; its copy back goes after the
frame's kernels and copies on the same stream, all asynchronous, so that each frame, encoded
or decoded, waits for the device once.

Without a GPU the same path runs in Numba's CUDA simulator over CPU tensors
(``NUMBA_ENABLE_CUDASIM=1`` and ``MPIGRAD_DEVICE_CODECS=simulator``): how CI tests it.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from ..codecs import CodecError, HEADER_SIZE
from ..codecs.base import header_bytes
from ..codecs.device import DeviceUnavailable, device_codec, host_only, load_cuda
from ..codecs.device.counters import copied, launched, synchronized
from ..feedback import ErrorFeedback
from .compressor import GradientCompressor
from .layout import Shard
from .wire.messages import FrameHeader

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
    the device; the host compressors as they are where a codec has no kernels (rank 0's
    ``codecs:`` line says why). DeviceUnavailable (one line naming the extra, and
    ``MPIGRAD_DEVICE_CODECS=host``) where every codec has kernels but numba-cuda is
    missing, broken or sees no device: a run the user expects on the GPU is refused rather
    than silently run many times slower on the host."""
    if not device_path(replica.device) or host_reasons([c for comp in compressors for c in compressor_codecs(comp)]):
        return list(compressors)
    try:
        load_cuda()
    except DeviceUnavailable as exc:
        raise DeviceUnavailable(f"{exc} (or {ENVIRONMENT}=host: the codecs on the host, the whole gradient "
                                "copied out every iteration)") from None
    replica.use_device_codecs()
    twins: dict[int, DeviceGradientCompressor] = {}
    for c in compressors:
        if id(c) not in twins:
            twins[id(c)] = DeviceGradientCompressor(c, replica.device)
    return [twins[id(c)] for c in compressors]


def codec_path(config, codecs) -> str | None:
    """rank 0's start-up line on where the workers run ``codecs`` (the run's codec objects),
    for a run on a GPU or on the simulator's device path; None for a CPU run."""
    from .gpu import workers_device

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


class DeviceFeedback:
    """The error memory of :class:`~mpigrad.feedback.ErrorFeedback` in device tensors, with
    the same float operations (so the same memory, bit for bit) and the same state_dict."""

    def __init__(self, host: ErrorFeedback, device: torch.device):
        self.mode, self.decay, self.device = host.mode, host.decay, device
        self.errors: dict[int, torch.Tensor] = {}
        self.compensated: dict[int, torch.Tensor] = {}

    def compensate(self, key: int, g: torch.Tensor) -> torch.Tensor:
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = torch.zeros_like(g)
            self.compensated[key] = torch.empty_like(g)
        p = self.compensated[key]
        launched("torch", 1 if self.decay == 1.0 else 2)
        if self.decay == 1.0:
            torch.add(g, error, out=p)
        else:
            torch.mul(error, np.float32(self.decay).item(), out=p)
            p.add_(g)
        return p

    def update(self, key: int, p: torch.Tensor, decoded: torch.Tensor) -> None:
        launched("torch", 1 if self.mode == "residual" else 2)
        if self.mode == "residual":
            torch.sub(p, decoded, out=self.errors[key])
        else:
            torch.mul(p, decoded == 0, out=self.errors[key])

    def state_dict(self) -> dict:
        return {"mode": self.mode, "decay": self.decay,
                "memory": {key: e.cpu().numpy().copy() for key, e in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        host = ErrorFeedback(self.mode, self.decay)
        host.load_state_dict(state)  # its checks
        self.errors = {key: torch.from_numpy(host.error(key).copy()).to(self.device) for key in host.keys()}
        self.compensated = {key: torch.empty_like(e) for key, e in self.errors.items()}


class DeviceGradientCompressor:
    """Hyperparameters: the host compressor it mirrors (pieces, codec configs and
    instances, RNG counters: its ``state_dict`` is the host one's) and the device. State:
    each codec instance's device twin, the device error memory, the device and pinned
    frame buffers. ``encode``/``decode`` take device tensors and host frames."""

    def __init__(self, host: GradientCompressor, device: torch.device):
        reasons = host_reasons(compressor_codecs(host))
        if reasons:
            raise CodecError("; ".join(reasons))
        from ..codecs.device import kernels as k
        self.host, self.device = host, device
        self.pieces = host.pieces
        self.feedback = DeviceFeedback(host.feedback, device) if host.feedback is not None else None
        self.cuda = load_cuda()
        self._twins: dict[int, object] = {}
        self._status = self.cuda.device_array(k.STATUS_SLOTS, np.int32)
        self._zeros = self.cuda.pinned_array(k.STATUS_SLOTS, np.int32)
        self._zeros[:] = 0
        #: The status read back, in pinned memory: its copy is asynchronous, waited for once.
        self._status_host = self.cuda.pinned_array(k.STATUS_SLOTS, np.int32)
        self._device_frames: dict = {}
        self._staging: dict = {}
        self._host_frames: dict = {}
        self._host_staging: dict = {}
        self._scratch = torch.empty(max([p.size for p in self.pieces if p.quantized], default=0),
                                    dtype=torch.float32, device=device)

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
        """The device frame buffer of ``key`` and its pinned host twin, grown as needed."""
        return (self._device_buffer(self._device_frames, key, capacity),
                self._pinned_buffer(self._host_frames, key, capacity))

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

    def _reset_status(self) -> None:
        copied("to_device", self._zeros.nbytes)
        self._status.copy_to_device(self._zeros, stream=self._current_stream())

    def _wait_and_check_status(self, twins) -> None:
        """The frame's one wait: its status copied back (asynchronously, into pinned memory)
        behind everything queued on the stream before it (the frame's kernels and copies),
        then one synchronisation of that stream. Raise what the status says, in the wording
        of the first codec that flagged (every flag of the frame is in one array: the first
        twin's wording serves them all)."""
        copied("to_host", self._zeros.nbytes)
        stream = self._current_stream()
        status = self._status.copy_to_host(self._status_host, stream=stream)
        synchronized("frame and status")
        if not simulated():
            stream.synchronize()
        if status.any():
            twins[0].raise_status(status.copy())

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, grad: torch.Tensor, bits: list[int], shard: Shard) -> np.ndarray:
        """The host frame of ``shard``'s pieces of the flat device ``grad``: a view of a
        pinned buffer reused per shard (and bucket), valid until the next encode of it.
        Unlike the host compressor, an encode refused (CodecError: a NaN, a range beyond
        float32) has advanced the RNG counters and the error memory already: the run ends
        there anyway (an error frame)."""
        return self.encode_shards(grad, bits, [shard])[0]

    def encode_shards(self, grad: torch.Tensor, bits: list[int], shards) -> list[np.ndarray]:
        """:meth:`encode` of each of ``shards``, in turn (the same frames, RNG draws and error
        memory), with one wait for the device for them all: every shard's kernels and copies
        are queued first (each shard has its own buffers), then the status covers them all."""
        self._reset_status()
        queued = [self._queue_encode(grad, bits, shard) for shard in shards]
        self._wait_and_check_status([twin for _, _, twins in queued for twin in twins])
        frames = []
        for out, headers, _ in queued:
            for start, header in headers:
                out[start:start + HEADER_SIZE] = header_bytes(header)
            frames.append(out[:FrameHeader.write(out, [HEADER_SIZE + h.payload_len for _, h in headers])])
        return frames

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
        headers, twins = [], []
        for piece in shard.pieces:
            g = grad[piece.offset:piece.offset + piece.size]
            if not piece.quantized:
                twin = self._twin(host.rest_codec)
                header = twin.launch_encode(self._view(g), frame_view, pos + HEADER_SIZE, self._status)
            else:
                codec = host.codec_for(piece, bits[piece.layer])
                twin = self._twin(codec)
                p = self.feedback.compensate(piece.index, g) if self.feedback else g
                codec.calls = host.calls[piece.index]
                header = twin.launch_encode(self._view(p), frame_view, pos + HEADER_SIZE, self._status)
                host.calls[piece.index] = codec.calls
                if self.feedback:
                    decoded = self._scratch[:piece.size]
                    payload = frame_view[pos + HEADER_SIZE:pos + HEADER_SIZE + header.payload_len]
                    twin.launch_decode(header, payload, self._view(decoded), False, self._status)
                    self.feedback.update(piece.index, p, decoded)
            headers.append((pos, header))
            twins.append(twin)
            pos += HEADER_SIZE + header.payload_len
        copied("to_host", pos)
        # The packed bytes, and nothing else, into pinned memory: asynchronous on a GPU,
        # waited for with the status.
        host_frame[:pos].copy_(frame[:pos], non_blocking=True)
        return out, headers, twins

    def decode(self, frame: np.ndarray, shard: Shard, out: torch.Tensor, *, accumulate: bool = False) -> float:
        """Decode ``shard``'s host frame into the flat device ``out`` (or add to it); return
        the sender's encode seconds. As the host compressor's: a caller that gets an error
        must not use ``out``."""
        encode_seconds, buffers = FrameHeader.read(frame, len(shard.pieces))
        checked = []
        for piece, buf in zip(shard.pieces, buffers):
            codec = (self.host.piece_codecs.get(piece.index, self.host.decoder) if piece.quantized
                     else self.host.rest_codec)
            twin = self._twin(codec)
            checked.append((piece, twin, twin.check(buf)))
        key = (shard.server, shard.bucket)
        staging = self._device_buffer(self._staging, key, frame.size)
        pinned = self._pinned_buffer(self._host_staging, key, frame.size)
        pinned[:frame.size].numpy()[:] = frame  # a host copy: the copy to the device is then asynchronous
        copied("to_device", frame.size)
        staging[:frame.size].copy_(pinned[:frame.size], non_blocking=True)  # waited for with the status
        view = self._view(staging)
        pos = FrameHeader.size(len(shard.pieces))
        self._reset_status()
        try:
            for piece, twin, header in checked:
                payload = view[pos + HEADER_SIZE:pos + HEADER_SIZE + header.payload_len]
                twin.launch_decode(header, payload, self._view(out[piece.offset:piece.offset + piece.size]),
                                   accumulate, self._status)
                pos += HEADER_SIZE + header.payload_len
        except BaseException:
            if not simulated():  # the copy out of the pinned buffer may still run: let it end first
                self._current_stream().synchronize()
            raise
        self._wait_and_check_status([twin for _, twin, _ in checked])
        return encode_seconds

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


def _without_feedback(host: GradientCompressor, call):
    """``call(host)`` with the host's (unused) error memory set aside."""
    feedback, host.feedback = host.feedback, None
    try:
        return call(host)
    finally:
        host.feedback = feedback
