"""Where each communicated piece of the gradient sits, and which server owns it.

The flat parameter buffer is laid out as [quantized layers in model order, then every small
layer]. A *piece* is one codec buffer on the wire: a quantized layer, or the small layers
together as float32 (with ``shard_chunk``, a chunk of either). A *shard* is the
set of pieces one server aggregates; shards are balanced with whole pieces (layer-aligned
unless ``shard_chunk`` cuts large layers, which changes the codec's min/max scaling because
each chunk is quantized on its own).

``shard_chunk = "auto"`` (the default) keeps whole layers with one server (the paper's
layout: nothing to balance) and, with several, cuts the quantized layers and the small
layers' piece each into pieces small enough that every server gets an even share of both
(:func:`resolve_chunks`), so that no node carries much more than an even share whatever
the widths (float32 warm-ups, fp32, 2 or 8 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import AUTO_CHUNK


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Layout:
    """Where each layer sits in the flat buffers."""

    quantized: tuple[Segment, ...]
    rest: Segment
    total: int

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.quantized + (self.rest,)


@dataclass(frozen=True)
class Piece:
    """One codec buffer: ``layer`` is the quantized layer index (its bits), or -1 for the
    float32 small layers; ``index`` numbers pieces across the whole layout (RNG stream,
    error-feedback memory and codec state are per piece)."""

    index: int
    layer: int
    offset: int
    size: int

    @property
    def quantized(self) -> bool:
        return self.layer >= 0


@dataclass(frozen=True)
class Shard:
    """The pieces server ``server`` owns, in layout order (a frame carries them in this order).
    ``bucket``: -1 for a whole shard; b >= 0 for its part in the pipelined iteration's bucket b
    (its own frame, sent as soon as backward has produced the bucket)."""

    server: int
    pieces: tuple[Piece, ...]
    bucket: int = -1

    @property
    def elements(self) -> int:
        return sum(p.size for p in self.pieces)


#: ``shard_chunk``'s default: cut layers so that the servers' shares are even (resolve_chunks).
AUTO = AUTO_CHUNK
#: Auto: each class of piece (quantized, small layers) in about this many pieces per server.
AUTO_PIECES_PER_SERVER = 8
#: Auto: no piece cut smaller than this (a small model's layers stay whole), and chunks are
#: multiples of 1024 elements.
AUTO_MIN_CHUNK = 16384


@dataclass(frozen=True)
class Chunks:
    """How a layout is cut into pieces and the pieces dealt to servers: the quantized layers
    into pieces of at most ``quantized`` elements and the small layers' piece into pieces of
    at most ``rest`` (0: whole). ``by_class``: deal the quantized and the small layers'
    pieces each evenly by elements (auto), so that the shares stay even at any width; else
    by bytes at the initial bits, all pieces together (``--shard-chunk N``, layers whole)."""

    quantized: int = 0
    rest: int = 0
    by_class: bool = False

    def describe(self) -> str:
        """The cut in words, for the start-up line and the trace."""
        if not self.quantized and not self.rest:
            return "whole layers"
        parts = [f"quantized layers in pieces of at most {self.quantized:,} elements" if self.quantized else
                 "quantized layers whole",
                 f"the small layers in pieces of at most {self.rest:,}" if self.rest else "the small layers whole"]
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {"quantized": self.quantized, "rest": self.rest, "by_class": self.by_class}


def resolve_chunks(setting: int | str, layout: Layout, servers: int, whole_layers: bool = False) -> Chunks:
    """The cut of ``shard_chunk = setting`` for ``servers`` servers. A number N cuts every
    layer larger than N (0: none). ``auto``: whole layers with one server or with
    ``whole_layers`` (an optimizer that needs them); else each class in about
    ``AUTO_PIECES_PER_SERVER`` pieces per server, dealt by class (:class:`Chunks`)."""
    if setting != AUTO:
        return Chunks(int(setting), int(setting))
    if servers <= 1 or whole_layers:
        return Chunks()
    quantized = sum(segment.size for segment in layout.quantized)
    return Chunks(_auto_chunk(quantized, servers), _auto_chunk(layout.rest.size, servers), by_class=True)


def _auto_chunk(elements: int, servers: int) -> int:
    share = -(-elements // (AUTO_PIECES_PER_SERVER * servers))
    return max(AUTO_MIN_CHUNK, -(-share // 1024) * 1024)


def pieces_of(layout: Layout, chunk: int | Chunks = 0) -> list[Piece]:
    """The layout's pieces: each quantized layer, then the small layers as float32, each cut
    into pieces of at most ``chunk`` elements when ``chunk`` > 0 and it is larger (a
    :class:`Chunks`: its own size for each class). Cutting the small
    layers changes no loss or parameter (float32 adds element by element, in rank order,
    wherever the elements sit; only a header per piece is added) but lets the servers share
    them: at 2 bits the small layers' float32 bytes outweigh a quantized shard's several
    times over."""
    chunks = chunk if isinstance(chunk, Chunks) else Chunks(int(chunk), int(chunk))
    pieces: list[Piece] = []
    for layer, segment in [*enumerate(layout.quantized), (-1, layout.rest)]:
        if not segment.size:
            continue
        size = chunks.quantized if layer >= 0 else chunks.rest
        step = size if size and segment.size > size else segment.size
        for start in range(0, segment.size, step):
            pieces.append(Piece(len(pieces), layer, segment.offset + start, min(step, segment.size - start)))
    return pieces


def plan_shards(layout: Layout, servers: int, piece_bytes, chunk: int | Chunks = 0) -> tuple[Shard, ...]:
    """Split the layout over ``servers`` shards.

    Largest piece first onto the least-loaded server (ties: the lower server), then each
    shard's pieces back in layout order. Loads are ``piece_bytes(piece)`` over all pieces;
    with ``Chunks.by_class`` elements, the quantized pieces first, then the small layers'
    onto the server with the fewest of them (ties: the fewest quantized elements). With one
    server, shard 0 holds every piece and frames are laid out exactly as a single server's.
    A server may own no piece when there are fewer pieces than servers; its frames are then
    empty of segments.
    """
    pieces = pieces_of(layout, chunk)
    if servers == 1:
        return (Shard(0, tuple(pieces)),)
    owned: list[list[Piece]] = [[] for _ in range(servers)]
    if isinstance(chunk, Chunks) and chunk.by_class:
        quantized, rest = [0] * servers, [0] * servers
        for piece in sorted(pieces, key=lambda p: (not p.quantized, -p.size, p.index)):
            loads, tie = (quantized, rest) if piece.quantized else (rest, quantized)
            target = min(range(servers), key=lambda s: (loads[s], tie[s], s))
            owned[target].append(piece)
            loads[target] += piece.size
    else:
        loads = [0] * servers
        for piece in sorted(pieces, key=lambda p: (-piece_bytes(p), p.index)):
            target = min(range(servers), key=lambda s: (loads[s], s))
            owned[target].append(piece)
            loads[target] += piece_bytes(piece)
    return tuple(Shard(s, tuple(sorted(owned[s], key=lambda p: p.index))) for s in range(servers))


#: The most elements a pipelined bucket holds (1 MiB of float32, DDP's first bucket): a
#: layer's pieces on one shard go together up to it, so that frames stay few.
BUCKET_ELEMENTS = 1 << 18


def bucket_shards(buckets: list[list[Shard | None]]) -> list[int]:
    """The shard of each of :func:`pipeline_buckets`' buckets (each is one shard's part)."""
    return [next(s for s, part in enumerate(parts) if part is not None) for parts in buckets]


def pipeline_buckets(shards: tuple[Shard, ...], limit: int = BUCKET_ELEMENTS) -> list[list[Shard | None]]:
    """The pipelined iteration's buckets in the order backward produces them: each quantized
    layer, last layer first, then the small layers (float32, complete only when backward
    ends). A layer's pieces (``--shard-chunk``'s chunks) on one shard form buckets of
    consecutive pieces of at most ``limit`` elements (a larger piece alone); shard by shard.
    ``buckets[b][s]``: bucket b as shard s's part, None on every other shard. Every rank
    computes the same list from the same shards, so a frame's place in the sequence of its
    (sender, receiver) pair says which bucket it is."""
    layers = sorted({p.layer for shard in shards for p in shard.pieces}, key=lambda layer: (layer < 0, -layer))
    buckets: list[list[Shard | None]] = []
    for layer in layers:
        for shard in shards:
            group: list[Piece] = []
            for piece in [p for p in shard.pieces if p.layer == layer] + [None]:
                if group and (piece is None or sum(p.size for p in group) + piece.size > limit):
                    parts: list[Shard | None] = [None] * len(shards)
                    parts[shard.server] = Shard(shard.server, tuple(group), len(buckets))
                    buckets.append(parts)
                    group = []
                if piece is not None:
                    group.append(piece)
    return buckets
