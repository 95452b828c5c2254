"""Device twins of the host codecs: the same frames, written and read by CUDA kernels.

A twin holds its host codec (config, header fields, RNG counter: ``state_dict`` stays the
host codec's) and device scratch arrays grown as needed. ``encode`` and ``decode`` check
the kernels' status before returning (one small device-to-host copy, which synchronises
the stream): a frame is never returned, and ``out`` never written by a decode, when the
host codec would have refused.
"""

from __future__ import annotations

import numpy as np

from ..base import HEADER_SIZE, CodecError, Header, header_bytes, non_finite_error, read_header, wire_owner
from ..checks import bucket_layout
from ..kernels.half import HALF_TO_FLOAT
from . import kernels as k
from . import load_cuda

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


class DeviceCodec:
    """Hyperparameters: the host codec and the stream the kernels run on (0: the default
    stream). State: the status slots and scratch arrays. The host codec's ``checksum``
    is refused: a payload CRC would need the payload on the host."""

    def __init__(self, codec, stream=0):
        if codec.checksum:
            raise CodecError(f"{codec.codec_id}: checksum=True needs the payload on the host to "
                             "compute its CRC; the device codecs do not write one")
        self.codec = codec
        self.cuda = load_cuda()
        self.stream = stream if stream else self.cuda.default_stream()
        self._status = self.cuda.device_array(k.STATUS_SLOTS, np.int32)
        self._zeros = np.zeros(k.STATUS_SLOTS, np.int32)
        self._scratch: dict[str, object] = {}

    def max_encoded_size(self, n: int) -> int:
        return self.codec.max_encoded_size(n)

    # ---- launching ----------------------------------------------------------------------
    def _launch(self, kernel, threads: int, *args) -> None:
        kernel[k.blocks(threads), k.THREADS, self.stream](*args)

    def _array(self, name: str, size: int, dtype):
        """A device scratch array of at least ``size`` elements (a view of exactly size)."""
        have = self._scratch.get(name)
        if have is None or have.size < size:
            have = self._scratch[name] = self.cuda.device_array(max(size, 1), dtype, stream=self.stream)
        return have[:size]

    def _reset_status(self) -> None:
        self._status.copy_to_device(self._zeros, stream=self.stream)

    def _read_status(self) -> np.ndarray:
        status = self._status.copy_to_host(stream=self.stream)
        self.stream.synchronize()
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
        header = self.launch_encode(x, out, HEADER_SIZE, self._status)
        self._raise_status(self._read_status())
        out[:HEADER_SIZE].copy_to_device(header_bytes(header), stream=self.stream)
        return HEADER_SIZE + header.payload_len

    def launch_encode(self, x, out, pos: int, status) -> Header:
        """Launch the kernels writing the payload of device ``x`` at ``out[pos:]`` (checked
        arrays: :meth:`encode` checks them) and flagging refusals in device ``status`` (see
        :meth:`raise_status`); return the header. Nothing waits for the device."""
        fields = self._encode_payload(x, out, pos, status) if x.size else self._empty_fields()
        return Header(self.codec.wire_id, *fields[:4], x.size, fields[4])

    def launch_decode(self, header: Header, payload, out, accumulate: bool, status) -> None:
        """Launch the kernels checking the scales of a checked ``header``'s device payload
        (flags in ``status``) and decoding it into ``out``, all at once: a caller that finds
        a flag afterwards must not use ``out`` (:meth:`decode` checks before it writes)."""
        if header.n:
            self._check_scales(header, payload, status)
            self._decode_values(header, payload, out, accumulate)

    def decode(self, frame: np.ndarray, out, *, accumulate: bool = False) -> None:
        """Decode a frame held on the host (validated there: header, CRC, lengths) into
        device float32 ``out``, or with ``accumulate`` add to it; only the payload is
        copied to the device (through a reused scratch array)."""
        header = self.check(frame)
        payload = self._array("payload", header.payload_len, np.uint8)
        if header.payload_len:
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

    def _encode_payload(self, x, out, pos: int, status):
        raise NotImplementedError

    def _check_scales(self, header: Header, payload, status) -> None:
        """Read and check the payload's scales (codecs that have none: nothing)."""

    def _decode_values(self, header: Header, payload, out, accumulate: bool) -> None:
        raise NotImplementedError


class DeviceFloat32(DeviceCodec):
    def _encode_payload(self, x, out, pos, status):
        self._launch(k.store_float32, x.size, x, out, pos, status)
        return 0, 0, 0, 0, 4 * x.size

    def _decode_values(self, header, payload, out, accumulate):
        self._launch(k.load_float32, out.size, payload, 0, out, accumulate)


class DeviceFloat16(DeviceCodec):
    _tables: dict = {}

    def _encode_payload(self, x, out, pos, status):
        self._launch(k.store_float16, x.size, x, out, pos, status)
        return 0, 0, 0, 0, 2 * x.size

    def _raise_status(self, status):
        if status[k.ERR_RANGE] and not status[k.ERR_NONFINITE]:
            raise CodecError(f"{self.codec.codec_id}: a value exceeds the format's range")
        super()._raise_status(status)

    def _decode_values(self, header, payload, out, accumulate):
        table = self._tables.get(id(self.cuda))
        if table is None:
            table = self._tables[id(self.cuda)] = self.cuda.to_device(HALF_TO_FLOAT)
        self._launch(k.load_float16, out.size, payload, 0, table, out, accumulate)


class _Bucketed(DeviceCodec):
    """Codecs with per-bucket scales before fixed-width codes (uniform, sign)."""

    kind: int  # pack_blocks' kind

    def _codes(self, x, scales, out, pos, bits, stochastic=False, key=0) -> None:
        bucket = self._bucket(x.size)
        key = np.uint64(key)
        self._launch(k.pack_blocks, (x.size // k.BLOCK) * k.GROUPS,
                     self.kind, x, bucket, bits, scales, stochastic, key, out, pos)
        tail = x.size % k.BLOCK
        if tail:
            self._launch(k.pack_tail, (tail * bits + 7) // 8, self.kind, x, bucket, bits, scales, stochastic,
                         key, out, pos)

    def _values(self, payload, pos, bits, bucket, scales, out, accumulate) -> None:
        self._launch(k.unpack_blocks, (out.size // k.BLOCK) * k.GROUPS,
                     self.kind, payload, pos, bits, bucket, scales, out, accumulate)
        tail = out.size % k.BLOCK
        if tail:
            self._launch(k.unpack_tail, tail, self.kind, payload, pos, bits, bucket, scales, out, accumulate)

    def _bucket(self, n: int) -> int:
        return bucket_layout(self.codec.bucket_size or 0, n)[0]

    def _chunks(self, n: int) -> tuple[int, int]:
        """(bucket, blocks per bucket) of the reduction kernels."""
        bucket = self._bucket(n)
        return bucket, -(-min(bucket, n) // k.CHUNK)


class DeviceUniform(_Bucketed):
    kind = 0

    def _encode_payload(self, x, out, pos, status):
        codec, n = self.codec, x.size
        bucket, chunks = self._chunks(n)
        nb = -(-n // bucket)
        keys = self._array("keys", 2 * nb, np.int32)
        lohi = self._array("lohi", 2 * nb, np.float32)
        self._launch(k.fill_keys, 2 * nb, keys)
        k.range_keys[nb * chunks, k.THREADS, self.stream](x, bucket, chunks, keys)
        self._launch(k.finish_ranges, nb, keys, lohi, status)
        self._launch(k.store_scales, 2 * nb, lohi, out[pos:pos + 8 * nb])
        seed, counter = codec._next_stream() if codec.stochastic else (0, 0)
        self._codes(x, lohi, out, pos + 8 * nb, codec.bits, codec.stochastic, k.stream_key(seed, counter))
        from ..uniform import FLAG_STOCHASTIC, payload_size
        return (codec.bits, FLAG_STOCHASTIC if codec.stochastic else 0, codec.bucket_size or 0, 0,
                payload_size(n, codec.bits, codec.bucket_size or 0))

    def _check_scales(self, header, payload, status):
        nb = bucket_layout(header.param_a, header.n)[1]
        self._launch(k.load_pairs, nb, payload, self._array("lohi_in", 2 * nb, np.float32), status)

    def _decode_values(self, header, payload, out, accumulate):
        bucket, nb = bucket_layout(header.param_a, header.n)
        lohi = self._array("lohi_in", 2 * nb, np.float32)
        self._values(payload, 8 * nb, header.bits, bucket, lohi, out, accumulate)


class DeviceSign(_Bucketed):
    kind = 1

    def _encode_payload(self, x, out, pos, status):
        codec, n = self.codec, x.size
        bucket, chunks = self._chunks(n)
        nb = -(-n // bucket)
        partials = self._array("partials", nb * chunks, np.float64)
        scales = self._array("scales", nb, np.float32)
        k.abs_partials[nb * chunks, k.THREADS, self.stream](x, bucket, chunks, partials, status)
        self._launch(k.finish_means, nb, partials, chunks, bucket, n, scales)
        self._launch(k.store_scales, nb, scales, out[pos:pos + 4 * nb])
        self._codes(x, scales, out, pos + 4 * nb, 1)
        from ..sign import payload_size
        return 1, 0, codec.bucket_size or 0, 0, payload_size(n, codec.bucket_size or 0)

    def _check_scales(self, header, payload, status):
        nb = bucket_layout(header.param_a, header.n)[1]
        self._launch(k.load_scales, nb, payload, self._array("scales_in", nb, np.float32), status)

    def _decode_values(self, header, payload, out, accumulate):
        bucket, nb = bucket_layout(header.param_a, header.n)
        self._values(payload, 4 * nb, 1, bucket, self._array("scales_in", nb, np.float32), out, accumulate)


DEVICE_CLASSES = {"fp32": DeviceFloat32, "fp16": DeviceFloat16, "uniform": DeviceUniform, "sign": DeviceSign}
