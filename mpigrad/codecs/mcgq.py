"""``mcgq``: Monte Carlo Gradient Quantization (Mordido, CVPR-W 2020) with its RLE scheme.

Sampling (Alg. 1). N = ceil(n * K) stratified samples x_i = (xi + i) / N, i = 0..N-1,
with ONE uniform xi per encode call from the counter RNG (the paper's systematic
sampling); element k's count is the number of samples that land in its share of the CDF
of |g| / ||g||_1, signed like g_k. The CDF is built from integer weights
``w_k = round(|g_k| / max|g| * 2**M)``, M = 62 - bit_length(n), so it is an exact prefix
sum that no summation order changes; magnitudes below 2**-(M+1) max|g| get weight 0 and
are never sampled. One monotone pass counts all samples without a search: the number of
samples below cumulative weight C is ceil(C * N / W - xi), W the total weight. Each count
is floor(N p_k) or ceil(N p_k) (p_k = w_k / W), and E[count_k] = N p_k.

Scaling (SGD): decode returns count_k * s with s = ||g||_1 / N = W * max|g| * 2**-M / N,
so E[decode(encode(g))] = g up to the weight rounding, and |decoded_k - g_k| <= s.

RLE stream (Sec. 3.4), MSB-first: 32-bit B_g, 32-bit B_RLE, then per token either a
non-zero count in B_g bits (sign bit, then magnitude) or a zero run (B_g zero bits, then
its length in B_RLE bits). B_g = 1 + bit_length(max|count|), B_RLE = bit_length(longest
zero run); the paper's example [2,-1,0,0,0,3,0,1] costs exactly 86 bits
(``rle_stream_bits``). Edge cases: an all-zero (or empty) input has B_g = 1 and one run
of n (no samples are drawn, s = 0, N recorded as 0); with no zeros B_RLE = 0 and no run
code appears; runs are never split, as B_RLE is sized by the longest run.

Buffer: header bits = B_g, param_a/param_b = low/high 32 bits of N; payload = float32 s
(little-endian), then the RLE stream zero-padded to whole bytes. Decoding checks every
code against the stream end and the element count, that the magnitudes sum to N, and that
B_g and B_RLE are exactly the widths the data needs.

Dynamic sampling (Alg. 3, its rule in ``mcgq_sampling``): ``MCGQ(dynamic=True, step=...,
K_min=..., K_max=...)`` adapts its own K after every encode from ``wasserstein1(x,
decode(buffer))`` (K is the initial amount; ``state_dict`` carries the current K and the
last distance). ``mcgq_sampling.DynamicSampling`` applies the same rule to many layers from
outside a plain codec, with per-call K in ``encode(x, K=...)``. The buffer is the same
either way: decoding needs neither K nor the adaptive state.
"""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Real
from typing import Any

import numpy as np

from .base import (HEADER_SIZE, MAX_ELEMENTS, Codec, CodecError, Header, _as_float32_vector,
                   non_finite_error, register_codec)
from .kernels import common, mcgq as kernels
from .. import options
from . import checks
from .mcgq_sampling import K_LIMIT, DynamicSampling, _wasserstein1, check_sampling_amount

__all__ = ["MCGQ", "rle_stream_bits", "rle_encode", "rle_decode", "sample_count"]

SCALE_BYTES = 4
PREAMBLE_BITS = 64
_FLT_MAX = float(np.finfo(np.float32).max)
_MAX_MAGNITUDE = 2**56 - 1
_NONFINITE_BITS = 0x7F800000


# ---- scalar helpers (shared with the NumPy twin) ----------------------------------------------
def sample_count(n: int, K: float) -> int:
    """N = ceil(n * K), with K read as the decimal it prints as (so 100 * 0.07 gives 7)."""
    return math.ceil(n * Fraction(repr(float(K))))


def weight_exponent(n: int) -> int:
    """M such that n weights of at most 2**M (plus rounding) sum below 2**63."""
    return 62 - int(n).bit_length()


def weight_factor(n: int, top_bits: int) -> float:
    """2**M / max|x|, from max|x|'s float32 bit pattern (0.0 for an all-zero input)."""
    if top_bits == 0:
        return 0.0
    top = float(np.uint32(top_bits).view(np.float32))
    return 2.0 ** weight_exponent(n) / top


def sampling_plan(n: int, K: float, top_bits: int, total: int) -> tuple[int, float, float]:
    """(N, N / W, s = ||g||_1 / N in float64) for total weight W; (0, 0.0, 0.0) when W = 0."""
    if total == 0:
        return 0, 0.0, 0.0
    n_samples = sample_count(n, K)
    top = float(np.uint32(top_bits).view(np.float32))
    unit = top * 2.0 ** -weight_exponent(n)
    return n_samples, float(n_samples) / float(total), float(total) * unit / float(n_samples)


def rle_widths(max_magnitude: int, longest_run: int) -> tuple[int, int]:
    """(B_g, B_RLE) = (1 + bit_length(max |v|), bit_length(longest zero run))."""
    return 1 + int(max_magnitude).bit_length(), int(longest_run).bit_length()


def rle_bits(value_bits: int, run_bits: int, nonzero: int, runs: int) -> int:
    return PREAMBLE_BITS + nonzero * value_bits + runs * (value_bits + run_bits)


def float32_scale(scale: float, max_count: int, n_samples: int) -> np.float32:
    """s as float32; CodecError when s or max|count| * s leaves the float32 range."""
    with np.errstate(over="ignore"):
        s32 = np.float32(scale)
    if not np.isfinite(s32) or max_count * float(s32) > _FLT_MAX:
        raise CodecError(f"mcgq: the sampled gradient exceeds float32 (||g||_1 / N = {scale:.3g} "
                         f"with N = {n_samples}); raise K or scale the gradient down")
    return s32


_STATUS_MESSAGES = {
    common.ERR_OVERRUN: "the RLE stream ends inside a code (truncated or corrupted)",
    common.ERR_BAD_CODE: "the RLE stream holds a code the format cannot contain",
    common.ERR_COUNT: "a zero run is longer than the elements left",
    common.ERR_TRAILING: "bytes or non-zero padding follow the last element",
    kernels.ERR_SAMPLES: "the decoded counts exceed the sample count N",
}


_MESSAGES = {code: f"corrupted payload ({detail})" for code, detail in _STATUS_MESSAGES.items()}


def raise_status(status: int) -> None:
    checks.raise_status("mcgq", status, _MESSAGES)


def stream_widths(stream: np.ndarray, n: int, max_value_bits: int) -> tuple[int, int]:
    """(B_g, B_RLE) from a stream's preamble, checked against what n elements allow."""
    if stream.size < PREAMBLE_BITS // 8:
        raise CodecError(f"mcgq: RLE stream of {stream.size} bytes is shorter than its 8-byte preamble")
    value_bits = int.from_bytes(stream[:4].tobytes(), "big")
    run_bits = int.from_bytes(stream[4:8].tobytes(), "big")
    if not 1 <= value_bits <= max_value_bits:
        raise CodecError(f"mcgq: corrupted payload (B_g = {value_bits}, expected 1..{max_value_bits})")
    if run_bits > int(n).bit_length():
        raise CodecError(f"mcgq: corrupted payload (B_RLE = {run_bits} for {n} elements)")
    return value_bits, run_bits


def check_decoded(widths: tuple[int, int], max_magnitude: int, longest_run: int) -> None:
    """The widths must be exactly those the decoded data needs (the encoder's choice)."""
    if widths != rle_widths(max_magnitude, longest_run):
        raise CodecError(f"mcgq: corrupted payload (B_g, B_RLE = {widths} do not match the data, "
                         f"which needs {rle_widths(max_magnitude, longest_run)})")


# ---- plain RLE on integers ----------------------------------------------------------------------
def _as_int_vector(values: Any) -> np.ndarray:
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind not in "iu":
        raise CodecError("mcgq RLE: values must be a 1-D numpy integer array")
    values = np.ascontiguousarray(values, dtype=np.int64)
    if values.size and int(np.abs(values).max()) > _MAX_MAGNITUDE:
        raise CodecError(f"mcgq RLE: magnitudes must be below 2**56, got {int(np.abs(values).max())}")
    return values


def rle_stream_bits(values: np.ndarray) -> int:
    """Exact length in bits of the Sec. 3.4 RLE stream of integer ``values`` (with the 64-bit preamble)."""
    max_mag, longest, nonzero, runs = kernels.int_stats(_as_int_vector(values))
    return rle_bits(*rle_widths(max_mag, longest), nonzero, runs)


def rle_encode(values: np.ndarray) -> np.ndarray:
    """The Sec. 3.4 RLE stream of integer ``values``, zero-padded to whole bytes (uint8)."""
    values = _as_int_vector(values)
    max_mag, longest, nonzero, runs = kernels.int_stats(values)
    widths = rle_widths(max_mag, longest)
    stream = np.empty(-(-rle_bits(*widths, nonzero, runs) // 8), np.uint8)
    kernels.int_write(values, *widths, stream)
    return stream


def rle_decode(stream: np.ndarray, n: int) -> np.ndarray:
    """Integers of an RLE stream holding ``n`` values; CodecError for any malformed stream."""
    if not isinstance(stream, np.ndarray) or stream.dtype != np.uint8 or stream.ndim != 1:
        raise CodecError("mcgq RLE: stream must be a 1-D numpy uint8 array")
    options.check_int("n", n, 0, MAX_ELEMENTS, error=CodecError, prefix="mcgq RLE: ")
    widths = stream_widths(stream, int(n), 57)
    out = np.empty(int(n), np.int64)
    status, _, max_mag, longest = kernels.rle_read(
        np.ascontiguousarray(stream), *widths, np.int64(1), np.int64(2**62), out)
    raise_status(status)
    check_decoded(widths, max_mag, longest)
    return out


# ---- the codec ----------------------------------------------------------------------------------
@register_codec
class MCGQ(Codec):
    """Monte Carlo gradient quantization with RLE: ceil(n * K) stratified samples.

    ``K`` in (0, 1024] is the default sampling amount; ``encode(x, K=k)`` overrides it
    for one call. Each encode consumes one RNG counter value. An instance keeps scratch
    arrays between calls: use one per thread.

    ``dynamic=True`` turns on dynamic sampling (Alg. 3) inside the instance: ``K`` becomes
    the initial amount, each encode samples with the current amount, then decodes its own
    buffer and moves the amount by ``step * (d' - d)`` within [``K_min``, ``K_max``]
    (``DynamicSampling``'s rule and defaults). Use one instance per layer. ``step``,
    ``K_min`` and ``K_max`` apply only with ``dynamic=True``; ``state_dict`` then also
    holds the current amount and the last distance.
    """

    codec_id = "mcgq"
    wire_id = 7
    accepts_bits = False
    stochastic = True

    def __init__(self, *, K: float = 0.1, seed: int = 0, checksum: bool = False, dynamic: bool = False,
                 step: float | None = None, K_min: float | None = None, K_max: float | None = None):
        super().__init__(checksum=checksum, seed=seed)
        self.K = check_sampling_amount(K)
        self.dynamic = options.check_bool("dynamic", dynamic, error=CodecError, prefix="mcgq: ")
        given = {name: v for name, v in (("step", step), ("K_min", K_min), ("K_max", K_max)) if v is not None}
        self._rule: DynamicSampling | None = None
        if self.dynamic:
            defaults = DynamicSampling()
            low = check_sampling_amount(given.get("K_min", defaults.K_min))
            high = check_sampling_amount(given.get("K_max", defaults.K_max))
            if not low <= self.K <= high:
                raise CodecError(f"mcgq: dynamic sampling needs K_min <= K <= K_max (K is the initial "
                                 f"amount), got {low} <= {self.K} <= {high}")
            self._rule = DynamicSampling(K_init=self.K, **given)
        elif given:
            raise CodecError(f"mcgq: {', '.join(given)} only apply with dynamic=true")
        self._K_now = self.K
        self._distance: float | None = None
        self._call_K: float | None = None
        self._counts = np.empty(0, np.int32)
        self._decoded = np.empty(0, np.float32)

    def _config(self) -> dict[str, Any]:
        if not self.dynamic:
            return {"K": self.K}
        rule = self._rule
        return {"K": self.K, "dynamic": True, "step": rule.step, "K_min": rule.K_min, "K_max": rule.K_max}

    def encode(self, x: np.ndarray, out: np.ndarray | None = None, *, K: float | None = None) -> np.ndarray:
        """As ``Codec.encode``; ``K`` overrides the sampling amount for this call only.

        With ``dynamic=True`` the instance chooses K itself (passing ``K`` is an error) and
        updates it after the call; a call that raises leaves the adaptive state unchanged.
        """
        if self.dynamic and K is not None:
            raise CodecError("mcgq: with dynamic=true the codec chooses K itself; encode(x, K=...) "
                             "is for codecs without dynamic sampling")
        self._call_K = self._K_now if K is None else check_sampling_amount(K)
        try:
            if not self.dynamic:
                return super().encode(x, out)
            x = _as_float32_vector(x)
            buf = super().encode(x, out)
        finally:
            self._call_K = None
        self._adapt(x, buf)
        return buf

    def _adapt(self, x: np.ndarray, buf: np.ndarray) -> None:
        """Alg. 3 after an encode: d = W1(x, decode(buf)), K <- K + step * (d' - d), clipped."""
        if self._decoded.size < x.size:
            self._decoded = np.empty(x.size, np.float32)
        decoded = self.decode(buf, out=self._decoded[:x.size])
        d = _wasserstein1(x, decoded)
        self._K_now = self._rule.next_amount(self._K_now, self._distance, d)
        self._distance = d

    def sampling_amount(self) -> float:
        """K of the encode call in progress, else the one the next encode will use
        (the configured K, or with ``dynamic=True`` the current adapted amount)."""
        return self._K_now if self._call_K is None else self._call_K

    def distance(self) -> float | None:
        """The last encode's W1 distance with ``dynamic=True`` (None before the first)."""
        return self._distance

    def state_dict(self) -> dict[str, Any]:
        """``{"calls"}``, plus with ``dynamic=True`` the current ``K`` and last ``distance``."""
        state = super().state_dict()
        if self.dynamic:
            state.update(K=self._K_now, distance=self._distance)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        adaptive = {"K", "distance"} & set(state)
        if not self.dynamic:
            if adaptive:
                raise CodecError("mcgq state: holds dynamic sampling state, but this codec has dynamic=false")
            super().load_state_dict(state)
            return
        if adaptive != {"K", "distance"}:
            raise CodecError("mcgq state: dynamic=true needs the 'K' and 'distance' entries")
        K, distance = state["K"], state["distance"]
        rule = self._rule
        if isinstance(K, bool) or not isinstance(K, Real) or not rule.K_min <= K <= rule.K_max:
            raise CodecError(f"mcgq state: K = {K!r} lies outside [{rule.K_min}, {rule.K_max}]")
        if distance is not None and (isinstance(distance, bool) or not isinstance(distance, Real)
                                     or not 0 <= distance <= 1):
            raise CodecError(f"mcgq state: distance must be None or a number in [0, 1], got {distance!r}")
        super().load_state_dict(state)
        self._K_now = float(K)
        self._distance = None if distance is None else float(distance)

    def max_encoded_size(self, n: int, K: float | None = None) -> int:
        return HEADER_SIZE + self.max_payload_size(n, K)

    def max_payload_size(self, n: int, K: float | None = None) -> int:
        """Bound for any input of n elements at sampling amount K (default: the current one)."""
        n_samples = sample_count(n, self.sampling_amount() if K is None else check_sampling_amount(K))
        value_bits, run_bits = 1 + n_samples.bit_length(), n.bit_length()
        most_nonzero = min(n, n_samples)
        candidates = {most_nonzero, min(most_nonzero, (n - 1) // 2), min(most_nonzero, n // 2)}
        worst = max(z * value_bits + max(0, min(z + 1, n - z)) * (value_bits + run_bits)
                    for z in candidates if z >= 0)
        return SCALE_BYTES + -(-(PREAMBLE_BITS + worst) // 8)

    def _encode_payload(self, x, payload):
        seed, counter = self._next_stream()
        n = x.size
        top_bits = int(kernels.max_abs_bits(x.view(np.uint32)))
        if top_bits >= _NONFINITE_BITS:
            raise non_finite_error(self.codec_id)
        factor = weight_factor(n, top_bits)
        total = int(kernels.weight_total(x, factor))
        n_samples, ratio, scale = sampling_plan(n, self.sampling_amount(), top_bits, total)
        xi = float(kernels.sampling_offset(seed, counter))
        counts = self._count_buffer(n, n_samples)
        kernels.sample_counts(x, factor, np.int64(total), ratio, xi, np.int64(n_samples), counts)
        max_count, longest, nonzero, runs = kernels.int_stats(counts)
        s32 = float32_scale(scale, max_count, n_samples)
        widths = rle_widths(max_count, longest)
        nbytes = -(-rle_bits(*widths, nonzero, runs) // 8)
        payload[:SCALE_BYTES] = np.frombuffer(s32.astype("<f4").tobytes(), np.uint8)
        kernels.int_write(counts, *widths, payload[SCALE_BYTES:SCALE_BYTES + nbytes])
        return widths[0], 0, n_samples & 0xFFFFFFFF, n_samples >> 32, SCALE_BYTES + nbytes

    def _count_buffer(self, n: int, n_samples: int) -> np.ndarray:
        """Scratch for the signed counts, kept between calls (int32 unless N needs int64)."""
        dtype = np.int32 if n_samples < 2**31 else np.int64
        if self._counts.size < n or self._counts.dtype != dtype:
            self._counts = np.empty(n, dtype)
        return self._counts[:n]

    def _check_payload(self, header: Header, payload: np.ndarray) -> None:
        read_preamble(header, payload)

    def _decode_payload(self, header: Header, payload, out):
        scale, n_samples, stream, widths = read_preamble(header, payload)
        status, total, max_mag, longest = kernels.rle_read(stream, *widths, float(scale),
                                                           np.int64(n_samples), out)
        raise_status(status)
        check_counts(header, scale, n_samples, widths, total, max_mag, longest)


def read_preamble(header: Header, payload: np.ndarray) -> tuple[np.float32, int, np.ndarray, tuple[int, int]]:
    """(s, N, stream, (B_g, B_RLE)) of an mcgq payload, every field checked."""
    if header.flags != 0:
        raise CodecError(f"mcgq: corrupted buffer header (unknown codec flags {header.flags:#x})")
    if header.payload_len < SCALE_BYTES + PREAMBLE_BITS // 8:
        raise CodecError(f"mcgq: payload of {header.payload_len} bytes is shorter than the 12-byte preamble")
    scale = payload[:SCALE_BYTES].view("<f4")[0].astype(np.float32)
    if not np.isfinite(scale) or np.signbit(scale):
        raise CodecError(f"mcgq: corrupted payload (scale {scale} is negative or non-finite)")
    n_samples = header.param_a | header.param_b << 32
    if n_samples > header.n * K_LIMIT:
        raise CodecError(f"mcgq: corrupted buffer header (N = {n_samples} samples for {header.n} elements)")
    if n_samples == 0 and scale != 0:
        raise CodecError("mcgq: corrupted payload (non-zero scale without samples)")
    stream = payload[SCALE_BYTES:]
    widths = stream_widths(stream, header.n, 1 + n_samples.bit_length())
    if widths[0] != header.bits:
        raise CodecError(f"mcgq: corrupted buffer (header says B_g = {header.bits}, stream {widths[0]})")
    return scale, n_samples, stream, widths


def check_counts(header: Header, scale: np.float32, n_samples: int, widths: tuple[int, int],
                 total: int, max_mag: int, longest: int) -> None:
    """Post-decode checks: counts sum to N, widths are canonical, values fit float32."""
    if total != n_samples:
        raise CodecError(f"mcgq: corrupted payload (counts sum to {total}, header says N = {n_samples})")
    check_decoded(widths, max_mag, longest)
    if max_mag * float(scale) > _FLT_MAX:
        raise CodecError("mcgq: corrupted payload (decoded values overflow float32)")
