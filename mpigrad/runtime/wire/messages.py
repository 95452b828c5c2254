"""Every message of one iteration, as a named layout over a preallocated numpy buffer.

With S servers (ranks 0..S-1) and P workers (ranks S..S+P-1), or with colocated servers
(worker rank s + 1 serving shard s, rank 0 none), per iteration m (the order is driven by
:mod:`mpigrad.runtime.roles.iteration`):

1. ``LossReport``   worker -> rank 0, tag LOSS, float64[5]
                    (loss, compute CPU s, compute wall s, parameter CRC-32 or -1, status).
2. ``Control``      rank 0 -> every rank, broadcast on the world,
                    int64[3 + L] (command, iteration, measure, bits of each quantized layer;
                    ``--codec powersgd`` with ``ranks``/``widths``: each layer's setting code,
                    r > 0 rank r, -b width b, checked against the menu by every rank that
                    reads it, ``PowerSGD.check_settings``). measure: 1 asks the workers for
                    message 11 after this iteration, else 0.
3. gradient frame   worker -> server s, tag GRAD, uint8: ``FrameHeader`` then one codec
                    buffer per piece of shard s (see :mod:`mpigrad.runtime.plan.layout`).
                    A worker whose gradient is not finite sends the 16-byte ``ERROR_FRAME``.
4. ``FrameLength``  server s -> its broadcast group (rank 0 and the workers), int64[1],
   and the frame   the averaged, re-encoded gradient of shard s, same layout as 3: one
                    message of both, back to back in one buffer, where every rank computes
                    the frame's size from the shard and the bits (``Codec.exact_size``),
                    else the length first (``runtime/exchange/broadcast.py``).
                    Colocated servers: the frame alone, sent to each other worker, tag
                    BCAST (its size comes with the message).
3b/4b. second round  ``--codec powersgd`` from its ``start`` iteration on (``runtime/exchange/lowrank.py``):
                    messages 3 and 4 carry round 1 over the *factor layout*: one float32 codec
                    buffer per low-rank layer, P_i = M_i Q (n x r) up, the orthogonalised
                    average P^ down, then the other layers' float32 piece. Then round 2:
                    worker -> server s, tag FACTORS, a gradient frame of one float32 buffer
                    per low-rank layer of shard s, Q_i = M_i^T P^ (m x r); server s -> its
                    broadcast group, ``FrameLength`` and the frame of the averaged Q, one
                    message as 4 (same layout); colocated servers: to each other worker, tag BCAST, as 4. A
                    ``ServerReport``'s frame bytes and bytes broadcast are then both rounds' sums.
5. ``ServerReport`` server s (not rank 0) -> rank 0, tag REPORT, float64[4 + P + 2L]
                    (bytes broadcast, decode CPU s, encode CPU s, the slowest worker's encode
                    s, each worker's frame bytes, ||g||^2 of each quantized layer's part in
                    shard s, g the workers' average, and ||Q(g)||^2 of the decoded broadcast).
6. average          server s (not rank 0) -> rank 0, tag AVERAGE, float32: the workers' average of
                    shard s's quantized pieces, in piece order, before the re-encode; sent
                    only when the policy observes gradients (``Policy.uses_gradients``).
7. ``BufferStats``  only after an iteration that evaluates, checkpoints or ends, and only for a
                    model with buffers (BatchNorm statistics): worker -> rank 0, tag BUFFERS,
                    float64[B] (every buffer, flattened in model order); then rank 0 -> every
                    rank, broadcast on the world, float64[B]: the workers' average.

9. parameters      colocated servers only, after the same iterations as 7: the first
                    worker -> rank 0, tag PARAMS, float32[N]: its flat parameters (rank 0
                    takes part in no gradient broadcast, so holds them only from here).

10. ``BackwardReport`` pipelined iteration only (``--pipeline``), with 5: worker -> rank 0,
                    tag BACKWARD, float64[2 + 2B + BS + B] (backward CPU s, backward wall s;
                    for each of the B buckets the CPU, then the wall seconds from the start of
                    backward until it was produced; the bytes of its frame of each bucket to
                    each of the S shards; the bytes of its shard's average of each bucket). Message 1's compute times are then the
                    forward pass's alone (the loss goes before backward), and messages 3 and 4
                    go per bucket: a frame per (shard, bucket), in bucket order
                    (``layout.pipeline_buckets``).

11. setting errors  ``--codec powersgd`` with ``ranks``/``widths``, in ``reports`` after an
                    iteration whose Control says measure: worker -> rank 0, tag SETTINGS,
                    float64[L x K] (each low-rank layer's squared error at each of the K
                    settings of the menu, on the worker's M_i; ``LowRank.setting_errors``).
                    Off the clock, like message 6 (L x K x 8 bytes, once per decision).

12. slices         ``--exchange hierarchical`` only, before 3 and after 4, between the workers
                    of one node: in the reduce-scatter each worker sends its gradient's slice i
                    (the pieces of the shards local rank i's workers serve across nodes) to the
                    node's local rank i, tag INTRA; in the all-gather local rank i sends its
                    slice of the decoded average to the node's other workers, tag GATHER. Each
                    float32[n] (``--intra-codec fp32``), uint16[n] (fp16, bf16) or
                    uint8[n + 4 ceil(n / 256)] (int8: the blocks' float32 scales, then the
                    int8 values), n fixed by the layout: no length on the wire, the receive
                    buffer is exactly that size.

Outside the iteration's order:

8. ``ErrorReport``  a worker or shard server that raised -> rank 0, tag ERROR, uint8: magic
                    b"MGEX", the iteration the rank was in (int64, -1 before its first), then
                    the error's text (UTF-8, cut to 1000 bytes). Rank 0 looks for it whenever
                    it waits, closes the trace "failed" naming the rank, and ends the run
                    (before, MPI_Abort from the failed rank killed rank 0 with the trace open).

Frame header (little-endian): magic b"MGFR" (4), piece count uint32 (4), the sender's encode
seconds float64 (8), then each piece's byte length uint64 (8 per piece). A decoder checks the
magic, the count and that the lengths fill the frame exactly before it hands any piece to a
codec, which validates the piece again.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

TAG_LOSS = 11
TAG_GRAD = 12
TAG_REPORT = 13
TAG_AVERAGE = 14
TAG_BUFFERS = 15
TAG_ERROR = 16
TAG_OBJECT = 17  # the set-up and checkpoint plane: one pickled object per message (wire/mpi.py)
TAG_PARAMS = 18  # message 9
TAG_BCAST = 19   # message 4 with colocated servers: the shard's frame, point to point
TAG_FACTORS = 20  # message 3b: a worker's second-round factors (PowerSGD's Q_i)
TAG_BACKWARD = 21  # message 10: a pipelined worker's backward times
TAG_SETTINGS = 22  # message 11: a worker's errors at each low-rank setting
TAG_INTRA = 23    # message 12: a worker's slice of its gradient to its node's local rank
TAG_GATHER = 24   # message 12: a local rank's slice of the average to its node's workers

# Control commands.
CONTINUE = 1
STOP_AFTER = 2   # finish this iteration, then checkpoint and exit for requeue
CHECKPOINT_AFTER = 3  # finish this iteration, every rank sends its state to rank 0 (the
                      # periodic checkpoint of --checkpoint-every), then go on

# Loss report status.
STATUS_OK = 0.0
STATUS_NONFINITE_LOSS = 1.0


class FrameError(ValueError):
    """A gradient frame that does not parse."""


@dataclass
class LossReport:
    """Message 1: float64[FIELDS]."""

    loss: float
    compute_cpu: float
    compute_wall: float
    checksum: float
    status: float

    FIELDS = 5
    NBYTES = 8 * FIELDS

    @staticmethod
    def buffer(rows: int | None = None) -> np.ndarray:
        return np.zeros(LossReport.FIELDS if rows is None else (rows, LossReport.FIELDS), np.float64)

    def pack(self, buf: np.ndarray) -> np.ndarray:
        buf[:] = (self.loss, self.compute_cpu, self.compute_wall, self.checksum, self.status)
        return buf

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "LossReport":
        return cls(*(float(v) for v in buf[:cls.FIELDS]))

    @property
    def finite(self) -> bool:
        return self.status != STATUS_NONFINITE_LOSS and math.isfinite(self.loss)


class Control:
    """Message 2: int64[FIXED + layers], one reused buffer per rank."""

    COMMAND, ITERATION, MEASURE = 0, 1, 2
    FIXED = 3

    def __init__(self, layers: int):
        self.buf = np.zeros(self.FIXED + max(layers, 1), np.int64)

    def set(self, command: int, iteration: int, bits: list[int], measure: bool = False) -> None:
        self.buf[self.COMMAND] = command
        self.buf[self.ITERATION] = iteration
        self.buf[self.MEASURE] = int(measure)
        self.buf[self.FIXED:self.FIXED + len(bits)] = bits

    @property
    def measure(self) -> bool:
        """True when the workers send their setting errors (message 11) after this iteration."""
        return bool(self.buf[self.MEASURE])

    @property
    def command(self) -> int:
        return int(self.buf[self.COMMAND])

    @property
    def iteration(self) -> int:
        return int(self.buf[self.ITERATION])

    @property
    def bits(self) -> list[int]:
        return [int(b) for b in self.buf[self.FIXED:]]


class FrameHeader:
    """Message 3/4 header: magic, piece count, encode seconds, piece lengths."""

    MAGIC = b"MGFR"
    _HEAD = struct.Struct("<4sId")
    ENCODE_SECONDS = slice(8, 16)

    @classmethod
    def size(cls, pieces: int) -> int:
        return cls._HEAD.size + 8 * pieces

    @classmethod
    def capacity(cls, piece_capacities: list[int]) -> int:
        return cls.size(len(piece_capacities)) + sum(piece_capacities)

    @classmethod
    def write(cls, frame: np.ndarray, lengths: list[int], encode_seconds: float = 0.0) -> int:
        """Write the header for pieces already placed back to back; return the frame length."""
        frame[:cls._HEAD.size] = np.frombuffer(cls._HEAD.pack(cls.MAGIC, len(lengths), encode_seconds), np.uint8)
        frame[cls._HEAD.size:cls.size(len(lengths))] = np.frombuffer(
            np.asarray(lengths, dtype="<u8").tobytes(), np.uint8)
        return cls.size(len(lengths)) + sum(lengths)

    @classmethod
    def set_encode_seconds(cls, frame: np.ndarray, seconds: float) -> None:
        frame[cls.ENCODE_SECONDS] = np.frombuffer(np.float64(seconds).tobytes(), np.uint8)

    @classmethod
    def read(cls, frame: np.ndarray, pieces: int) -> tuple[float, list[np.ndarray]]:
        """Split a frame into its piece buffers (views); FrameError if it does not add up."""
        if frame.size < cls.size(pieces):
            raise FrameError(f"gradient frame of {frame.size} bytes is shorter than its header")
        magic, count, encode_seconds = cls._HEAD.unpack_from(frame[:cls._HEAD.size].tobytes())
        if magic != cls.MAGIC or count != pieces:
            raise FrameError(f"bad gradient frame header (magic {magic!r}, {count} segments, "
                             f"expected {pieces})")
        lengths = [int(n) for n in np.frombuffer(frame[cls._HEAD.size:cls.size(count)].tobytes(), "<u8")]
        offset = cls.size(count)
        if min(lengths, default=1) == 0 or sum(lengths) != frame.size - offset:
            raise FrameError(f"gradient frame segments of {lengths} bytes do not fill the "
                             f"{frame.size - offset} bytes the frame carries")
        views = []
        for length in lengths:
            views.append(frame[offset:offset + length])
            offset += length
        return encode_seconds, views


ERROR_MAGIC = b"MGER"


def error_frame() -> np.ndarray:
    """Message 3 when the worker's gradient is not finite."""
    return np.frombuffer(ERROR_MAGIC + bytes(12), np.uint8).copy()


def is_error_frame(frame: np.ndarray) -> bool:
    return frame.size == 16 and frame[:4].tobytes() == ERROR_MAGIC


@dataclass
class ErrorReport:
    """Message 8: a rank's error, for rank 0 to record and end the run with."""

    iteration: int
    text: str

    MAGIC = b"MGEX"
    MAX_TEXT = 1000
    _HEAD = struct.Struct("<4sq")

    def pack(self) -> np.ndarray:
        text = self.text.encode("utf-8", "replace")[:self.MAX_TEXT]
        return np.frombuffer(self._HEAD.pack(self.MAGIC, self.iteration) + text, np.uint8).copy()

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "ErrorReport":
        """FrameError when the buffer is not an error report."""
        raw = buf.tobytes()
        if len(raw) < cls._HEAD.size or raw[:4] != cls.MAGIC:
            raise FrameError(f"bad error report of {len(raw)} bytes")
        _, iteration = cls._HEAD.unpack_from(raw)
        return cls(int(iteration), raw[cls._HEAD.size:cls._HEAD.size + cls.MAX_TEXT].decode("utf-8", "replace"))


class FrameLength:
    """Message 4a: int64[1], the byte length of the broadcast frame it announces (sent with
    the frame in one message where the size is known to every rank, else before it)."""

    NBYTES = 8

    @staticmethod
    def buffer() -> np.ndarray:
        return np.zeros(1, np.int64)


@dataclass
class ServerReport:
    """Message 5: float64[FIXED + P + 2L], what a shard's server did this iteration (for the
    record): its broadcast bytes (length message included), decode and encode CPU seconds,
    the slowest worker's encode seconds (from the frame headers), the byte size of each
    worker's frame it received, then ||g||^2 (g the workers' average) and ||Q(g)||^2 (Q(g)
    the decoded broadcast; 0 where the server does not decode its own broadcast) over its
    pieces of each quantized layer (0 for a layer it holds none of)."""

    bytes_out: float
    t_decode: float
    t_encode: float
    worker_encode: float
    sizes: list
    energies: list
    update_energies: list

    FIXED = 4

    @staticmethod
    def buffer(workers: int, layers: int, rows: int | None = None) -> np.ndarray:
        width = ServerReport.FIXED + workers + 2 * layers
        return np.zeros(width if rows is None else (rows, width), np.float64)

    def pack(self, buf: np.ndarray) -> np.ndarray:
        workers_end = self.FIXED + len(self.sizes)
        layers_end = workers_end + len(self.energies)
        buf[:self.FIXED] = (self.bytes_out, self.t_decode, self.t_encode, self.worker_encode)
        buf[self.FIXED:workers_end] = self.sizes
        buf[workers_end:layers_end] = self.energies
        buf[layers_end:] = self.update_energies
        return buf

    @classmethod
    def unpack(cls, buf: np.ndarray, workers: int) -> "ServerReport":
        workers_end = cls.FIXED + workers
        layers = (buf.size - workers_end) // 2
        return cls(float(buf[0]), float(buf[1]), float(buf[2]), float(buf[3]),
                   [int(n) for n in buf[cls.FIXED:workers_end]],
                   [float(e) for e in buf[workers_end:workers_end + layers]],
                   [float(e) for e in buf[workers_end + layers:]])


@dataclass
class BackwardReport:
    """Message 10: float64[2 + 2B + BS + B], a pipelined worker's backward and frames: its
    backward's CPU and wall seconds; when (seconds from its start, CPU, then wall) it produced
    each of the B buckets; the bytes of its frame of each bucket to each of the S shards (0:
    none; its own shard's included); the bytes of its shard's average of each bucket (0: none)."""

    cpu: float
    wall: float
    ready_cpu: list
    ready_wall: list
    sent: list     # B * S, bucket-major
    bcast: list    # B

    FIXED = 2

    @staticmethod
    def buffer(buckets: int, shards: int, rows: int | None = None) -> np.ndarray:
        width = BackwardReport.FIXED + buckets * (3 + shards)
        return np.zeros(width if rows is None else (rows, width), np.float64)

    def pack(self, buf: np.ndarray) -> np.ndarray:
        values = [self.cpu, self.wall, *self.ready_cpu, *self.ready_wall, *self.sent, *self.bcast]
        if len(values) != buf.size:
            raise ValueError(f"a backward report of {len(values)} values does not fill its {buf.size}")
        buf[:] = values
        return buf

    @classmethod
    def unpack(cls, buf: np.ndarray, buckets: int, shards: int) -> "BackwardReport":
        B, S = buckets, shards
        if buf.size != cls.FIXED + B * (3 + S):
            raise ValueError(f"a backward report of {buf.size} values is not one of {B} buckets and {S} shards")
        at = cls.FIXED
        ready_cpu, ready_wall = buf[at:at + B], buf[at + B:at + 2 * B]
        sent, bcast = buf[at + 2 * B:at + 2 * B + B * S], buf[at + 2 * B + B * S:]
        return cls(float(buf[0]), float(buf[1]), [float(t) for t in ready_cpu], [float(t) for t in ready_wall],
                   [int(n) for n in sent], [int(n) for n in bcast])


class BufferStats:
    """Message 6: float64[B], a model's buffers flattened in ``model.buffers()`` order."""

    @staticmethod
    def buffer(size: int, rows: int | None = None) -> np.ndarray:
        return np.zeros(size if rows is None else (rows, size), np.float64)
