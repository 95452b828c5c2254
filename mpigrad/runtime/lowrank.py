"""PowerSGD's two rounds on one rank (``--codec powersgd``): the factors, their wire layout,
the error-feedback memory and the warm-started Q.

The low-rank layers are the layout's "quantized" layers (``Replica`` picks them by the
codec's rule, ``PowerSGD.compresses``); each is viewed as an n x m matrix (n its first
dimension, a convolution's kernel flattened into m) and gets rank r = min(n, m, rank). With
M_i = g_i + e_i (worker i's gradient plus its error memory) and Q the shared m x r matrix:

- round 1 (``gradients``/``broadcast``): worker i sends P_i = M_i Q for every low-rank layer,
  and the other layers as they are (float32); the server sums in rank order, averages,
  orthogonalises each layer's P (Gram-Schmidt for r <= 2, QR beyond, as torch's hook) and
  broadcasts P^ with the other layers' average;
- round 2 (``gradients2``/``broadcast2``): worker i sends Q_i = M_i^T P^; the server sums in
  rank order, averages and broadcasts Q;
- every rank applies M^ = P^ Q^T (the other layers: round 1's average); worker i keeps
  e_i = M_i - M^ and Q for the next iteration, where it is orthogonalised again before use
  (warm start). The first Q is drawn from the run's seed, per layer, identically on every
  rank, and orthogonalised.

With ``factor_bits`` below 32 the factors travel through another codec (``uniform`` or
``fp16``, ``PowerSGD.factor_codec``) in both directions, and with ``rest_bits`` below 32 the
other layers too (``PowerSGD.rest_codec``). Every rank decodes the broadcasts into
``p_buf``/``q_buf`` and applies the decoded P^ Q^T, so e_i = M_i - M^ holds every
quantization error of the iteration (the workers' P_i and Q_i, the server's P^ and Q), not
only the rank's truncation; P^ is orthogonalised before its encode and not again after the
decode (8 bits: max |P^T P - I| below 4e-3 on random matrices, 4 bits about 0.02-0.03;
docs/codecs.rst). With a quantized rest the workers keep e_i = M_i - (decoded average) for
those layers as well, M_i = g_i + e_i: torch's hook keeps that memory for its uncompressed
layers too.

Each round's frame is an ordinary gradient frame (``FrameHeader`` and one codec buffer per
piece) over a *factor layout*: round 1's pieces are the P factors (piece = layer index) and
the other layers' float32 piece, round 2's the Q factors; with S servers (or colocated
ones) each server's factor shard (``rounds[r][s]``) holds the factors of the layers of its
layout shard, and the float32 piece where that shard holds the small layers. The servers'
``ShardAggregator`` and ``GradientCompressor`` handle them as they handle gradients. All
matrix products are float32 torch on the CPU, computed alike on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..codecs import Codec
from .build import derive_seed
from .compressor import GradientCompressor
from .layout import Piece, Shard

#: The stream number of the first Q's draw (derive_seed(seed, LOWRANK_STREAM, layer)).
LOWRANK_STREAM = 1 << 20


@dataclass(frozen=True)
class LowRankLayer:
    layer: int      # index among the layout's quantized (low-rank) layers
    offset: int     # in the flat parameter buffer
    n: int
    m: int
    r: int
    p_offset: int   # in the round-1 buffer
    q_offset: int   # in the round-2 buffer


def orthogonalize(matrix: torch.Tensor) -> None:
    """Orthonormalise the columns of an n x r float32 matrix in place, as torch's PowerSGD
    hook does (``orthogonalization_epsilon`` 0): Gram-Schmidt for r <= 2, QR beyond. A zero
    column (a layer whose gradient vanished) becomes zeros instead of NaN."""
    rank = matrix.shape[1]
    if rank > 2:
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return
    for i in range(rank):
        col = matrix[:, i:i + 1]
        norm = torch.norm(col)
        if norm > 0:
            col /= norm
        else:
            col.zero_()
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


class LowRank:
    """One rank's PowerSGD: the factor layouts and buffers; on a worker also its error memory
    and Q (``worker=True``). ``state_dict`` holds what a checkpoint needs (Q and the memory)."""

    def __init__(self, model: torch.nn.Module, layout, codec: Codec, seed: int, worker: bool, shards=None):
        """``shards``: the run's layout shards (one per server; None: one server). Server s
        aggregates the factors of the low-rank layers of its shard, and the other layers'
        float32 piece when it holds it: ``rounds[0][s]`` and ``rounds[1][s]``."""
        self.codec, self.seed, self.worker = codec, seed, worker
        params = dict(model.named_parameters())
        layers, p_off, q_off = [], 0, 0
        for index, segment in enumerate(layout.quantized):
            n, m = codec.matrix_shape(params[segment.name].shape)
            r = codec.matrix_rank(n, m)
            layers.append(LowRankLayer(index, segment.offset, n, m, r, p_off, q_off))
            p_off, q_off = p_off + n * r, q_off + m * r
        self.layers = layers
        self.rest = layout.rest
        #: The low-rank layers fill the flat buffer's [0, matrix_end) (they come first).
        self.matrix_end = layout.rest.offset
        #: The workers' error memory covers [0, memory_end): the low-rank layers, and the
        #: other layers when they are quantized (``rest_bits``).
        self.memory_end = layout.rest.offset + (layout.rest.size if codec.rest_memory else 0)
        pieces1 = [Piece(lay.layer, lay.layer, lay.p_offset, lay.n * lay.r) for lay in layers]
        if self.rest.size:
            pieces1.append(Piece(len(layers), -1, p_off, self.rest.size))
        pieces2 = [Piece(lay.layer, lay.layer, lay.q_offset, lay.m * lay.r) for lay in layers]
        if shards is None:
            shards = (Shard(0, tuple(Piece(p.index, p.layer, 0, 0) for p in pieces1)),)
        #: Per round, per server: the factor shard (pieces in layout order, as the layout shard's).
        self.rounds = tuple(
            tuple(Shard(shard.server, tuple(pieces[p.layer if p.quantized else len(layers)]
                                            for p in shard.pieces if p.quantized or len(pieces) > len(layers)))
                  for shard in shards)
            for pieces in (pieces1, pieces2))
        self.round1, self.round2 = self.rounds[0][0], self.rounds[1][0]
        self.p_size, self.q_size = p_off + self.rest.size, q_off
        self.p_buf = np.zeros(self.p_size, np.float32)   # round 1: P_i out, then P^ and the rest's average in
        self.q_buf = np.zeros(self.q_size, np.float32)   # round 2: Q_i out, then the average Q in
        # One compressor per round (their frame buffers are the rounds' own), the factors'
        # codec at its own fixed width, the other layers' codec in round 1.
        factors = codec.factor_codec()
        self.compressor1 = GradientCompressor(pieces1, factors, {}, rest_codec=codec.rest_codec(), policy_bits=False)
        self.compressor2 = GradientCompressor(pieces2, factors, {}, policy_bits=False)
        self.error: np.ndarray | None = None   # worker: e_i over [0, memory_end), from the first compressed iteration
        self.q_memory: np.ndarray | None = None  # worker: the last Q (round 2's layout)
        self.matrix = np.empty(self.memory_end if worker else 0, np.float32)  # worker: M_i

    def active(self, iteration: int) -> bool:
        return self.codec.active(iteration)

    # ---- views --------------------------------------------------------------------------
    def _mat(self, flat: np.ndarray, lay: LowRankLayer) -> torch.Tensor:
        return torch.from_numpy(flat[lay.offset:lay.offset + lay.n * lay.m]).view(lay.n, lay.m)

    def _p(self, buf: np.ndarray, lay: LowRankLayer) -> torch.Tensor:
        return torch.from_numpy(buf[lay.p_offset:lay.p_offset + lay.n * lay.r]).view(lay.n, lay.r)

    def _q(self, buf: np.ndarray, lay: LowRankLayer) -> torch.Tensor:
        return torch.from_numpy(buf[lay.q_offset:lay.q_offset + lay.m * lay.r]).view(lay.m, lay.r)

    # ---- a worker's two rounds ----------------------------------------------------------
    def first_factors(self, grad: np.ndarray) -> np.ndarray:
        """Round 1's vector: M_i = g_i + e_i, P_i = M_i Q per low-rank layer, then the other
        layers' gradient (plus their error memory when they are quantized; a view of ``p_buf``)."""
        if self.error is None:  # the first compressed iteration: memory and Q from zero and the seed
            self.error = np.zeros(self.memory_end, np.float32)
            self.q_memory = np.empty(self.q_size, np.float32)
            for lay in self.layers:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, LOWRANK_STREAM, lay.layer))
                self._q(self.q_memory, lay).copy_(torch.randn(lay.m, lay.r, generator=generator))
        np.add(grad[:self.memory_end], self.error, out=self.matrix)
        for lay in self.layers:
            q = self._q(self.q_memory, lay)
            orthogonalize(q)
            torch.matmul(self._mat(self.matrix, lay), q, out=self._p(self.p_buf, lay))
        rest = self.p_size - self.rest.size
        source = self.matrix if self.memory_end > self.matrix_end else grad
        self.p_buf[rest:] = source[self.rest.offset:self.rest.offset + self.rest.size]
        return self.p_buf

    def second_factors(self) -> np.ndarray:
        """Round 2's vector: Q_i = M_i^T P^ per layer (P^ decoded into ``p_buf``)."""
        for lay in self.layers:
            torch.matmul(self._mat(self.matrix, lay).t(), self._p(self.p_buf, lay), out=self._q(self.q_buf, lay))
        return self.q_buf

    # ---- the server's part --------------------------------------------------------------
    def orthogonalizer(self, shard: Shard):
        """Round 1's transform for server ``shard.server``: orthogonalise in place each P of
        its shard in the average, before the broadcast."""
        def transform(average: np.ndarray) -> None:
            for piece in shard.pieces:
                if piece.quantized:
                    orthogonalize(self._p(average, self.layers[piece.layer]))
        return transform

    def frame_sizes(self, bits) -> tuple[list[int], list[int]]:
        """Each server's frame bytes in round 1 and round 2 (fixed by the layout and the
        widths, the same for every worker and for the broadcast: float32, fp16 and uniform
        buffers have sizes set by their element counts)."""
        return tuple([compressor.capacity(shard, bits) for shard in shards]
                     for compressor, shards in ((self.compressor1, self.rounds[0]), (self.compressor2, self.rounds[1])))

    # ---- every rank: the update ---------------------------------------------------------
    def apply(self, update: np.ndarray) -> None:
        """Write M^ = P^ Q^T (``p_buf``, ``q_buf`` hold the broadcasts) and the other layers'
        average into the flat ``update``; a worker then keeps e_i = M_i - M^ (over
        ``memory_end``) and Q."""
        for lay in self.layers:
            torch.matmul(self._p(self.p_buf, lay), self._q(self.q_buf, lay).t(), out=self._mat(update, lay))
        rest = self.p_size - self.rest.size
        update[self.rest.offset:self.rest.offset + self.rest.size] = self.p_buf[rest:]
        if self.worker:
            np.subtract(self.matrix, update[:self.memory_end], out=self.error)
            self.q_memory[:] = self.q_buf

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.error is None:
            return {"error": None, "q": None}
        return {"error": torch.from_numpy(self.error.copy()), "q": torch.from_numpy(self.q_memory.copy())}

    def load_state_dict(self, state: dict) -> None:
        if state["error"] is None:
            self.error = self.q_memory = None
            return
        error, q = state["error"].numpy(), state["q"].numpy()
        if error.size != self.memory_end or q.size != self.q_size:
            raise ValueError("checkpoint holds PowerSGD state of another model or rank")
        self.error = error.astype(np.float32, copy=True)
        self.q_memory = q.astype(np.float32, copy=True)
