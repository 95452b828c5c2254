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
matrix products are float32 torch on the CPU, computed alike on every rank (with the thin
factor on the left: ``times_factor``, ``outer_products``).

Per-layer settings (``--codec-opt ranks=1,2,4 widths=2,4,8`` and a policy that chooses them,
``lgreco``): the Control's per-layer integers are setting codes (``PowerSGD.check_settings``
checks them on every rank: r > 0 rank r, -b width b). A rank-r layer goes as above with
r = min(n, m, r); a width-b layer goes whole in round 1 (``uniform`` at b bits over the
layer's M_i, the server averages and re-encodes it) and has no piece in round 2; every
rank applies the decoded average, and e_i = M_i - (what every rank applied) in both cases.
The factor layouts, buffers and compressors of one setting vector are a :class:`FactorPlan`,
built once per distinct vector and kept (the last ``PLAN_CACHE`` of them); ``select`` makes
one the iteration's. Each layer's Q memory has the menu's largest rank R = min(n, m,
max(ranks)) columns; rank r uses (and after the round writes back) its first r columns, the
others keep their last values, and a width layer leaves its Q as it was. The first r
columns of the orthonormalised m x R Q are those of orthonormalising the first r alone
(Gram-Schmidt works column by column), so a layer that moves between ranks keeps its
warm start. torch's hook has no per-layer rank (one ``matrix_approximation_rank`` for
every layer, its Q memory allocated once at that rank); we did not find how L-GreCo's own
code carries Q across a rank change. Without menus there is one plan, every layer at
``rank``, and the rounds are those above, bit for bit.

Workers measure, when rank 0's Control asks (``Control.measure``), each layer's error at
every setting of the menu on their own M_i (``setting_errors``), for the policy: a rank
r's is the squared error of the rank-r approximation the codec would send from the current
Q, one power iteration (||M_i||^2 - ||M_i^T P||^2, P = orth(M_i Q[:, :r]), float32 factors),
a width b's that of ``uniform`` at b bits over the layer. Rank 0 averages them over the
workers (``setting_sizes``: each setting's bytes on the wire, from the layout). On the
hierarchical exchange a worker measures only its slice's layers, on its node's M_k (the
matrix that crosses the NIC), and rank 0 averages each layer over the nodes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ...codecs import Codec
from ...codecs.powersgd import setting_of
from .build import derive_seed
from .compressor import GradientCompressor
from ..plan.layout import Piece, Shard

#: The stream number of the first Q's draw (derive_seed(seed, LOWRANK_STREAM, layer)).
LOWRANK_STREAM = 1 << 20
#: How many setting vectors' plans a rank keeps (a policy changes them every ``interval``).
PLAN_CACHE = 4


@dataclass(frozen=True)
class LowRankLayer:
    layer: int      # index among the layout's quantized (low-rank) layers
    offset: int     # in the flat parameter buffer
    n: int
    m: int
    r: int          # the rank it travels at; 0: sent whole at ``width`` bits
    p_offset: int   # in the round-1 buffer
    q_offset: int   # in the round-2 buffer (unused when r == 0)
    width: int = 0  # bits of a layer sent whole (r == 0)

    @property
    def p_size(self) -> int:
        return self.n * self.r if self.r else self.n * self.m


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


# The products of thin factors, in the forms that torch's CPU BLAS (MKL) computes fast. With
# r of 1 or 2, M Q and M^T P as written took 1.5 and 10 ms on a 2048 x 1024 layer (one
# thread), against 0.2 ms for the same products with the thin operand on the left; P Q^T
# took 1.3 ms, against 0.2 for its r outer products summed (docs/runtime.rst, "Two-round
# codecs"). Float noise apart, the same numbers; every rank computes them alike.
OUTER_SUM_RANKS = 8  # above it one matrix product beats r passes over the layer


def times_factor(matrix: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (k x r) = ``matrix``^T (k x n) @ ``factor`` (n x r) when given ``matrix`` n x k:
    computed as (factor^T matrix)^T, the thin operand on the left."""
    out.copy_(torch.matmul(factor.t().contiguous(), matrix).t())


def outer_products(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (n x m) = ``p`` (n x r) @ ``q``^T (q: m x r): the sum of r outer products, for
    small r; one matrix product beyond ``OUTER_SUM_RANKS``."""
    r = p.shape[1]
    if r > OUTER_SUM_RANKS:
        torch.matmul(p, q.t(), out=out)
        return
    rows = q.t().contiguous()
    torch.mul(p[:, 0:1], rows[0:1], out=out)
    for k in range(1, r):
        out.addcmul_(p[:, k:k + 1], rows[k:k + 1])


class FactorPlan:
    """The two rounds' layouts for one setting vector: the layers (rank or width each), the
    factor shards per round and server, the round buffers and one compressor per round.
    ``aggregators``: a server's (or serving worker's) per-round aggregators of this plan,
    filled by the role on first use."""

    def __init__(self, owner: "LowRank", codes: tuple[int, ...] | None):
        codec, shapes = owner.codec, owner.shapes
        layers, p_off, q_off = [], 0, 0
        widths = {}
        for index, (offset, n, m, _) in enumerate(shapes):
            kind, value = ("rank", codec.rank) if codes is None else setting_of(codes[index])
            if kind == "rank":
                r = min(n, m, value)
                layers.append(LowRankLayer(index, offset, n, m, r, p_off, q_off))
                q_off += m * r
            else:
                layers.append(LowRankLayer(index, offset, n, m, 0, p_off, q_off, value))
                widths[index] = codec.width_codec(value)
            p_off += layers[-1].p_size
        self.layers = layers
        rest = owner.rest
        pieces1 = [Piece(lay.layer, lay.layer, lay.p_offset, lay.p_size) for lay in layers]
        if rest.size:
            pieces1.append(Piece(len(layers), -1, p_off, rest.size))
        factored = [lay for lay in layers if lay.r]
        pieces2 = {lay.layer: Piece(i, lay.layer, lay.q_offset, lay.m * lay.r) for i, lay in enumerate(factored)}
        shards = owner.shards
        if shards is None:
            shards = (Shard(0, tuple(Piece(p.index, p.layer, 0, 0) for p in pieces1)),)
        #: Per round, per server: the factor shard (pieces in layout order, as the layout shard's).
        self.rounds = (
            tuple(Shard(shard.server, tuple(pieces1[p.layer if p.quantized else len(layers)]
                                            for p in shard.pieces if p.quantized or rest.size))
                  for shard in shards),
            tuple(Shard(shard.server, tuple(pieces2[p.layer] for p in shard.pieces
                                            if p.quantized and p.layer in pieces2))
                  for shard in shards))
        self.p_size, self.q_size = p_off + rest.size, q_off
        self.p_buf = np.zeros(self.p_size, np.float32)   # round 1: P_i out, then P^ and the rest's average in
        self.q_buf = np.zeros(self.q_size, np.float32)   # round 2: Q_i out, then the average Q in
        # One compressor per round (their frame buffers are the rounds' own), the factors'
        # codec at its own fixed width, a whole layer's at its width, the other layers' codec in round 1.
        factors = codec.factor_codec()
        self.compressor1 = GradientCompressor(pieces1, factors, {}, rest_codec=codec.rest_codec(), policy_bits=False,
                                              piece_codecs=widths)
        self.compressor2 = GradientCompressor(list(pieces2.values()), factors, {}, policy_bits=False)
        self.aggregators = None

    def frame_sizes(self) -> tuple[list[int], list[int]]:
        """Each server's frame bytes in round 1 and round 2 (fixed by the layout and the
        settings, the same for every worker and for the broadcast: float32, fp16 and uniform
        buffers have sizes set by their element counts)."""
        no_bits = [0] * len(self.layers)  # the factor codecs' widths are their own
        return tuple([compressor.capacity(shard, no_bits) for shard in shards]
                     for compressor, shards in ((self.compressor1, self.rounds[0]), (self.compressor2, self.rounds[1])))


class LowRank:
    """One rank's PowerSGD: the factor plans; on a worker also its error memory and Q
    (``worker=True``). ``state_dict`` holds what a checkpoint needs (Q and the memory)."""

    def __init__(self, model: torch.nn.Module, layout, codec: Codec, seed: int, worker: bool, shards=None):
        """``shards``: the run's layout shards (one per server; None: one server). Server s
        aggregates the factors of the low-rank layers of its shard, and the other layers'
        float32 piece when it holds it: ``rounds[0][s]`` and ``rounds[1][s]``."""
        self.codec, self.seed, self.worker, self.shards = codec, seed, worker, shards
        params = dict(model.named_parameters())
        #: Per low-rank layer: (offset in the flat buffer, n, m, offset of its m x R Q memory).
        shapes, q_mem = [], 0
        for segment in layout.quantized:
            n, m = codec.matrix_shape(params[segment.name].shape)
            shapes.append((segment.offset, n, m, q_mem))
            q_mem += m * min(n, m, codec.max_rank)
        self.shapes = shapes
        self.q_memory_size = q_mem
        self.rest = layout.rest
        #: The low-rank layers fill the flat buffer's [0, matrix_end) (they come first).
        self.matrix_end = layout.rest.offset
        #: The workers' error memory covers [0, memory_end): the low-rank layers, and the
        #: other layers when they are quantized (``rest_bits``).
        self.memory_end = layout.rest.offset + (layout.rest.size if codec.rest_memory else 0)
        self._plans: OrderedDict = OrderedDict()
        self.current = self.plan(None)
        self.error: np.ndarray | None = None   # worker: e_i over [0, memory_end), from the first compressed iteration
        self.q_memory: np.ndarray | None = None  # worker: each layer's last Q, m x R
        self.matrix = np.empty(self.memory_end if worker else 0, np.float32)  # worker: M_i
        #: The low-rank layers whose factors this worker computes and whose update it writes,
        #: and whether the other layers' piece is among them (None: all; ``own``).
        self.owned: frozenset[int] | None = None
        self.owns_rest = True

    def own(self, shards) -> None:
        """Compute and apply only the layers of ``shards`` (whole-layer factor shards: a
        hierarchical exchange's slice, whose other layers the node's other workers own);
        the error memory, M_i and the update are then kept over those layers alone."""
        self.owned = frozenset(piece.layer for shard in shards for piece in shard.pieces if piece.quantized)
        self.owns_rest = any(not piece.quantized for shard in shards for piece in shard.pieces)

    def _owns(self, layer: int) -> bool:
        return self.owned is None or layer in self.owned

    def _memory_ranges(self) -> list[tuple[int, int]]:
        """The (offset, end) ranges of [0, memory_end) this worker keeps M_i and e_i over."""
        if self.owned is None:
            return [(0, self.memory_end)]
        ranges = [(offset, offset + n * m) for layer, (offset, n, m, _) in enumerate(self.shapes) if layer in self.owned]
        if self.owns_rest and self.memory_end > self.matrix_end:
            ranges.append((self.matrix_end, self.memory_end))
        return ranges

    # ---- plans --------------------------------------------------------------------------
    def plan(self, codes) -> FactorPlan:
        """The plan of setting vector ``codes`` (checked against the codec's menu; ignored
        without menus: one plan, every layer at ``rank``; None: every layer at ``rank``)."""
        if not self.codec.mixed or codes is None:
            key = None
        else:
            key = self.codec.check_settings(codes, len(self.shapes))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = FactorPlan(self, key)
            while len(self._plans) > PLAN_CACHE:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def select(self, codes) -> FactorPlan:
        """Make the plan of ``codes`` (the Control's per-layer integers) this iteration's."""
        self.current = self.plan(codes)
        return self.current

    # The running plan's layout, as the roles use it.
    layers = property(lambda self: self.current.layers)
    rounds = property(lambda self: self.current.rounds)
    round1 = property(lambda self: self.current.rounds[0][0])
    round2 = property(lambda self: self.current.rounds[1][0])
    compressor1 = property(lambda self: self.current.compressor1)
    compressor2 = property(lambda self: self.current.compressor2)
    p_buf = property(lambda self: self.current.p_buf)
    q_buf = property(lambda self: self.current.q_buf)
    p_size = property(lambda self: self.current.p_size)
    q_size = property(lambda self: self.current.q_size)

    def active(self, iteration: int) -> bool:
        return self.codec.active(iteration)

    # ---- views --------------------------------------------------------------------------
    def _mat(self, flat: np.ndarray, lay) -> torch.Tensor:
        return torch.from_numpy(flat[lay.offset:lay.offset + lay.n * lay.m]).view(lay.n, lay.m)

    def _p(self, buf: np.ndarray, lay: LowRankLayer) -> torch.Tensor:
        return torch.from_numpy(buf[lay.p_offset:lay.p_offset + lay.n * lay.r]).view(lay.n, lay.r)

    def _q(self, buf: np.ndarray, lay: LowRankLayer) -> torch.Tensor:
        return torch.from_numpy(buf[lay.q_offset:lay.q_offset + lay.m * lay.r]).view(lay.m, lay.r)

    def _q_memory(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s Q memory, m x R."""
        _, n, m, offset = self.shapes[layer]
        wide = min(n, m, self.codec.max_rank)
        return torch.from_numpy(self.q_memory[offset:offset + m * wide]).view(m, wide)

    def _start_q(self, layer: int, r: int, copy: bool = False) -> torch.Tensor:
        """The orthonormalised first r columns of the layer's Q memory (in the memory itself
        when r is all of it and not ``copy``, as without menus; else a copy)."""
        q = self._q_memory(layer)
        if copy or r < q.shape[1]:
            q = q[:, :r].contiguous()
        orthogonalize(q)
        return q

    # ---- a worker's two rounds ----------------------------------------------------------
    def first_factors(self, grad: np.ndarray) -> np.ndarray:
        """Round 1's vector: M_i = g_i + e_i, P_i = M_i Q per rank layer (M_i itself per width
        layer), then the other layers' gradient (plus their error memory when they are
        quantized; a view of ``p_buf``)."""
        if self.error is None:  # the first compressed iteration: memory and Q from zero and the seed
            self.error = np.zeros(self.memory_end, np.float32)
            self.q_memory = np.empty(self.q_memory_size, np.float32)
            for layer in range(len(self.shapes)):
                generator = torch.Generator().manual_seed(derive_seed(self.seed, LOWRANK_STREAM, layer))
                q = self._q_memory(layer)
                q.copy_(torch.randn(q.shape[0], q.shape[1], generator=generator))
        for begin, end in self._memory_ranges():
            np.add(grad[begin:end], self.error[begin:end], out=self.matrix[begin:end])
        p_buf = self.p_buf
        for lay in self.layers:
            if not self._owns(lay.layer):
                continue
            if lay.r:
                times_factor(self._mat(self.matrix, lay).t(), self._start_q(lay.layer, lay.r), self._p(p_buf, lay))
            else:
                p_buf[lay.p_offset:lay.p_offset + lay.p_size] = self.matrix[lay.offset:lay.offset + lay.p_size]
        if self.owns_rest:
            rest = self.p_size - self.rest.size
            source = self.matrix if self.memory_end > self.matrix_end else grad
            p_buf[rest:] = source[self.rest.offset:self.rest.offset + self.rest.size]
        return p_buf

    def second_factors(self) -> np.ndarray:
        """Round 2's vector: Q_i = M_i^T P^ per rank layer (P^ decoded into ``p_buf``)."""
        for lay in self.layers:
            if lay.r and self._owns(lay.layer):
                times_factor(self._mat(self.matrix, lay), self._p(self.p_buf, lay), self._q(self.q_buf, lay))
        return self.q_buf

    # ---- the server's part --------------------------------------------------------------
    def orthogonalizer(self, shard: Shard):
        """Round 1's transform for server ``shard.server``: orthogonalise in place each P of
        its shard in the average, before the broadcast (a whole layer stays as it is)."""
        layers = self.layers

        def transform(average: np.ndarray) -> None:
            for piece in shard.pieces:
                if piece.quantized and layers[piece.layer].r:
                    orthogonalize(self._p(average, layers[piece.layer]))
        return transform

    def frame_sizes(self, codes) -> tuple[list[int], list[int]]:
        """Each server's frame bytes in round 1 and round 2 under setting vector ``codes``
        (the Control's integers; ignored without menus): ``FactorPlan.frame_sizes``."""
        return self.plan(codes).frame_sizes()

    def setting_sizes(self) -> np.ndarray:
        """Layers x ``codec.menu``: the bytes a layer puts on the wire at each setting, one
        direction (both rounds' codec buffers: rank r's P and Q, width b's whole layer)."""
        codec, menu = self.codec, self.codec.menu
        factors = codec.factor_codec()
        sizes = np.zeros((len(self.shapes), len(menu)))
        for layer, (_, n, m, _) in enumerate(self.shapes):
            for k, code in enumerate(menu):
                kind, value = setting_of(code)
                if kind == "rank":
                    r = min(n, m, value)
                    sizes[layer, k] = factors.max_encoded_size(n * r) + factors.max_encoded_size(m * r)
                else:
                    sizes[layer, k] = codec.width_codec(value).max_encoded_size(n * m)
        return sizes

    def setting_errors(self) -> np.ndarray:
        """Worker, after a compressed iteration: layers x ``codec.menu``, the squared error of
        this worker's M_i at each setting (module docstring), float64; 0 for a layer it does
        not own (``own``: a hierarchical worker measures its slice's layers, on its node's M)."""
        codec, menu = self.codec, self.codec.menu
        errors = np.zeros((len(self.shapes), len(menu)))
        for layer, (offset, n, m, _) in enumerate(self.shapes):
            if not self._owns(layer):
                continue
            flat = self.matrix[offset:offset + n * m]
            matrix = torch.from_numpy(flat).view(n, m)
            energy = float(np.dot(flat.astype(np.float64), flat.astype(np.float64)))
            for k, code in enumerate(menu):
                kind, value = setting_of(code)
                if kind == "rank":
                    q_start = self._start_q(layer, min(n, m, value), copy=True)
                    p = torch.empty(n, q_start.shape[1])
                    times_factor(matrix.t(), q_start, p)
                    orthogonalize(p)
                    q = torch.empty(m, p.shape[1])
                    times_factor(matrix, p, q)
                    q = q.double()
                    errors[layer, k] = max(energy - float(torch.sum(q * q)), 0.0)
                else:
                    width = codec.width_codec(value)
                    diff = width.decode(width.encode(flat)).astype(np.float64) - flat
                    errors[layer, k] = float(np.dot(diff, diff))
        return errors

    # ---- every rank: the update ---------------------------------------------------------
    def apply(self, update: np.ndarray) -> None:
        """Write M^ = P^ Q^T (``p_buf``, ``q_buf`` hold the broadcasts) per rank layer, the
        decoded average per width layer and the other layers' average into the flat
        ``update``; a worker then keeps e_i = M_i - M^ (over ``memory_end``) and Q."""
        p_buf, q_buf = self.p_buf, self.q_buf
        for lay in self.layers:
            if not self._owns(lay.layer):
                continue
            if lay.r:
                outer_products(self._p(p_buf, lay), self._q(q_buf, lay), self._mat(update, lay))
            else:
                update[lay.offset:lay.offset + lay.p_size] = p_buf[lay.p_offset:lay.p_offset + lay.p_size]
        if self.owns_rest:
            rest = self.p_size - self.rest.size
            update[self.rest.offset:self.rest.offset + self.rest.size] = p_buf[rest:]
        if self.worker:
            for begin, end in self._memory_ranges():
                np.subtract(self.matrix[begin:end], update[begin:end], out=self.error[begin:end])
            if not self.codec.mixed and self.owned is None:  # one plan: Q memory and round 2 share their layout
                self.q_memory[:] = q_buf
                return
            for lay in self.layers:  # each layer's own (the owned ones': the others' Q stays as it was)
                if lay.r and self._owns(lay.layer):
                    self._q_memory(lay.layer)[:, :lay.r] = self._q(q_buf, lay)

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
        if error.size != self.memory_end or q.size != self.q_memory_size:
            raise ValueError("checkpoint holds PowerSGD state of another model or rank")
        self.error = error.astype(np.float32, copy=True)
        self.q_memory = q.astype(np.float32, copy=True)
