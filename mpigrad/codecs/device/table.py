"""A frame's pieces in a fixed number of kernel launches, whatever their number (CGX's
shape): the encode reduces every chunk of every bucket to its range and, where the scales
need them, its sums (one launch over the frame's chunks), finishes the scales into the
frame (one over its buckets) and packs every piece's codes (one over all their threads);
the decode reads every scale (one launch) and writes or adds every piece (one). The
per-piece twins (:mod:`.codecs`) take five or six launches a piece to encode and two or
three to decode.

Every device twin's pieces go by table: a bucketed piece (:class:`~.codecs.DeviceUniform`,
any bits, :class:`~.codecs.DeviceSign`, :class:`~.codecs.DeviceTernGrad` or
:class:`~.codecs.DeviceQSGD`), a :class:`~.codecs.DeviceFloat32` or a
:class:`~.codecs.DeviceFloat16` piece, with or without error feedback (a frame of float
pieces only takes one launch each way); its bytes are the per-piece twins', byte for
byte, which are the host codecs' where the scales come from ranges
(tests/test_device_table.py), and so is the error memory it sets. :class:`FrameTable` is
the host's half: each piece's header and the int64 table the kernels read;
:class:`TableKernels` launches them.
"""

from __future__ import annotations

import numpy as np

from ..base import Header
from ..checks import bucket_layout
from . import kernels as k
from . import codecs as device_codecs
from .codecs import ScratchArrays, half_table

__all__ = ["FrameTable", "TableKernels"]

#: The float twins' kinds in the table (their ``kind``, :class:`~.codecs.DeviceFloat32`'s and
#: :class:`~.codecs.DeviceFloat16`'s): pieces of values, not of bucketed codes.
FLOAT_KINDS = (k.FLOAT32, k.FLOAT16)


class FrameTable:
    """One frame's pieces, as the table kernels read them: a row per non-empty piece
    (``kernels.P_*``), a row per bucket of its bucketed pieces (``kernels.B_*``), the encode's
    chunks of those buckets, and each piece's first thread. Offsets are into the flat values
    the frame encodes (or decodes into); positions are bytes of the whole frame."""

    def __init__(self, encode: bool):
        #: Whether the table encodes (its threads, chunks) or decodes.
        self.encode = encode
        self._pieces: list[list[int]] = []
        self._threads: list[int] = []
        self._buckets: list[np.ndarray] = []
        self._chunks: list[np.ndarray] = []
        #: The frame's buckets (of its uniform pieces) and, an encode's, their chunks.
        self.bucket_count = self.chunk_count = 0
        #: Whether a piece has error feedback (the encode then needs the memory).
        self.with_feedback = False
        #: The rows of the stochastic pieces (whose RNG key changes every frame).
        self._key_rows: list[int] = []

    def add_encode(self, twin, offset: int, size: int, payload_at: int, feedback: int = k.NO_FEEDBACK,
                   decay: float = 1.0) -> Header:
        """Add the piece ``values[offset:offset + size]`` encoded by ``twin`` with its
        payload at byte ``payload_at``, with error ``feedback`` (``kernels.RESIDUAL`` or
        ``ACCUMULATE``) at ``decay``; return its header. The codec's RNG
        stream is drawn here, as the twin's own encode draws it."""
        assert self.encode
        fields = twin._empty_fields() if size == 0 else twin.fields(size)
        header = Header(twin.codec.wire_id, *fields[:4], size, fields[4])
        if size and twin.kind in FLOAT_KINDS:
            self._add_float(twin.kind, offset, size, payload_at, feedback, decay)
        elif size:
            self._add_bucketed(twin, offset, size, twin.codec.bucket_size or 0, payload_at, feedback, decay)
        return header

    def add_decode(self, twin, header: Header, offset: int, payload_at: int) -> None:
        """Add a piece of ``twin``'s codec, of a checked ``header``, whose payload is at byte
        ``payload_at`` and whose values go to ``values[offset:offset + n]``."""
        assert not self.encode
        if header.n == 0:
            return
        if twin.kind in FLOAT_KINDS:
            self._add_float(twin.kind, offset, header.n, payload_at)
        else:
            self._add_bucketed(twin, offset, header.n, header.param_a, payload_at, header=header)

    def _add_float(self, kind: int, offset: int, size: int, at: int, feedback: int = k.NO_FEEDBACK,
                   decay: float = 1.0) -> None:
        row = [0] * k.PIECE_COLUMNS
        row[k.P_KIND], row[k.P_OFFSET], row[k.P_SIZE], row[k.P_CODES] = kind, offset, size, at
        row[k.P_FEEDBACK], row[k.P_DECAY] = feedback, int(np.float32(decay).view(np.int32))
        self.with_feedback |= feedback != k.NO_FEEDBACK
        self._pieces.append(row)
        self._threads.append(size)

    def _add_bucketed(self, twin, offset: int, size: int, bucket_size: int, at: int,
                      feedback: int = k.NO_FEEDBACK, decay: float = 1.0, header: Header | None = None) -> None:
        """A bucketed piece's rows: an encode's from ``twin``'s codec (its RNG key drawn, as
        the twin's encode draws it), a decode's from its ``header``."""
        bucket, nb = bucket_layout(bucket_size, size)
        kind, row = twin.kind, [0] * k.PIECE_COLUMNS
        if header is not None:
            bits, levels, stochastic, key = header.bits, twin._levels(header), False, 0
        elif kind == k.UNIFORM:
            bits, stochastic = twin.codec.bits, twin.codec.stochastic
            levels, key = (1 << bits) - 1, twin.next_key()
        elif kind == k.SIGN:
            bits, levels, stochastic, key = 1, 1, False, 0
        else:  # TernGrad, QSGD: stochastic rounding, always
            bits, levels, stochastic, key = twin.bits, twin.levels, True, twin.next_key()
            row[k.P_SCALE] = twin.scale_kind
            row[k.P_CLIP] = int(np.float64(twin.clip).view(np.int64))
        row[k.P_KIND], row[k.P_OFFSET], row[k.P_SIZE], row[k.P_BITS] = kind, offset, size, bits
        row[k.P_LEVELS], row[k.P_BUCKET], row[k.P_STOCHASTIC] = levels, bucket, int(stochastic)
        self.write_key(row, k.P_KEY_HI, key)
        scale_bytes = 4 * twin.scale_floats
        row[k.P_CODES], row[k.P_PAIRS] = at + scale_bytes * nb, self.bucket_count
        row[k.P_FEEDBACK], row[k.P_DECAY] = feedback, int(np.float32(decay).view(np.int32))
        self.with_feedback |= feedback != k.NO_FEEDBACK
        if stochastic:
            self._key_rows.append(len(self._pieces))
        self._pieces.append(row)
        tail = size % k.BLOCK
        self._threads.append((size // k.BLOCK) * k.GROUPS + ((tail * bits + 7) // 8 if self.encode else tail))
        buckets = np.zeros((nb, k.BUCKET_COLUMNS), np.int64)
        buckets[:, k.B_AT] = at + scale_bytes * np.arange(nb)
        buckets[:, k.B_PIECE] = len(self._pieces) - 1
        if self.encode:  # each bucket's chunks of CHUNK values, as range_keys splits them
            starts = (np.arange(nb)[:, None] * bucket + np.arange(-(-min(bucket, size) // k.CHUNK))[None, :] * k.CHUNK)
            stops = np.minimum(np.minimum(starts + k.CHUNK, (np.arange(nb)[:, None] + 1) * bucket), size)
            kept = starts < stops
            counts = kept.sum(axis=1)
            buckets[:, k.B_CHUNKS] = counts
            buckets[:, k.B_FIRST] = self.chunk_count + np.concatenate(([0], np.cumsum(counts)[:-1]))
            rows = np.full(int(counts.sum()), len(self._pieces) - 1)
            self._chunks.append(np.stack([offset + starts[kept], offset + stops[kept], rows], axis=1).ravel())
            self.chunk_count += int(counts.sum())
        self._buckets.append(buckets.ravel())
        self.bucket_count += nb

    @property
    def key_count(self) -> int:
        """The stochastic pieces added so far (uniform's with stochastic rounding, TernGrad's,
        QSGD's)."""
        return len(self._key_rows)

    def key_slot(self, i: int) -> int:
        """Where the ``i``-th stochastic piece's RNG key sits in :meth:`array`: its
        high half (``kernels.P_KEY_HI``), the low half after it. Valid once every piece is in."""
        return len(self._threads) + 1 + k.PIECE_COLUMNS * self._key_rows[i] + k.P_KEY_HI

    @staticmethod
    def write_key(array: np.ndarray, slot: int, key: int) -> None:
        """Put RNG ``key`` (a piece's next stream) at ``slot`` of a table's ``array``."""
        array[slot], array[slot + 1] = key >> 32, key & 0xFFFFFFFF

    @property
    def threads(self) -> int:
        """The pack (encode) or unpack (decode) launch's threads."""
        return sum(self._threads)

    def sections(self) -> dict[str, tuple[int, int]]:
        """Each section's (start, stop) in :meth:`array`: firsts, pieces, buckets, chunks."""
        sizes = {"firsts": len(self._threads) + 1, "pieces": k.PIECE_COLUMNS * len(self._pieces),
                 "buckets": k.BUCKET_COLUMNS * self.bucket_count, "chunks": k.CHUNK_COLUMNS * self.chunk_count}
        out, start = {}, 0
        for name, size in sizes.items():
            out[name] = (start, start + size)
            start += size
        return out

    def array(self) -> np.ndarray:
        """The table as one int64 array (the kernels get slices of its device copy)."""
        firsts = np.concatenate(([0], np.cumsum(self._threads, dtype=np.int64)))
        parts = [firsts, np.asarray(self._pieces, np.int64).ravel(), *self._buckets, *self._chunks]
        return np.concatenate([np.asarray(part, np.int64) for part in parts])


class TableKernels:
    """Hyperparameters: the stream source (as a device codec's: a callable asked at every
    launch). State: the scratch arrays of the ranges (grown as needed)."""

    def __init__(self, cuda, stream):
        self.cuda = cuda
        self._stream_source = stream
        self.scratch = ScratchArrays(cuda)

    def _sections(self, table: FrameTable, device_table):
        return {name: device_table[start:stop] for name, (start, stop) in table.sections().items()}

    def encode(self, table: FrameTable, device_table, values, out, status, memory=None, compensated=None) -> None:
        """Launch the frame's encode: ``values`` (device float32, flat), ``out`` (the device
        frame), ``device_table`` (``table.array()`` on the device); flags into ``status``.
        Pieces with error feedback read and set ``memory`` and write ``compensated`` (device
        float32, flat, as ``values``: the error memory, and g compensated with it)."""
        assert table.encode and (memory is not None and compensated is not None or not table.with_feedback)
        t, stream = self._sections(table, device_table), self._stream_source()
        memory = values if memory is None else memory  # not read: no piece has feedback
        compensated = values if compensated is None else compensated
        chunks, buckets, launch = table.chunk_count, table.bucket_count, device_codecs.launch_kernel
        lohi = self.scratch.array("lohi", 2 * buckets, np.float32, stream)
        if chunks:
            keys = self.scratch.array("keys", 2 * chunks, np.int32, stream)
            # Written only for the chunks whose scales are sums (kernels._sums_needed).
            partials = self.scratch.array("partials", 2 * chunks, np.float64, stream)
            launch(k.table_range_keys, chunks, stream, values, memory, compensated, t["chunks"], t["pieces"], keys,
                   partials)
            launch(k.table_finish_ranges, k.blocks(buckets), stream, keys, partials, t["buckets"], t["pieces"], lohi,
                   out, status)
        if table.threads:
            launch(k.table_pack, k.blocks(table.threads), stream, values, memory, compensated, t["firsts"],
                   t["pieces"], lohi, out, status)

    def decode(self, table: FrameTable, device_table, frame, out, accumulate: bool, status) -> None:
        """Launch the frame's decode: ``frame`` (the device frame), into (or, with
        ``accumulate``, onto) ``out`` (device float32, flat); flags into ``status``, all at
        once: ``out`` is not to be used before they are read (and found clear)."""
        assert not table.encode
        t, stream = self._sections(table, device_table), self._stream_source()
        buckets, launch = table.bucket_count, device_codecs.launch_kernel
        lohi = self.scratch.array("lohi_in", 2 * buckets, np.float32, stream)
        if buckets:
            launch(k.table_load_pairs, k.blocks(buckets), stream, frame, t["buckets"], t["pieces"], lohi, status)
        if table.threads:
            launch(k.table_unpack, k.blocks(table.threads), stream, frame, t["firsts"], t["pieces"], lohi,
                   half_table(self.cuda), out, k.ADD if accumulate else k.WRITE, status)
