"""NumPy twin of ``mcgq``: the same sampling, the same RLE bytes, no Numba.

Sampling is vectorised (cumsum of the integer weights, then ceil over the whole CDF).
The RLE writer packs all codes at once (bit offsets by cumsum, OR into 64-bit words).
The RLE reader is sequential by nature (a run length's position depends on every code
before it): it finds, for every bit position, the next all-zero B_g-bit window of the
same residue mod B_g with NumPy, then steps in Python once per zero run, decoding the
non-zero values between runs in bulk.
"""

from __future__ import annotations

import numpy as np

from ..base import CodecError, non_finite_error
from ..mcgq import (SCALE_BYTES, check_counts, float32_scale, read_preamble, rle_bits, rle_widths,
                    sampling_plan, weight_factor)

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


# ---- counter RNG (kernels.common.stream_key / uniform01) -------------------------------------------
def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sampling_offset(seed: int, counter: int) -> float:
    key = _mix64((seed * _GOLDEN + _mix64((counter + _GOLDEN) & _M64)) & _M64)
    r = _mix64(key)  # index 0
    return float(np.float32(r >> 40) * np.float32(1.0 / (1 << 24)))


# ---- sampling --------------------------------------------------------------------------------------
def weights(x: np.ndarray, factor: float) -> np.ndarray:
    return (np.abs(x).astype(np.float64) * factor + 0.5).astype(np.int64)


def sampled_counts(x: np.ndarray, factor: float, total: int, ratio: float, xi: float,
                   n_samples: int) -> np.ndarray:
    """Signed hit counts of the N stratified samples (int64, one per element)."""
    cdf = np.cumsum(weights(x, factor))
    below = np.minimum(np.ceil(cdf.astype(np.float64) * ratio - xi).astype(np.int64), n_samples)
    below[cdf >= total] = n_samples
    counts = np.diff(below, prepend=np.int64(0))
    return np.where(x < 0, -counts, counts)


# ---- RLE ---------------------------------------------------------------------------------------------
def rle_stats(values: np.ndarray) -> tuple[int, int, int, int]:
    """(max |v|, longest zero run, non-zero count, zero-run count)."""
    starts, lengths = _zero_runs(values)
    max_mag = int(np.abs(values).max()) if values.size else 0
    longest = int(lengths.max()) if lengths.size else 0
    return max_mag, longest, int(np.count_nonzero(values)), int(starts.size)


def _zero_runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    edges = np.diff(np.concatenate(([0], (values == 0).view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def rle_write(values: np.ndarray, value_bits: int, run_bits: int) -> np.ndarray:
    """RLE stream bytes of ``values`` with the given widths."""
    nonzero = np.flatnonzero(values)
    run_starts, run_lengths = _zero_runs(values)
    # Tokens in element order; a run token emits two codes (zero marker, length).
    position = np.concatenate((nonzero, run_starts))
    is_run = np.concatenate((np.zeros(nonzero.size, bool), np.ones(run_starts.size, bool)))
    order = np.argsort(position, kind="stable")
    is_run = is_run[order]
    v = values[nonzero]
    value_codes = np.where(v < 0, -v | (1 << (value_bits - 1)), v).astype(np.uint64)
    token_code = np.concatenate((value_codes, np.zeros(run_starts.size, np.uint64)))[order]
    token_length = np.concatenate((np.zeros(nonzero.size, np.uint64),
                                   run_lengths.astype(np.uint64)))[order]
    first = np.cumsum(1 + is_run) - (1 + is_run) + 2          # index of each token's first code
    n_codes = 2 + int(is_run.sum()) + is_run.size
    codes = np.zeros(n_codes, np.uint64)
    widths = np.full(n_codes, value_bits, np.int64)
    codes[:2] = (value_bits, run_bits)
    widths[:2] = 32
    codes[first] = token_code
    codes[first[is_run] + 1] = token_length[is_run]
    widths[first[is_run] + 1] = run_bits
    return pack_codes(codes, widths)


def pack_codes(codes: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Concatenate codes (uint64, widths <= 57 bits) MSB-first into zero-padded bytes."""
    offsets = np.cumsum(widths) - widths
    nbits = int(widths.sum())
    words = np.zeros(-(-nbits // 64) + 1, np.uint64)
    word = offsets >> 6
    end = (offsets & 63) + widths                               # end bit inside the word, <= 120
    fits = end <= 64
    head = np.where(fits, codes << (64 - np.minimum(end, 64)).astype(np.uint64),
                    codes >> (np.maximum(end, 64) - 64).astype(np.uint64))
    np.bitwise_or.at(words, word, head)
    spill = ~fits
    np.bitwise_or.at(words, word[spill] + 1, codes[spill] << (128 - end[spill]).astype(np.uint64))
    return words.astype(">u8").view(np.uint8)[:-(-nbits // 8)].copy()


def read_fields(padded: np.ndarray, positions: np.ndarray, width: int) -> np.ndarray:
    """The ``width``-bit fields (<= 57) at bit ``positions`` of ``padded`` (8 spare bytes)."""
    byte = positions >> 3
    window = np.zeros(positions.size, np.uint64)
    for j in range(8):
        window = (window << np.uint64(8)) | padded[byte + j].astype(np.uint64)
    shifted = window << (positions & 7).astype(np.uint64)
    return (shifted >> np.uint64(64 - width)).astype(np.int64)


def rle_read(stream: np.ndarray, value_bits: int, run_bits: int, n: int,
             max_total: int) -> np.ndarray:
    """Signed integers of an RLE stream (after its preamble); CodecError if malformed."""
    def bad(what):
        return CodecError(f"mcgq: corrupted payload ({what})")

    total_bits = 8 * stream.size
    padded = np.concatenate((stream, np.zeros(8, np.uint8)))
    ones = np.concatenate(([0], np.cumsum(np.unpackbits(stream), dtype=np.int64)))
    n_windows = max(total_bits - value_bits + 1, 0)
    zero_window = ones[value_bits:value_bits + n_windows] == ones[:n_windows]
    rows = -(-n_windows // value_bits)
    never = np.iinfo(np.int64).max
    next_zero = np.full(rows * value_bits, never, np.int64)
    next_zero[:n_windows][zero_window] = np.flatnonzero(zero_window)
    next_zero = np.minimum.accumulate(next_zero.reshape(rows, value_bits)[::-1], axis=0)[::-1].ravel()

    raw = padded.tobytes()
    run_shift = 64 - run_bits

    def run_length(bit: int) -> int:
        window = int.from_bytes(raw[bit >> 3:(bit >> 3) + 8], "big")
        return ((window << (bit & 7)) & _M64) >> run_shift if run_bits else 0

    segments = []                                # (first element, first bit, count)
    out = np.zeros(n, np.int64)
    pos, k, after_run = 64, 0, False
    while k < n:
        zero = int(next_zero[pos]) if pos < n_windows else never
        values_before = (zero - pos) // value_bits
        if values_before >= n - k:
            if pos + (n - k) * value_bits > total_bits:
                raise bad("the RLE stream ends inside a code")
            segments.append((k, pos, n - k))
            pos += (n - k) * value_bits
            break
        if values_before:
            segments.append((k, pos, values_before))
            k += values_before
        elif after_run:
            raise bad("two zero runs in a row")
        pos = zero + value_bits
        if pos + run_bits > total_bits:
            raise bad("the RLE stream ends inside a code")
        run = run_length(pos)
        if run == 0 or run > n - k:
            raise bad("a zero run is empty or longer than the elements left")
        k += run
        pos += run_bits
        after_run = True
    if -(-pos // 8) != stream.size or np.unpackbits(stream)[pos:].any():
        raise bad("bytes or non-zero padding follow the last element")
    if segments:
        first_k, first_bit, count = (np.array(column, np.int64) for column in zip(*segments))
        offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        fields = read_fields(padded, np.repeat(first_bit, count) + value_bits * offset, value_bits)
        sign_bit = 1 << (value_bits - 1)
        magnitude = fields & (sign_bit - 1)
        if (magnitude == 0).any():
            raise bad("a negative zero")
        if (magnitude > max_total).any() or magnitude.astype(np.float64).sum() > 2.0**62 \
                or int(magnitude.sum()) > max_total:
            raise bad("the decoded counts exceed the sample count N")
        out[np.repeat(first_k, count) + offset] = np.where(fields & sign_bit, -magnitude, magnitude)
    return out


# ---- Wasserstein-1 ------------------------------------------------------------------------------------
def wasserstein1_index(g: np.ndarray, q: np.ndarray) -> float:
    cg = np.cumsum(np.abs(g.astype(np.float64)))
    cq = np.cumsum(np.abs(q.astype(np.float64)))
    return float(np.abs(cg / cg[-1] - cq / cq[-1])[:-1].sum() / g.size)


# ---- the codec's payload methods -------------------------------------------------------------------------
class MCGQTwin:
    """``mcgq``'s payload methods in NumPy: its kernels' bytes (``reference.twin_of``; named by
    ``mpigrad.codecs.parts``)."""

    def encode_payload(self, codec, x, payload):
        seed, counter = codec._next_stream()
        n = x.size
        top_bits = int((x.view(np.uint32) & np.uint32(0x7FFFFFFF)).max()) if n else 0
        if top_bits >= 0x7F800000:
            raise non_finite_error(codec.codec_id)
        factor = weight_factor(n, top_bits)
        total = int(weights(x, factor).sum())
        n_samples, ratio, scale = sampling_plan(n, codec.sampling_amount(), top_bits, total)
        counts = sampled_counts(x, factor, total, ratio, sampling_offset(seed, counter), n_samples)
        max_count, longest, nonzero, runs = rle_stats(counts)
        s32 = float32_scale(scale, max_count, n_samples)
        widths = rle_widths(max_count, longest)
        stream = rle_write(counts, *widths)
        assert stream.size == -(-rle_bits(*widths, nonzero, runs) // 8)
        payload[:SCALE_BYTES] = np.frombuffer(s32.astype("<f4").tobytes(), np.uint8)
        payload[SCALE_BYTES:SCALE_BYTES + stream.size] = stream
        return widths[0], 0, n_samples & 0xFFFFFFFF, n_samples >> 32, SCALE_BYTES + stream.size

    def decode_payload(self, codec, header, payload, out):
        scale, n_samples, stream, widths = read_preamble(header, payload)
        values = rle_read(stream, *widths, header.n, n_samples)
        max_mag = int(np.abs(values).max()) if values.size else 0
        starts, lengths = _zero_runs(values)
        longest = int(lengths.max()) if lengths.size else 0
        check_counts(header, scale, n_samples, widths, int(np.abs(values).sum()), max_mag, longest)
        out[:] = (values.astype(np.float64) * np.float64(scale)).astype(np.float32)

