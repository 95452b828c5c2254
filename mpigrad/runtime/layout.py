"""Where each communicated piece of the gradient sits, and which server owns it.

The flat parameter buffer is laid out as [quantized layers in model order, then every small
layer]. A *piece* is one codec buffer on the wire: a quantized layer, or the small layers
together as float32 (with ``shard_chunk``, a chunk of either). A *shard* is the
set of pieces one server aggregates; shards are balanced by bytes with whole pieces
(layer-aligned unless ``shard_chunk`` cuts large layers, which changes the codec's min/max
scaling because each chunk is quantized on its own).
"""

from __future__ import annotations

from dataclasses import dataclass


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


def pieces_of(layout: Layout, chunk: int = 0) -> list[Piece]:
    """The layout's pieces: each quantized layer, then the small layers as float32, each cut
    into ``chunk``-element pieces when ``chunk`` > 0 and it is larger. Cutting the small
    layers changes no loss or parameter (float32 adds element by element, in rank order,
    wherever the elements sit; only a header per piece is added) but lets the servers share
    them: at 2 bits the small layers' float32 bytes outweigh a quantized shard's several
    times over."""
    pieces: list[Piece] = []
    for layer, segment in [*enumerate(layout.quantized), (-1, layout.rest)]:
        if not segment.size:
            continue
        step = chunk if chunk and segment.size > chunk else segment.size
        for start in range(0, segment.size, step):
            pieces.append(Piece(len(pieces), layer, segment.offset + start, min(step, segment.size - start)))
    return pieces


def plan_shards(layout: Layout, servers: int, piece_bytes, chunk: int = 0) -> tuple[Shard, ...]:
    """Split the layout over ``servers`` shards, balanced by ``piece_bytes(piece)``.

    Largest piece first onto the least-loaded server (ties: the lower server), then each
    shard's pieces back in layout order. With one server, shard 0 holds every piece and
    frames are laid out exactly as a single server's. A server may own no piece when there
    are fewer pieces than servers; its frames are then empty of segments.
    """
    pieces = pieces_of(layout, chunk)
    if servers == 1:
        return (Shard(0, tuple(pieces)),)
    loads = [0] * servers
    owned: list[list[Piece]] = [[] for _ in range(servers)]
    for piece in sorted(pieces, key=lambda p: (-piece_bytes(p), p.index)):
        target = min(range(servers), key=lambda s: (loads[s], s))
        owned[target].append(piece)
        loads[target] += piece_bytes(piece)
    return tuple(Shard(s, tuple(sorted(owned[s], key=lambda p: p.index))) for s in range(servers))


#: The most elements a pipelined bucket holds (1 MiB of float32, DDP's first bucket): a
#: layer's pieces on one shard go together up to it, so that frames stay few.
BUCKET_ELEMENTS = 1 << 18


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
