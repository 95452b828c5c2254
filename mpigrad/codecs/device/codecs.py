"""Device twins of the host codecs: the same frames, written and read by CUDA kernels.

A twin holds its host codec (config, header fields, RNG counter: ``state_dict`` stays the
host codec's) and device scratch arrays grown as needed. ``encode`` and ``decode`` check
the kernels' status before returning (one small device-to-host copy, which synchronises
the stream): a frame is never returned, and ``out`` never written by a decode, when the
host codec would have refused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..base import HEADER_SIZE, CodecError, Header, header_bytes, non_finite_error, read_header, wire_owner
from ..checks import bucket_layout
from ..kernels.half import HALF_TO_FLOAT
from . import kernels as k
from . import host_only, load_cuda
from ...counters import copied, launched, synchronized

_EMPTY = np.zeros(0, np.uint8)


def as_device_array(cuda, array, what: str):
    """A numba device array of ``array`` (a numba device array or any object with
    ``__cuda_array_interface__``, e.g. a torch CUDA tensor: no copy); CodecError otherwise."""
    if cuda.devicearray.is_cuda_ndarray(array):
        return array
    if not (hasattr(cuda, "is_cuda_array") and cuda.is_cuda_array(array)):  # the simulator has neither
        raise CodecError(f"{what} must be a CUDA array (a torch CUDA tensor or a numba device array), "
                         f"got {type(array).__name__}")
    return cuda.as_cuda_array(array)


def launch_kernel(kernel, grid: int, stream, *args) -> None:
    """Launch ``kernel`` on ``grid`` blocks of ``k.THREADS`` threads on ``stream``, counted:
    every launch of the device codecs goes through here."""
    launched(kernel=kernel.py_func.__name__)
    kernel[grid, k.THREADS, stream](*args)


class ScratchArrays:
    """Device scratch arrays by name, each grown as needed and never shrunk."""

    def __init__(self, cuda):
        self.cuda = cuda
        self._arrays: dict[str, object] = {}

    def array(self, name: str, size: int, dtype, stream):
        """Scratch array ``name`` with at least ``size`` elements (a view of exactly
        ``size``), allocated on ``stream`` when it grows."""
        have = self._arrays.get(name)
        if have is None or have.size < size:
            have = self._arrays[name] = self.cuda.device_array(max(size, 1), dtype, stream=stream)
        return have[:size]


class DeviceCodec(ABC):
    """Hyperparameters: the host codec and where its kernels and copies go: ``stream``, a
    zero-argument callable asked at every launch and copy for the stream to use (the
    runtime's gives torch's stream current at the call), or a fixed stream, or None (or 0)
    for numba's default stream. State: the status slots and scratch arrays. The host
    codec's ``checksum`` is refused: a payload CRC would need the payload on the host.

    A twin is found from its codec's row in :data:`mpigrad.codecs.parts.BUILTIN_CODECS`
    (``device``), whose ``kind_code`` its ``kind`` is: the kernels' constant of its codes
    (``kernels.UNIFORM`` ...) or values (``kernels.FLOAT32``, ``FLOAT16``), which the frame
    table's piece rows and the per-piece kernels carry."""

    kind: int

    def __init__(self, codec, stream=None):
        if codec.checksum:
            raise CodecError(f"{codec.codec_id}: checksum=True needs the payload on the host to "
                             "compute its CRC; the device codecs do not write one")
        self.codec = codec
        self.cuda = load_cuda()
        if callable(stream):
            self._stream_source = stream
        else:
            fixed = stream if stream else None
            self._stream_source = (lambda: fixed) if fixed is not None else self.cuda.default_stream
        self._status = self.cuda.device_array(k.STATUS_SLOTS, np.int32)
        self._zeros = np.zeros(k.STATUS_SLOTS, np.int32)
        self._scratch = ScratchArrays(self.cuda)

    @property
    def stream(self):
        """The stream of the next launch or copy: the source's answer at the call, never one
        kept from construction (a caller may switch streams between calls)."""
        return self._stream_source()

    def max_encoded_size(self, n: int) -> int:
        return self.codec.max_encoded_size(n)

    # ---- launching ----------------------------------------------------------------------
    def _launch(self, kernel, threads: int, *args) -> None:
        self._launch_grid(kernel, k.blocks(threads), *args)

    def _launch_grid(self, kernel, grid: int, *args) -> None:
        launch_kernel(kernel, grid, self.stream, *args)

    def _array(self, name: str, size: int, dtype):
        """A device scratch array of at least ``size`` elements (a view of exactly size)."""
        return self._scratch.array(name, size, dtype, self.stream)

    def _reset_status(self) -> None:
        copied("to_device", self._zeros.nbytes)
        self._status.copy_to_device(self._zeros, stream=self.stream)

    def _read_status(self) -> np.ndarray:
        copied("to_host", self._zeros.nbytes)
        stream = self.stream
        status = self._status.copy_to_host(stream=stream)
        synchronized("status read")
        stream.synchronize()
        return status

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, x, out) -> int:
        """Write the frame of device float32 ``x`` (1-D) into device uint8 ``out`` (at least
        ``max_encoded_size(x.size)`` bytes); return its length. CodecError where the host
        codec refuses (NaN, infinity, ranges beyond float32), after the stream's work."""
        cuda = self.cuda
        x = as_device_array(cuda, x, "encode's input")
        out = as_device_array(cuda, out, "encode's out=")
        if x.ndim != 1 or x.dtype != np.float32:
            raise CodecError(f"encode expects a 1-D float32 device array, got {x.ndim}-D {x.dtype}")
        if out.ndim != 1 or out.dtype != np.uint8:
            raise CodecError("out= must be a 1-D uint8 device array")
        size = self.max_encoded_size(x.size)
        if out.size < size:
            raise CodecError(f"out= holds {out.size} bytes, encode may need {size}")
        self._reset_status()
        calls = self.codec.calls
        header = self.launch_encode(x, out, HEADER_SIZE, self._status)
        try:
            self._raise_status(self._read_status())
        except CodecError:
            self.codec.calls = calls  # the host codec draws no stream for an input it refuses
            raise
        copied("to_device", HEADER_SIZE)
        out[:HEADER_SIZE].copy_to_device(header_bytes(header), stream=self.stream)
        return HEADER_SIZE + header.payload_len

    def launch_encode(self, x, out, pos: int, status) -> Header:
        """Launch the kernels writing the payload of device ``x`` at ``out[pos:]`` (checked
        arrays: :meth:`encode` checks them) and flagging refusals in device ``status`` (see
        :meth:`raise_status`); return the header. Nothing waits for the device."""
        fields = self._encode_payload(x, out, pos, status) if x.size else self._empty_fields()
        return Header(self.codec.wire_id, *fields[:4], x.size, fields[4])

    def decode(self, frame: np.ndarray, out, *, accumulate: bool = False) -> None:
        """Decode a frame held on the host (validated there: header, CRC, lengths) into
        device float32 ``out``, or with ``accumulate`` add to it; only the payload is
        copied to the device (through a reused scratch array)."""
        header = self.check(frame)
        payload = self._array("payload", header.payload_len, np.uint8)
        if header.payload_len:
            copied("to_device", header.payload_len)
            payload.copy_to_device(frame[HEADER_SIZE:], stream=self.stream)
        self.decode_payload(header, payload, out, accumulate=accumulate)

    def check(self, frame: np.ndarray) -> Header:
        """The header of host ``frame`` (this codec's), checked as the host codec checks it."""
        header = read_header(frame)
        if header.wire_id != self.codec.wire_id:
            other = wire_owner(header.wire_id)
            name = repr(other.codec_id) if other else f"unknown wire id {header.wire_id}"
            raise CodecError(f"buffer was encoded by codec {name}, not {self.codec.codec_id!r}")
        self.codec._check_payload(header, frame[HEADER_SIZE:])
        return header

    def decode_payload(self, header: Header, payload, out, *, accumulate: bool = False) -> None:
        """Decode a device ``payload`` of a checked ``header`` (:meth:`check`) into ``out``;
        every CodecError is raised before the first write to ``out``."""
        out = as_device_array(self.cuda, out, "decode's out=")
        if out.ndim != 1 or out.dtype != np.float32:
            raise CodecError("out= must be a 1-D float32 device array")
        if out.size != header.n:
            raise CodecError(f"out= holds {out.size} elements, buffer encodes {header.n}")
        if header.n:
            self._reset_status()
            self._check_scales(header, payload, self._status)
            self._raise_status(self._read_status())
            self._decode_values(header, payload, out, accumulate)

    # ---- per codec ----------------------------------------------------------------------
    def _empty_fields(self) -> tuple[int, int, int, int, int]:
        """Header fields of an empty input: the host codec's own."""
        fields = self.codec._encode_payload(np.zeros(0, np.float32), _EMPTY)
        return fields

    def raise_status(self, status: np.ndarray) -> None:
        """Raise the CodecError that the host's copy of a ``status`` array stands for."""
        self._raise_status(status)

    def _raise_status(self, status: np.ndarray) -> None:
        if status[k.ERR_NONFINITE]:
            raise non_finite_error(self.codec.codec_id)
        if status[k.ERR_RANGE]:
            raise CodecError(f"{self.codec.codec_id}: a value range or scale exceeds the float32 range; "
                             "refusing to encode")
        if status[k.ERR_BAD_SCALE]:
            raise CodecError(f"{self.codec.codec_id}: corrupted payload (a scale is negative, non-finite "
                             "or out of order)")
        if status[k.ERR_BAD_CODE]:
            raise CodecError(f"{self.codec.codec_id}: corrupted payload (a code the format cannot contain)")

    @abstractmethod
    def _encode_payload(self, x, out, pos: int, status):
        """Launch the kernels writing ``x``'s payload at ``out[pos:]``; return the header's
        (bits, flags, param_a, param_b, payload_len)."""

    def _check_scales(self, header: Header, payload, status) -> None:
        """Read and check the payload's scales (codecs that have none: nothing)."""

    @abstractmethod
    def _decode_values(self, header: Header, payload, out, accumulate: bool) -> None:
        """Launch the kernels writing (or adding) the payload's values into ``out``."""


class DeviceFloat32(DeviceCodec):
    kind = k.FLOAT32

    def _encode_payload(self, x, out, pos, status):
        self._launch(k.store_float32, x.size, x, out, pos, status)
        return self.fields(x.size)

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        return 0, 0, 0, 0, 4 * n

    def _decode_values(self, header, payload, out, accumulate):
        self._launch(k.load_float32, out.size, payload, 0, out, accumulate)


def half_table(cuda):
    """The host's table of every half's float32 (``HALF_TO_FLOAT``) on the device, copied once
    per ``cuda`` (a process's, or the simulator's)."""
    table = _HALF_TABLES.get(id(cuda))
    if table is None:
        table = _HALF_TABLES[id(cuda)] = cuda.to_device(HALF_TO_FLOAT)
    return table


_HALF_TABLES: dict = {}


class DeviceFloat16(DeviceCodec):
    kind = k.FLOAT16

    def _encode_payload(self, x, out, pos, status):
        self._launch(k.store_float16, x.size, x, out, pos, status)
        return self.fields(x.size)

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        return 0, 0, 0, 0, 2 * n

    def _raise_status(self, status):
        if status[k.ERR_RANGE] and not status[k.ERR_NONFINITE]:
            raise CodecError(f"{self.codec.codec_id}: a value exceeds the format's range")
        super()._raise_status(status)

    def _decode_values(self, header, payload, out, accumulate):
        self._launch(k.load_float16, out.size, payload, 0, half_table(self.cuda), out, accumulate)


class _Bucketed(DeviceCodec):
    """Codecs with per-bucket scales before fixed-width codes (uniform, sign, terngrad,
    qsgd): the payload's scales are ``scale_floats`` float32 per bucket."""

    scale_floats = 1

    def _codes(self, x, scales, out, pos, bits, levels=1, stochastic=False, key=0) -> None:
        bucket = self._bucket(x.size)
        key = np.uint64(key)
        self._launch(k.pack_blocks, (x.size // k.BLOCK) * k.GROUPS,
                     self.kind, x, bucket, bits, levels, scales, stochastic, key, out, pos)
        tail = x.size % k.BLOCK
        if tail:
            self._launch(k.pack_tail, (tail * bits + 7) // 8, self.kind, x, bucket, bits, levels, scales,
                         stochastic, key, out, pos)

    def _unpack(self, header, payload, out, op, status) -> None:
        """unpack_blocks / unpack_tail over the header's codes (``op``: k.WRITE, ADD, CHECK)."""
        bucket, nb = bucket_layout(header.param_a, header.n)
        scales = self._array("scales_in", self.scale_floats * nb, np.float32)
        n, bits, pos, levels = header.n, header.bits, 4 * self.scale_floats * nb, self._levels(header)
        self._launch(k.unpack_blocks, (n // k.BLOCK) * k.GROUPS,
                     self.kind, payload, pos, bits, levels, bucket, scales, out, n, op, status)
        tail = n % k.BLOCK
        if tail:
            self._launch(k.unpack_tail, tail, self.kind, payload, pos, bits, levels, bucket, scales, out, n,
                         op, status)

    def _bucket(self, n: int) -> int:
        return bucket_layout(self.codec.bucket_size or 0, n)[0]

    def _chunks(self, n: int) -> tuple[int, int, int]:
        """(bucket, bucket count, blocks per bucket) of the reduction kernels."""
        bucket = self._bucket(n)
        return bucket, -(-n // bucket), -(-min(bucket, n) // k.CHUNK)

    def _range_keys(self, x, bucket, nb, chunks):
        """Each bucket's (min, max) order keys, reduced on the device (integers: exact)."""
        keys = self._array("keys", 2 * nb, np.int32)
        self._launch(k.fill_keys, 2 * nb, keys)
        self._launch_grid(k.range_keys, nb * chunks, x, bucket, chunks, keys)
        return keys

    def _sums(self, x, bucket, nb, chunks, absolute, status):
        """Each chunk's float64 sum of x (|x| with ``absolute``) and of x^2: sum_partials."""
        partials = self._array("partials", 2 * nb * chunks, np.float64)
        self._launch_grid(k.sum_partials, nb * chunks, x, bucket, chunks, absolute, partials, status)
        return partials

    def _levels(self, header) -> int:
        return 1

    def _check_scales(self, header, payload, status):
        nb = bucket_layout(header.param_a, header.n)[1]
        scales = self._array("scales_in", self.scale_floats * nb, np.float32)
        self._launch(k.load_pairs if self.scale_floats == 2 else k.load_scales, nb, payload, scales, status)
        if self._codes_may_be_bad(header):
            self._unpack(header, payload, scales, k.CHECK, status)

    def _codes_may_be_bad(self, header) -> bool:
        """Whether the payload's codes can hold values the format forbids (checked, like
        the scales, before anything is written)."""
        return False

    def _decode_values(self, header, payload, out, accumulate):
        self._unpack(header, payload, out, k.ADD if accumulate else k.WRITE, self._status)


class DeviceUniform(_Bucketed):
    kind = k.UNIFORM
    scale_floats = 2

    def _encode_payload(self, x, out, pos, status):
        codec, n = self.codec, x.size
        bucket, nb, chunks = self._chunks(n)
        keys = self._range_keys(x, bucket, nb, chunks)
        lohi = self._array("lohi", 2 * nb, np.float32)
        self._launch(k.finish_ranges, nb, keys, lohi, status)
        self._launch(k.store_scales, 2 * nb, lohi, out[pos:pos + 8 * nb])
        self._codes(x, lohi, out, pos + 8 * nb, codec.bits, (1 << codec.bits) - 1, codec.stochastic,
                    self.next_key())
        return self.fields(n)

    def next_key(self) -> int:
        """The RNG key of the next encode (the codec's next stream when it rounds
        stochastically, drawn here; else a fixed key, unused)."""
        seed, counter = self.codec._next_stream() if self.codec.stochastic else (0, 0)
        return k.stream_key(seed, counter)

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        from ..uniform import FLAG_STOCHASTIC, payload_size
        codec = self.codec
        return (codec.bits, FLAG_STOCHASTIC if codec.stochastic else 0, codec.bucket_size or 0, 0,
                payload_size(n, codec.bits, codec.bucket_size or 0))

    def _levels(self, header):
        return (1 << header.bits) - 1


class DeviceSign(_Bucketed):
    kind = k.SIGN

    def _encode_payload(self, x, out, pos, status):
        n = x.size
        bucket, nb, chunks = self._chunks(n)
        partials = self._sums(x, bucket, nb, chunks, True, status)
        scales = self._array("scales", nb, np.float32)
        self._launch(k.finish_means, nb, partials, chunks, bucket, n, scales)
        self._launch(k.store_scales, nb, scales, out[pos:pos + 4 * nb])
        self._codes(x, scales, out, pos + 4 * nb, 1)
        return self.fields(n)

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        from ..sign import payload_size
        bucket_size = self.codec.bucket_size or 0
        return 1, 0, bucket_size, 0, payload_size(n, bucket_size)


class _MaxScaled(_Bucketed):
    """TernGrad and QSGD: scales from each bucket's max |x| (exact, from the range keys),
    with float64 sums where the host takes them (TernGrad's clip, QSGD's l2 norm)."""

    def _scales(self, x, kind, clip, status):
        n = x.size
        bucket, nb, chunks = self._chunks(n)
        keys = self._range_keys(x, bucket, nb, chunks)
        partials = (self._sums(x, bucket, nb, chunks, False, status) if kind != k.SCALE_MAX_ABS
                    else self._array("partials", 2, np.float64))  # not read
        scales = self._array("scales", nb, np.float32)
        self._launch(k.finish_scales, nb, kind, keys, partials, chunks, bucket, n, float(clip), scales, status)
        return scales

    # The codec's, read at each encode: ``finish_scales``' kind, the clip, the codes' bits
    # and levels (also what the frame tables take).
    scale_kind: int
    clip: float
    bits: int
    levels: int

    def next_key(self) -> int:
        """The RNG key of the next encode: the codec's next stream, drawn here."""
        seed, counter = self.codec._next_stream()
        return k.stream_key(seed, counter)

    def _encode_payload(self, x, out, pos, status):
        scales = self._scales(x, self.scale_kind, self.clip, status)
        nb = scales.size
        self._launch(k.store_scales, nb, scales, out[pos:pos + 4 * nb])
        self._codes(x, scales, out, pos + 4 * nb, self.bits, self.levels, True, self.next_key())
        return self.fields(x.size)

    def _payload_size(self, n: int) -> int:
        return 4 * bucket_layout(self.codec.bucket_size or 0, n)[1] + (n * self.bits + 7) // 8


class DeviceTernGrad(_MaxScaled):
    kind = k.TERNGRAD
    levels = 1

    @property
    def bits(self) -> int:
        from ..terngrad import BITS
        return BITS

    @property
    def clip(self) -> float:
        return float(self.codec.clip)

    @property
    def scale_kind(self) -> int:
        return k.SCALE_CLIPPED if self.codec.clip > 0 else k.SCALE_MAX_ABS

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        return self.bits, 0, self.codec.bucket_size or 0, 0, self._payload_size(n)

    def _codes_may_be_bad(self, header):
        return True  # a code 3


class DeviceQSGD(_MaxScaled):
    """QSGD with fixed-width coding; Elias-coded frames and configs stay on the host."""

    kind = k.QSGD

    def __init__(self, codec, stream=None):
        reason = host_only(codec)
        if reason:
            raise CodecError(reason)
        super().__init__(codec, stream)

    clip = 0.0

    @property
    def bits(self) -> int:
        return self.codec.bits

    @property
    def levels(self) -> int:
        return self.codec.levels

    @property
    def scale_kind(self) -> int:
        return k.SCALE_L2 if self.codec.norm == "l2" else k.SCALE_MAX_ABS

    def fields(self, n: int) -> tuple[int, int, int, int, int]:
        """The header's (bits, flags, param_a, param_b, payload_len) of ``n`` values."""
        from ..qsgd import FLAG_L2
        flags = FLAG_L2 if self.scale_kind == k.SCALE_L2 else 0
        return self.bits, flags, self.codec.bucket_size or 0, self.levels, self._payload_size(n)

    def check(self, frame):
        from ..qsgd import FLAG_ELIAS
        header = super().check(frame)
        if header.flags & FLAG_ELIAS:
            raise CodecError("qsgd: an Elias-coded frame has no GPU decoder; it decodes on the host")
        return header

    def _levels(self, header):
        return header.param_b

    def _codes_may_be_bad(self, header):
        return header.param_b < (1 << (header.bits - 1)) - 1  # levels above s fit in the codes
