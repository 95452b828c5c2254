"""``powersgd``: low-rank compression (Vogels et al., *PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization*, NeurIPS 2019), the codec of its factors.

PowerSGD does not encode one vector on its own: each worker sends P_i = M_i Q (M_i its
gradient matrix plus its error-feedback memory, Q a shared m x r matrix), the server
averages and orthogonalises the P_i and broadcasts P^, each worker sends Q_i = M_i^T P^,
the server averages and broadcasts Q, and every rank applies P^ Q^T. The runtime runs those
two rounds (``mpigrad/runtime/exchange/lowrank.py``, the ``gradients2``/``broadcast2`` phases of
``runtime/roles/iteration.py``); this class is the family's configuration (``rank``,
``min_compression_rate``, ``start``), the rule that says which layers it compresses
(torch's ``_should_compress``), and the wire format of a factor: float32, 4 bytes per
element, like ``fp32`` under its own wire id (the factors are exact; the compression is the
rank). Before iteration ``start`` every layer travels as float32 in one round, as torch's
hook all-reduces before ``start_powerSGD_iter``.

``factor_bits`` and ``rest_bits`` (both 32 by default: float32) hand the factors, and the
layers PowerSGD leaves uncompressed, to another mpigrad codec instead: ``uniform`` at 1..8
bits (round to nearest, one min/max range per factor or per rest piece), or ``fp16`` at 16.
``uniform`` rather than ``qsgd``: its frame sizes are fixed by the element count, as the
float32 factors' are (rank 0 charges the rounds from the layout's sizes), and its rounding
error is at most half a step, deterministic, which the workers' error memory takes back
(the memory is measured against the decoded factors every rank applies).
"""

from __future__ import annotations

import numpy as np

from .base import Codec, CodecError, get_codec, register_codec
from .checks import check_int
from .fp import _FloatCodec

#: The widths ``factor_bits`` and ``rest_bits`` take, and the codec each width stands for.
FLOAT_WIDTHS = {32: "fp32", 16: "fp16"}
QUANTIZED_WIDTHS = range(1, 9)  # uniform


def setting_code(kind: str, value: int) -> int:
    """The Control's integer for a layer's setting: ``("rank", r)`` -> r, ``("width", b)`` -> -b."""
    if kind == "rank":
        return int(value)
    if kind == "width":
        return -int(value)
    raise ValueError(f"setting kind must be 'rank' or 'width', got {kind!r}")


def setting_of(code: int) -> tuple[str, int]:
    """The inverse of :func:`setting_code` (unchecked against any menu): ("rank", r) or ("width", b)."""
    return ("rank", int(code)) if code > 0 else ("width", -int(code))


def setting_label(code: int) -> str:
    """``r2`` for rank 2, ``b4`` for 4-bit uniform (traces, tables)."""
    kind, value = setting_of(code)
    return f"{'r' if kind == 'rank' else 'b'}{value}"


def check_menu(name: str, value, low: int, high: int) -> tuple[int, ...]:
    """``ranks``/``widths``: a list of whole numbers in [low, high], or one string ``"1,2,4"``
    (as ``--codec-opt ranks=1,2,4`` gives it); sorted, no repeats; () for none."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise CodecError(f"powersgd: {name} must be whole numbers separated by commas, got {value!r}") from None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise CodecError(f"powersgd: {name} must be a list of whole numbers, got {value!r}")
    items = [check_int(PowerSGD.codec_id, f"{name} entry", v, low, high) for v in value]
    if len(set(items)) != len(items):
        raise CodecError(f"powersgd: {name} repeats an entry: {value!r}")
    return tuple(sorted(items))


def check_width(name: str, value) -> int:
    """``factor_bits``/``rest_bits``: 1..8 (``uniform``), 16 (``fp16``) or 32 (float32)."""
    width = check_int(PowerSGD.codec_id, name, value, 1, 32)
    if width not in QUANTIZED_WIDTHS and width not in FLOAT_WIDTHS:
        raise CodecError(f"powersgd: {name} must be 1..8 (uniform), 16 (fp16) or 32 (float32), got {value!r}")
    return width


@register_codec
class PowerSGD(_FloatCodec):
    """Low-rank factors, float32. ``rank``: the approximation's rank r (at most min(n, m) per
    layer); ``min_compression_rate``: a layer viewed as n x m (n its first dimension) is
    compressed when (n + m) r * min_compression_rate < n m (torch's rule, default 2);
    ``start``: the first compressed iteration (before it, every layer float32);
    ``factor_bits``: the width of the factors P, P^, Q on the wire, 32 (float32, default), 16
    (``fp16``) or 1..8 (``uniform``, round to nearest, one range per factor);
    ``rest_bits``: the same for the layers it does not compress (the workers then keep an
    error memory for them too); ``ranks``/``widths``: the menus of a per-layer choice
    (module docstring), empty for every layer at ``rank``."""

    codec_id = "powersgd"
    wire_id = 8
    dtype = np.dtype(np.float32)
    nominal_bits = 32
    #: The runtime exchanges this codec's layers in two rounds (P, then Q).
    two_rounds = True

    def __init__(self, *, rank: int = 1, min_compression_rate: float = 2.0, start: int = 0,
                 factor_bits: int = 32, rest_bits: int = 32, ranks=(), widths=(), checksum: bool = False):
        super().__init__(checksum=checksum)
        self.rank = check_int(self.codec_id, "rank", rank, 1, 1 << 16)
        try:
            rate = float(min_compression_rate)
        except (TypeError, ValueError):
            raise CodecError(f"powersgd: min_compression_rate must be a number, got {min_compression_rate!r}") from None
        if not (np.isfinite(rate) and rate >= 1.0):
            raise CodecError(f"powersgd: min_compression_rate must be at least 1, got {min_compression_rate!r}")
        self.min_compression_rate = rate
        self.start = check_int(self.codec_id, "start", start, 0, 2**62)
        self.factor_bits = check_width("factor_bits", factor_bits)
        self.rest_bits = check_width("rest_bits", rest_bits)
        self.ranks = check_menu("ranks", ranks, 1, 1 << 16)
        self.widths = check_menu("widths", widths, 1, max(QUANTIZED_WIDTHS))
        if self.widths and not self.ranks:
            raise CodecError(f"powersgd: widths needs ranks too (ranks={self.rank} at least: rank is the "
                             "setting every layer starts at, and the policy's error budget)")
        if self.ranks and self.rank not in self.ranks:
            raise CodecError(f"powersgd: rank {self.rank} must be one of ranks {list(self.ranks)} "
                             "(it is every layer's first setting and the policy's error budget)")

    def _config(self):
        config = {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "start": self.start}
        # float32 (the default) stays out of the config: traces of float32 factors read as before
        config.update({name: width for name, width in (("factor_bits", self.factor_bits),
                                                         ("rest_bits", self.rest_bits)) if width != 32})
        config.update({name: list(menu) for name, menu in (("ranks", self.ranks), ("widths", self.widths)) if menu})
        return config

    # ---- per-layer settings (``ranks``/``widths``) --------------------------------------
    @property
    def mixed(self) -> bool:
        """True when a policy chooses each layer's setting from ``ranks`` and ``widths``."""
        return bool(self.ranks)

    @property
    def menu(self) -> tuple[int, ...]:
        """The setting codes a layer may take: the ranks, then the widths (as -b); (rank,) without menus."""
        if not self.mixed:
            return (self.rank,)
        return tuple(setting_code("rank", r) for r in self.ranks) + tuple(setting_code("width", b) for b in self.widths)

    @property
    def reference_setting(self) -> int:
        """Every layer's setting until a policy decides (and its error, the budget): rank ``rank``."""
        return setting_code("rank", self.rank)

    @property
    def max_rank(self) -> int:
        """The widest rank a layer may take: the columns of its Q memory."""
        return max(self.ranks) if self.mixed else self.rank

    def check_settings(self, codes, layers: int) -> tuple[int, ...]:
        """The Control's per-layer integers as setting codes: ``layers`` of them, each in
        ``menu``; CodecError (one line) otherwise. A decoder never trusts the wire."""
        codes = tuple(int(c) for c in codes)
        menu = self.menu
        if len(codes) < layers or any(c not in menu for c in codes[:layers]):
            raise CodecError(f"powersgd: settings {list(codes[:layers])} for {layers} layer(s) are not in "
                             f"the menu {[setting_label(c) for c in menu]} ({list(menu)})")
        return codes[:layers]

    def width_codec(self, width: int) -> Codec:
        """The codec of a whole layer sent at ``width`` bits (``uniform``, round to nearest)."""
        return self._width_codec(width)

    @property
    def fixed_bits(self) -> int:
        """A trace's ``bits`` columns: the factors' width."""
        return self.factor_bits

    def _width_codec(self, width: int) -> Codec:
        if width in FLOAT_WIDTHS:
            return get_codec({"id": FLOAT_WIDTHS[width], "checksum": self.checksum})
        return get_codec({"id": "uniform", "bits": width, "checksum": self.checksum})

    def wire_codecs(self, widths=()) -> list[Codec]:
        """This codec (float32 factors and warm-up iterations), its factor and rest codecs,
        and the codec of each width in the menu (``widths``: a policy's are ignored, the
        menu is this codec's own)."""
        return [self, self.factor_codec(), self.rest_codec(), *(self._width_codec(b) for b in self.widths)]

    def factor_codec(self) -> Codec:
        """The codec of one factor on the wire: this one (float32, wire id 8) at 32 bits,
        else ``fp16`` or ``uniform`` at ``factor_bits``, its bits fixed (no policy moves them)."""
        return self if self.factor_bits == 32 else self._width_codec(self.factor_bits)

    def rest_codec(self) -> Codec:
        """The codec of the uncompressed layers' piece: ``fp32``, ``fp16`` or ``uniform``."""
        return self._width_codec(self.rest_bits)

    @property
    def rest_memory(self) -> bool:
        """True when the uncompressed layers are quantized, so the workers keep their error."""
        return self.rest_bits != 32

    @staticmethod
    def matrix_shape(shape) -> tuple[int, int]:
        """A tensor of ``shape`` as the n x m matrix PowerSGD compresses (n = shape[0])."""
        shape = tuple(int(d) for d in shape)
        n = shape[0] if shape else 1
        return n, int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1

    def matrix_rank(self, n: int, m: int) -> int:
        return min(n, m, self.rank)

    def compresses(self, shape) -> bool:
        """True for a tensor of at least 2 dimensions whose n x m view PowerSGD compresses:
        (n + m) r * min_compression_rate < n m, r = min(n, m, rank) (torch's ``_should_compress``)."""
        if len(tuple(shape)) < 2:
            return False
        n, m = self.matrix_shape(shape)
        return (n + m) * self.matrix_rank(n, m) * self.min_compression_rate < n * m

    def active(self, iteration: int) -> bool:
        """True when iteration ``iteration`` is compressed (from ``start`` on)."""
        return iteration >= self.start
