"""GradientCompressor: a flat gradient <-> one frame per shard, for workers and servers alike.

One compressor holds, for one parameter layout, the codec cache (one instance per
(piece, bits), each with any adaptive state of its own, e.g. mcgq's dynamic K), the RNG
counter of each piece (a per-piece stream whose counter survives bit changes), the
error-feedback memory, and reused frame buffers. Encoding follows GRACE's order on each
quantized piece: compensate -> encode -> update memory. ``state_dict`` is everything a
checkpoint needs to continue bit for bit. It implements :class:`~.frames.FrameCompressor`
(the roles' protocol; the device path's :class:`~.device.DeviceGradientCompressor` too).
"""

from __future__ import annotations

import numpy as np

from ...codecs import Codec, get_codec
from .frames import EncodedFrames
from ..plan.layout import Piece, Shard
from ..wire.messages import FrameHeader


class GradientCompressor:
    """Hyperparameters: the pieces, the base codec, one RNG seed per piece and an optional
    error-feedback memory. State: per-piece call counters, codec instances, the memory.
    ``rest_codec`` serves the small layers' piece (default ``fp32``); ``policy_bits=False``
    keeps ``codec``'s own bits whatever bits ``encode`` is given (PowerSGD's factor codec);
    ``piece_codecs`` (piece index -> codec) gives some quantized pieces a codec of their own, at
    its own bits, for encode and decode (PowerSGD's layers sent whole, ``runtime/exchange/lowrank.py``)."""

    #: :class:`~.frames.FrameCompressor`: the values are host NumPy arrays, the frames plain
    #: host buffers (no :class:`~.device_memory.FrameMemory`).
    device = None
    frame_memory = None

    def __init__(self, pieces: list[Piece], codec: Codec, seeds: dict[int, int], feedback=None, *,
                 rest_codec: Codec | None = None, policy_bits: bool = True, piece_codecs=None):
        self.pieces = pieces
        self.base_config = codec.get_config()
        self.takes_bits = policy_bits and codec.takes_policy_bits
        self.decoder = codec
        self.seeds = seeds
        self.feedback = feedback
        self.rest_codec = rest_codec if rest_codec is not None else get_codec({"id": "fp32"})
        self.piece_codecs = dict(piece_codecs or {})
        self.calls = [0] * sum(p.quantized for p in pieces)  # quantized pieces come first
        self._codecs: dict[tuple[int, int], Codec] = {}
        self._frames: dict[tuple[int, int], np.ndarray] = {}
        self._scratch = np.empty(max([p.size for p in pieces if p.quantized], default=0), np.float32)

    # ---- codecs -------------------------------------------------------------------------
    def codec_for(self, piece: Piece, bits: int) -> Codec:
        if not piece.quantized:
            return self.rest_codec
        if piece.index in self.piece_codecs:
            return self.piece_codecs[piece.index]
        key = (piece.index, bits if self.takes_bits else 0)
        codec = self._codecs.get(key)
        if codec is None:
            config = dict(self.base_config)
            if self.takes_bits:
                config.pop("levels", None)
                config["bits"] = bits
            if "seed" in config:
                config["seed"] = self.seeds[piece.index]
            codec = self._codecs[key] = get_codec(config)
        return codec

    def capacity(self, shard: Shard, bits: list[int]) -> int:
        return FrameHeader.capacity([self.codec_for(p, bits[p.layer]).max_encoded_size(p.size)
                                     for p in shard.pieces])

    def exact_capacity(self, shard: Shard, bits: list[int]) -> int | None:
        """The size of every frame ``encode`` makes of ``shard`` at ``bits`` when its codecs fix
        it (``Codec.exact_size``), else None: what a receiver may size its buffer by."""
        if all(self.codec_for(p, bits[p.layer]).exact_size for p in shard.pieces):
            return self.capacity(shard, bits)
        return None

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, grad: np.ndarray, bits: list[int], shard: Shard, out: np.ndarray | None = None) -> np.ndarray:
        """The frame of ``shard``'s pieces of flat ``grad`` (bits per quantized layer): a view
        into a buffer reused per shard (and bucket), valid until the next encode of that shard;
        or into ``out`` (uint8, at least ``capacity`` bytes) when given."""
        capacity = self.capacity(shard, bits)
        if out is not None:
            if out.size < capacity:
                raise ValueError(f"out= holds {out.size} bytes, the frame may need {capacity}")
            frame = out
        else:
            key = (shard.server, shard.bucket)  # a bucket's frame stays valid while the next is encoded
            frame = self._frames.get(key)
            if frame is None or frame.size < capacity:
                frame = self._frames[key] = np.empty(capacity, np.uint8)
        pos = FrameHeader.size(len(shard.pieces))
        lengths = []
        for piece in shard.pieces:
            g = grad[piece.offset:piece.offset + piece.size]
            if not piece.quantized:
                buf = self.rest_codec.encode(g, out=frame[pos:])
            else:
                codec = self.codec_for(piece, bits[piece.layer])
                p = self.feedback.compensate(piece.index, g) if self.feedback else g
                codec.calls = self.calls[piece.index]
                buf = codec.encode(p, out=frame[pos:])
                self.calls[piece.index] = codec.calls
                if self.feedback:
                    self.feedback.update(piece.index, p, codec.decode(buf, out=self._scratch[:piece.size]))
            lengths.append(buf.size)
            pos += buf.size
        return frame[:FrameHeader.write(frame, lengths)]

    def encode_shards(self, grad: np.ndarray, bits: list[int], shards) -> list[np.ndarray]:
        """``encode`` of each of ``shards`` in turn (the device path's waits for them all once)."""
        return [self.encode(grad, bits, shard) for shard in shards]

    def queue_shards(self, grad: np.ndarray, bits: list[int], shards) -> EncodedFrames:
        """:meth:`encode_shards`, done at the call (:class:`~.frames.PendingFrames` that are ready)."""
        return EncodedFrames(self.encode_shards(grad, bits, shards))

    def decode(self, frame: np.ndarray, shard: Shard, out: np.ndarray, *, accumulate: bool = False) -> float:
        """Decode ``shard``'s frame into ``out`` (flat float32), or with ``accumulate`` add to
        it (bit for bit ``out + decoded``); return the sender's encode seconds.

        Every piece is validated by its codec before it writes, but with ``accumulate`` the
        pieces before a bad one have been added: a caller that gets an error must not use ``out``.
        """
        encode_seconds, buffers = FrameHeader.read(frame, len(shard.pieces))
        for piece, buf in zip(shard.pieces, buffers):
            codec = (self.piece_codecs.get(piece.index, self.decoder) if piece.quantized
                     else self.rest_codec)
            codec.decode(buf, out=out[piece.offset:piece.offset + piece.size], accumulate=accumulate)
        return encode_seconds

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        # "calls" is the per-piece counter shared by all bit widths (it overrides each
        # instance's own count at encode); "codecs" is each instance's full state.
        state = {"calls": list(self.calls),
                 "codecs": [[piece, bits, codec.state_dict()] for (piece, bits), codec in self._codecs.items()]}
        if self.feedback:
            state["feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if len(state["calls"]) != len(self.calls):
            raise ValueError("checkpoint has a different number of quantized layers")
        self.calls = list(state["calls"])
        for index, bits, codec_state in state.get("codecs", ()):
            if not 0 <= index < len(self.pieces) or not self.pieces[index].quantized:
                raise ValueError(f"checkpoint holds codec state for quantized layer {index}, "
                                 f"the model has {len(self.calls)}")
            self.codec_for(self.pieces[index], bits).load_state_dict(codec_state)
        if self.feedback:
            self.feedback.load_state_dict(state["feedback"])
