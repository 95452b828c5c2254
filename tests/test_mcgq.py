"""MCGQ: sampling, the Sec. 3.4 RLE scheme, the wire format, dynamic sampling.

Golden fixtures tests/data/golden/mcgq_*.npz freeze the wire format; if a change is
intended, bump the format and regenerate with ``python tests/test_mcgq.py --regenerate``.
"""

from __future__ import annotations

import copy
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import fuzz_tally
from mpigrad.codecs import CodecError, get_codec, read_header
from mpigrad.codecs.base import HEADER_SIZE, Header, _write_header
from mpigrad.codecs.kernels import mcgq as kernels
from mpigrad.codecs.mcgq import (MCGQ, rle_decode, rle_encode, rle_stream_bits, sample_count,
                                 sampling_plan, weight_exponent, weight_factor)
from mpigrad.codecs.mcgq_sampling import K_LIMIT, DynamicSampling, wasserstein1
from mpigrad.codecs.reference import twin_of
from mpigrad.codecs.reference import mcgq as twin

GOLDEN = Path(__file__).parent / "data" / "golden"
FUZZ = Path(__file__).with_name("fuzz_mcgq.py")
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- the paper's worked example -------------------------------------------------------------------
PAPER = np.array([2, -1, 0, 0, 0, 3, 0, 1])


def bit_string(stream: np.ndarray, nbits: int) -> str:
    return "".join(f"{b:08b}" for b in stream)[:nbits]


def test_worked_example_costs_86_bits_and_has_the_papers_layout():
    assert rle_stream_bits(PAPER) == 86
    stream = rle_encode(PAPER)
    assert stream.size == 11
    expected = (f"{3:032b}" f"{2:032b}"       # B_g = 3, B_RLE = 2
                "010" "101" "000" "11"        # 2, -1, zero run of 3
                "011" "000" "01" "001")       # 3, zero run of 1, 1
    assert bit_string(stream, 88) == expected + "00"
    np.testing.assert_array_equal(rle_decode(stream, 8), PAPER)


@pytest.mark.parametrize("values, widths, bits", [
    ([], (1, 0), 64),                                  # empty: preamble only
    ([0], (1, 1), 64 + 1 + 1),                         # one zero: a run of 1
    ([0] * 1000, (1, 10), 64 + 1 + 10),                # all zero: B_g = 1, one run of n
    ([5], (4, 0), 64 + 4),                             # no zeros: B_RLE = 0, no run codes
    ([1, -1, 1, -1], (2, 0), 64 + 4 * 2),
    ([-(2**55)] + [0] * 7, (57, 3), 64 + 57 + 57 + 3),  # widest magnitude
    ([0, 0, 1] + [0] * 9, (2, 4), 64 + (2 + 4) + 2 + (2 + 4)),  # runs sized by the longest
])
def test_rle_edge_cases(values, widths, bits):
    values = np.array(values, np.int64)
    stream = rle_encode(values)
    assert rle_stream_bits(values) == bits
    assert stream.size == -(-bits // 8)
    assert (int.from_bytes(stream[:4].tobytes(), "big"),
            int.from_bytes(stream[4:8].tobytes(), "big")) == widths
    np.testing.assert_array_equal(rle_decode(stream, values.size), values)
    np.testing.assert_array_equal(twin.rle_write(values, *widths), stream)
    np.testing.assert_array_equal(twin.rle_read(stream, *widths, values.size, 2**62), values)


def test_rle_rejects_bad_values():
    with pytest.raises(CodecError, match="below 2\\*\\*56"):
        rle_encode(np.array([2**56]))
    with pytest.raises(CodecError, match="integer array"):
        rle_stream_bits(np.array([1.0]))


int_vectors = st.integers(0, 300).flatmap(lambda n: st.lists(
    st.one_of(st.just(0), st.just(0), st.integers(-3, 3), st.integers(-(2**55), 2**55)),
    min_size=n, max_size=n)).map(lambda v: np.array(v, np.int64))


@FAST
@given(int_vectors)
def test_rle_round_trip_and_twins(values):
    stream = rle_encode(values)
    bits = rle_stream_bits(values)
    assert 8 * stream.size - 8 < bits <= 8 * stream.size
    stats = twin.rle_stats(values)
    assert kernels.int_stats(values) == stats
    narrow = values.astype(np.int32) if np.abs(values).max(initial=0) < 2**31 else values
    assert kernels.int_stats(narrow) == stats                      # the int32 specialisation
    widths = (1 + stats[0].bit_length(), stats[1].bit_length())
    np.testing.assert_array_equal(twin.rle_write(values, *widths), stream)
    np.testing.assert_array_equal(rle_decode(stream, values.size), values)
    np.testing.assert_array_equal(twin.rle_read(stream, *widths, values.size, 2**62), values)


def test_rle_decode_rejects_malformed_streams():
    stream = rle_encode(PAPER)
    last_bit = np.zeros(11, np.uint8)
    last_bit[-1] = 1
    cases = [
        (stream[:9], 8, "ends inside a code"),
        (np.append(stream, np.uint8(0)), 8, "follow the last element"),
        (stream ^ last_bit, 8, "follow the last element"),                # a padding bit set
        (stream, 7, "follow the last element"),
        (stream, 9, "ends inside a code"),
    ]
    for buf, n, message in cases:
        with pytest.raises(CodecError, match=message):
            rle_decode(buf, n)
        with pytest.raises(CodecError):
            twin.rle_read(buf, 3, 2, n, 2**62)
    bad_preambles = [
        (stream[:5], "preamble"),
        (np.concatenate((np.zeros(4, np.uint8), stream[4:])), "B_g = 0"),
        (np.concatenate((stream[:4], np.uint8([0, 0, 0, 9]), stream[8:])), "B_RLE = 9 for 8"),
    ]
    for buf, message in bad_preambles:
        with pytest.raises(CodecError, match=message):
            rle_decode(buf, 8)
    # B_g = 4 is wider than the data needs: the twin reads it, the checked decoder refuses it.
    wide = twin.pack_codes(np.array([4, 2, 2, 1 | 8, 0, 3, 3, 0, 1, 1], np.uint64),
                           np.array([32, 32, 4, 4, 4, 2, 4, 4, 2, 4]))
    np.testing.assert_array_equal(twin.rle_read(wide, 4, 2, 8, 2**62), PAPER)
    with pytest.raises(CodecError, match="do not match the data"):
        rle_decode(wide, 8)
    # Codes the format cannot contain: two zero runs in a row, an empty run, a negative zero.
    for codes, widths, n in [([3, 2, 0, 1, 0, 2, 2], [32, 32, 3, 2, 3, 2, 3], 4),
                             ([3, 2, 0, 0], [32, 32, 3, 2], 3),
                             ([3, 2, 4], [32, 32, 3], 3)]:
        buf = twin.pack_codes(np.array(codes, np.uint64), np.array(widths))
        with pytest.raises(CodecError, match="cannot contain"):
            rle_decode(buf, n)
        with pytest.raises(CodecError):
            twin.rle_read(buf, 3, 2, n, 2**62)


# ---- sampling kernels vs their NumPy twins ----------------------------------------------------------
def sampled(x: np.ndarray, K: float, seed: int = 0, counter: int = 0):
    """(counts from the kernels, exact expected counts N p_k as Fractions, N)."""
    n = x.size
    top = int(kernels.max_abs_bits(x.view(np.uint32)))
    factor = weight_factor(n, top)
    weights = twin.weights(x, factor)
    total = int(kernels.weight_total(x, factor))
    assert total == int(weights.sum())
    n_samples, ratio, _ = sampling_plan(n, K, top, total)
    xi = float(kernels.sampling_offset(seed, counter))
    assert xi == twin.sampling_offset(seed, counter)
    counts = np.empty(n, np.int64)
    kernels.sample_counts(x, factor, np.int64(total), ratio, xi, np.int64(n_samples), counts)
    np.testing.assert_array_equal(counts, twin.sampled_counts(x, factor, total, ratio, xi, n_samples))
    expected = [Fraction(n_samples * int(w), total) if total else Fraction(0) for w in weights]
    return counts, expected, n_samples


float_vectors = st.integers(1, 400).flatmap(lambda n: st.one_of(
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=n, max_size=n),
    st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, -3e38, 3e38, 1e-30, 7.5]), min_size=n, max_size=n),
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=n, max_size=n),
)).map(lambda v: np.array(v, np.float32))


@FAST
@given(float_vectors, st.sampled_from([0.001, 0.1, 0.5, 1.0, 3.3, 64.0]), st.integers(0, 2**63 - 1))
def test_counts_are_stratified_floor_or_ceil(x, K, seed):
    counts, expected, n_samples = sampled(x, K, seed)
    assert int(np.abs(counts).sum()) == n_samples
    assert all(abs(abs(int(c)) - e) < 1 for c, e in zip(counts, expected))
    signs = np.sign(counts)
    assert np.all((signs == 0) | (signs == np.sign(x)))


def test_sampling_offset_is_uniform_and_counter_based():
    import scipy.stats  # here, not at collection: 2 s of every test process's start-up

    xi = np.array([kernels.sampling_offset(5, c) for c in range(4000)])
    assert scipy.stats.kstest(xi, "uniform").pvalue > 1e-3
    assert kernels.sampling_offset(5, 17) == kernels.sampling_offset(5, 17) != kernels.sampling_offset(6, 17)


def test_sample_count_reads_K_as_a_decimal():
    assert sample_count(100, 0.07) == 7            # 100 * 0.07 == 7.000000000000001 in floats
    assert sample_count(3, 0.1) == 1 and sample_count(0, 0.5) == 0 and sample_count(1, 1e-9) == 1
    assert sample_count(2**34, K_LIMIT) == 2**44


def test_counts_are_unbiased():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(200) * rng.exponential(size=200)).astype(np.float32)
    runs = 2000
    codec = MCGQ(K=0.3, seed=11)
    total = np.zeros(200)
    for _ in range(runs):
        buf = codec.encode(x)
        total += rle_decode(buf[HEADER_SIZE + 4:], x.size)
    _, expected, _ = sampled(x, 0.3)
    expected = np.array([float(e) for e in expected]) * np.sign(x)
    fraction = np.abs(expected) % 1
    sigma = np.sqrt(fraction * (1 - fraction) / runs) + 1e-12
    assert np.all(np.abs(total / runs - expected) <= 5 * sigma + 1e-9)
    assert np.abs((total / runs - expected) / sigma).mean() < 1.2   # mean |z| of N(0, 1) is 0.8


# ---- the codec ---------------------------------------------------------------------------------------
def encode_or_error(codec, x, **kwargs):
    try:
        return codec.encode(x, **kwargs).copy()
    except CodecError as exc:
        return str(exc)


@FAST
@given(float_vectors, st.sampled_from([0.001, 0.1, 0.5, 1.0, 3.3, 64.0]), st.integers(0, 2**63 - 1),
       st.integers(0, 5))
def test_codec_matches_twin_and_bounds_the_error(x, K, seed, calls):
    codec = MCGQ(K=K, seed=seed)
    codec.load_state_dict({"calls": calls})
    reference = twin_of(codec)
    buf = encode_or_error(codec, x)
    other = encode_or_error(reference, x)
    if isinstance(buf, str):
        assert buf == other and "exceeds float32" in buf
        return
    np.testing.assert_array_equal(buf, other)
    assert codec.calls == reference.calls == calls + 1
    assert buf.size <= codec.max_encoded_size(x.size)
    decoded = codec.decode(buf)
    np.testing.assert_array_equal(decoded, reference.decode(buf))
    # |count_k - N p_k| < 1, so |decoded_k - x_k| <= s, plus the roundings: weights to
    # integers (unit / 2), s to float32 (may underflow), decoded values to float32.
    counts = rle_decode(buf[HEADER_SIZE + 4:], x.size).astype(np.float64)
    s32 = float(buf[HEADER_SIZE:HEADER_SIZE + 4].view("<f4")[0])
    n_samples = read_header(buf).param_a | read_header(buf).param_b << 32
    unit = float(np.abs(x).max()) * 2.0 ** -weight_exponent(x.size)
    s64 = float(twin.weights(x, weight_factor(x.size, int(np.abs(x).view(np.uint32).max()))).sum()) \
        * unit / max(n_samples, 1)
    error = np.abs(decoded.astype(np.float64) - x)
    bound = s64 * 1.000001 + np.abs(counts) * abs(s32 - s64) + 1e-6 * np.abs(x) + unit + 1.5e-45
    assert np.all(error <= bound)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


@FAST
@given(float_vectors, st.sampled_from([0.001, 0.1, 1.0, 64.0]), st.integers(0, 2**32 - 1))
def test_accumulate_equals_out_plus_decode(x, K, seed):
    """decode(accumulate=True): scratch + add inside the codec, ``out + decode`` bit for bit."""
    codec = MCGQ(K=K, seed=seed)
    buf = encode_or_error(codec, x)
    assume(not isinstance(buf, str))
    rng = np.random.default_rng(seed)
    before = rng.standard_normal(x.size).astype(np.float32)
    before[rng.random(x.size) < 0.3] = -0.0               # -0.0 + 0.0 is +0.0: no sparse shortcut
    with np.errstate(over="ignore"):
        expect = before + codec.decode(buf)
    for decoder in (codec, twin_of(codec), MCGQ()):
        total = before.copy()
        with np.errstate(over="ignore"):
            assert decoder.decode(buf, total, accumulate=True) is total
        assert_bits_equal(total, expect)


def test_accumulate_keeps_one_scratch_array():
    import tracemalloc
    codec = MCGQ(K=0.3)
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    small_buf = codec.encode(big[:1000]).copy()
    buf = codec.encode(big).copy()
    total = np.zeros(big.size, np.float32)
    codec.decode(buf, total, accumulate=True)
    scratch = codec._scratch
    assert scratch.size == big.size
    tracemalloc.start()
    try:
        codec.decode(buf, total, accumulate=True)
        codec.decode(small_buf, total[:1000], accumulate=True)   # a smaller layer: a view of it
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 8 and codec._scratch is scratch
    with pytest.raises(CodecError, match="needs out="):
        codec.decode(buf, accumulate=True)


@pytest.mark.parametrize("x", [
    np.zeros(0, np.float32), np.zeros(17, np.float32), np.full(17, -0.0, np.float32),
    np.array([-3.5], np.float32), np.full(64, 0.25, np.float32),
], ids=["empty", "zeros", "negative-zeros", "one", "constant"])
def test_edge_inputs(x):
    codec = MCGQ(K=0.5, seed=1)
    buf = codec.encode(x)
    header = read_header(buf)
    decoded = codec.decode(buf)
    if not np.any(x):
        assert header.param_a == header.param_b == 0 and header.bits == 1
        np.testing.assert_array_equal(decoded, np.zeros_like(x))
        assert not np.signbit(decoded).any()
    elif x.size == 1:
        np.testing.assert_array_equal(decoded, x)      # one sample, scale |x|
    else:
        # 32 samples over 64 equal elements: every other element gets one hit of 2 * 0.25.
        assert sorted(set(decoded.tolist())) == [0.0, 0.5] and decoded.sum() == x.sum()


def test_header_and_sizes():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    codec = MCGQ(K=0.2, seed=3)
    buf = codec.encode(x)
    header = read_header(buf)
    counts = rle_decode(buf[HEADER_SIZE + 4:], x.size)
    assert header.param_a == 200 and header.param_b == 0
    assert header.bits == 1 + int(np.abs(counts).max()).bit_length()
    assert buf.size == HEADER_SIZE + 4 + -(-rle_stream_bits(counts) // 8)
    scale = buf[HEADER_SIZE:HEADER_SIZE + 4].view("<f4")[0]
    assert scale == pytest.approx(np.abs(x.astype(np.float64)).sum() / 200, rel=1e-6)
    # A bound for K covers adversarial patterns (alternating zeros, one huge value).
    for K in (0.01, 0.5, 1.0, 8.0):
        for pattern in (np.tile(np.float32([1, 0]), 500), np.r_[np.float32(1e6), np.ones(999, np.float32)]):
            assert codec.encode(pattern, K=K).size <= codec.max_encoded_size(pattern.size, K=K)


def test_config_seed_state_and_per_call_K():
    codec = get_codec({"id": "mcgq", "K": 0.25, "seed": 9})
    assert isinstance(codec, MCGQ) and codec.stochastic and not codec.accepts_bits
    assert codec.get_config() == {"id": "mcgq", "K": 0.25, "seed": 9}
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec
    x = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    first, second = codec.encode(x).copy(), codec.encode(x).copy()
    assert not np.array_equal(first, second)
    codec.load_state_dict({"calls": 0})
    np.testing.assert_array_equal(codec.encode(x), first)
    other = MCGQ(K=0.25, seed=10)
    assert not np.array_equal(other.encode(x), first)
    buf = codec.encode(x, K=2.0)
    assert read_header(buf).param_a == 1000 and codec.K == 0.25 and codec.sampling_amount() == 0.25
    assert read_header(codec.encode(x)).param_a == 125


@pytest.mark.parametrize("options, message", [
    ({"K": 0}, "K must be"), ({"K": -1}, "K must be"), ({"K": 1025}, "K must be"),
    ({"K": float("nan")}, "K must be"), ({"K": True}, "K must be"), ({"K": "0.1"}, "K must be"),
    ({"seed": -1}, "seed"), ({"bits": 4}, r"unknown option\(s\) bits; valid: K, seed"),
])
def test_bad_options(options, message):
    with pytest.raises(CodecError, match=message):
        get_codec({"id": "mcgq", **options})
    with pytest.raises(CodecError, match="K must be"):
        MCGQ().encode(np.ones(3, np.float32), K=0)


def test_bad_input_is_rejected():
    codec = MCGQ(seed=1)
    for bad in (np.float32([1, np.nan]), np.float32([np.inf, 0]), np.float32([-np.inf])):
        with pytest.raises(CodecError, match="NaN or infinity"):
            codec.encode(bad)
        with pytest.raises(CodecError, match="NaN or infinity"):
            twin_of(codec).encode(bad)
    with pytest.raises(CodecError, match="exceeds float32"):
        codec.encode(np.full(4, 3e38, np.float32), K=0.25)    # ||g||_1 / N = 1.2e39
    with pytest.raises(CodecError, match="1-D"):
        codec.encode(np.ones((2, 2), np.float32))


# ---- damaged buffers ----------------------------------------------------------------------------------
def reheader(buf: np.ndarray, payload: np.ndarray | None = None, **fields) -> np.ndarray:
    """``buf`` with header fields replaced (and a valid header CRC), optionally a new payload."""
    header = read_header(buf)._asdict()
    payload = buf[HEADER_SIZE:] if payload is None else payload
    header.update(payload_len=payload.size, **fields)
    out = np.concatenate((np.zeros(HEADER_SIZE, np.uint8), payload))
    _write_header(out, Header(**header), False)
    return out


def test_damaged_buffers_raise_codec_error():
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    codec = MCGQ(K=0.5, seed=4)
    buf = codec.encode(x).copy()
    header = read_header(buf)
    payload = buf[HEADER_SIZE:]
    assert header.bits >= 3                 # a count >= 2: a scale of 3e38 overflows float32

    def with_payload_bytes(offset, values):
        p = payload.copy()
        p[offset:offset + len(values)] = values
        return reheader(buf, p)

    def widths_of(p):
        return int.from_bytes(p[4:8].tobytes(), "big"), int.from_bytes(p[8:12].tobytes(), "big")

    def with_widths(value_bits, run_bits):
        widths = np.frombuffer(value_bits.to_bytes(4, "big") + run_bits.to_bytes(4, "big"), np.uint8)
        return with_payload_bytes(4, widths)

    cases = [
        (buf[:-1], "truncated or padded"),
        (np.append(buf, np.uint8(0)), "truncated or padded"),
        (get_codec({"id": "fp32"}).encode(x), "encoded by codec 'fp32'"),
        (reheader(buf, flags=1), "unknown codec flags"),
        (reheader(buf, payload[:11]), "shorter than the 12-byte preamble"),
        (with_payload_bytes(0, np.float32([-1.0]).view(np.uint8)), "negative or non-finite"),
        (with_payload_bytes(0, np.float32([np.nan]).view(np.uint8)), "negative or non-finite"),
        (with_payload_bytes(0, np.float32([3e38]).view(np.uint8)), "overflow float32"),
        (reheader(buf, param_a=header.param_a + 1), "counts sum to"),
        (reheader(buf, param_b=1), "samples for 300 elements"),
        (reheader(buf, param_a=0), "without samples"),
        (reheader(buf, bits=header.bits + 1), "header says B_g"),
        (with_widths(header.bits + 1, widths_of(payload)[1]), "header says B_g"),
        (reheader(with_widths(header.bits + 1, widths_of(payload)[1]), bits=header.bits + 1),
         "corrupted payload"),
        (with_widths(header.bits, 10), "B_RLE = 10 for 300"),
        (reheader(buf, n=299), "corrupted payload"),
        (reheader(buf, n=301), "corrupted payload"),
        (reheader(buf, np.append(payload, np.uint8(0))), "follow the last element"),
        (reheader(buf, payload[:-1]), "corrupted payload"),
    ]
    for damaged, message in cases:
        with pytest.raises(CodecError, match=message):
            codec.decode(damaged)
        with pytest.raises(CodecError):
            twin_of(codec).decode(damaged)
        assert_accumulate_refuses(codec, damaged, message)
    # Counts 3 and 3 where the header allows N = 3 samples: the kernel stops at the excess.
    excess = np.concatenate((np.float32([1.0]).view(np.uint8),
                             twin.pack_codes(np.array([3, 0, 3, 3], np.uint64), np.array([32, 32, 3, 3]))))
    excess = reheader(buf, excess, n=2, bits=3, param_a=3, param_b=0)
    for decoder in (codec, twin_of(codec)):
        with pytest.raises(CodecError, match="exceed the sample count"):
            decoder.decode(excess)
    assert_accumulate_refuses(codec, excess, "exceed the sample count")
    with pytest.raises(CodecError, match="payload CRC"):
        checked = MCGQ(K=0.5, checksum=True).encode(x).copy()
        checked[-1] ^= 1
        codec.decode(checked)


def assert_accumulate_refuses(codec, damaged: np.ndarray, message: str) -> None:
    """decode(accumulate=True) of a damaged buffer raises and leaves the running sum as it was
    (most of these cases are found only while the RLE stream is read: after a scratch decode)."""
    try:
        n = read_header(damaged).n
    except CodecError:
        n = 300
    out = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    before = out.copy()
    with pytest.raises(CodecError, match=message):
        codec.decode(damaged, out, accumulate=True)
    assert_bits_equal(out, before)


def test_fuzz_in_subprocess():
    tally = fuzz_tally(FUZZ, 7, 2500, timeout=240)
    outcomes = {key.split(":")[1] for key in tally}
    assert outcomes == {"ok", "error"}
    assert int(tally.get("checksum:error", 0)) > 100 and "checksum:ok" not in tally


# ---- golden fixtures ----------------------------------------------------------------------------------
def golden_cases() -> dict[str, tuple[dict, int, np.ndarray]]:
    i = np.arange(1000, dtype=np.int64)
    smooth = (((i * 2654435761) % 2001 - 1000).astype(np.float32) / np.float32(1000.0)) * np.float32(1e-3)
    sparse = smooth.copy()
    sparse[(i % 7) != 0] = 0
    return {
        "mcgq_k01": ({"id": "mcgq", "K": 0.1, "seed": 7}, 0, smooth),
        "mcgq_k1_checksum": ({"id": "mcgq", "K": 1.0, "seed": 123, "checksum": True}, 3, smooth[:257]),
        "mcgq_k25_sparse": ({"id": "mcgq", "K": 2.5, "seed": 1}, 1, sparse),
        "mcgq_zeros": ({"id": "mcgq", "K": 0.5, "seed": 0}, 0, np.zeros(17, np.float32)),
    }


def make_golden(config: dict, calls: int, x: np.ndarray) -> dict[str, np.ndarray]:
    codec = get_codec(config)
    codec.load_state_dict({"calls": calls})
    encoded = codec.encode(x).copy()
    return {"config": np.array(json.dumps(config)), "calls": np.array(calls), "x": x,
            "encoded": encoded, "decoded": codec.decode(encoded)}


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_wire_format_is_frozen(name):
    config, calls, x = golden_cases()[name]
    stored = np.load(GOLDEN / f"{name}.npz")
    assert json.loads(str(stored["config"])) == config and int(stored["calls"]) == calls
    np.testing.assert_array_equal(stored["x"], x)
    codec = get_codec(config)
    codec.load_state_dict({"calls": calls})
    np.testing.assert_array_equal(codec.encode(x), stored["encoded"])
    np.testing.assert_array_equal(codec.decode(stored["encoded"]), stored["decoded"])
    np.testing.assert_array_equal(twin_of(codec).decode(stored["encoded"]), stored["decoded"])


def test_worked_example_stream_is_frozen():
    np.testing.assert_array_equal(np.load(GOLDEN / "mcgq_paper_example.npy"), rle_encode(PAPER))


# ---- Wasserstein-1 and dynamic sampling ---------------------------------------------------------------
@FAST
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-10, 10, width=32), min_size=n, max_size=n),
    st.lists(st.integers(-3, 3), min_size=n, max_size=n))))
def test_wasserstein1_matches_scipy_and_twin(pair):
    import scipy.stats

    g = np.array(pair[0], np.float32)
    q = np.array(pair[1], np.float32)
    assume(np.any(g) and np.any(q))
    d = wasserstein1(g, q)
    n = g.size
    points = np.arange(n) / n
    reference = scipy.stats.wasserstein_distance(points, points, np.abs(g.astype(np.float64)), np.abs(q))
    assert d == pytest.approx(reference, abs=1e-12, rel=1e-9)
    assert d == pytest.approx(twin.wasserstein1_index(g, q), abs=1e-12, rel=1e-9)
    assert 0 <= d < 1


def test_wasserstein1_cases():
    assert wasserstein1(np.float32([1, 0]), np.float32([0, 1])) == 0.5
    assert wasserstein1(np.float32([2, -1]), np.float32([-4, 2])) == 0.0     # same |.| shape
    assert wasserstein1(np.zeros(3, np.float32), np.zeros(3)) == 0.0
    assert wasserstein1(np.zeros(3, np.float32), np.ones(3)) == 1.0
    with pytest.raises(CodecError, match="3 elements, q has 2"):
        wasserstein1(np.ones(3), np.ones(2))
    with pytest.raises(CodecError, match="NaN"):
        wasserstein1(np.float32([np.nan]), np.ones(1))


def test_dynamic_sampling_follows_algorithm_3():
    sampler = DynamicSampling(K_init=0.2, step=500.0, K_min=0.05, K_max=0.8)
    codec = MCGQ(seed=5)
    rng = np.random.default_rng(4)
    history = []
    for _ in range(12):
        for key, size in (("fc1", 4000), ("fc2", 1000)):
            g = rng.standard_normal(size).astype(np.float32)
            K = sampler.sampling_amount(key)
            buf = codec.encode(g, K=K)
            assert read_header(buf).param_a == sample_count(size, K)
            decoded = codec.decode(buf)
            before = sampler.distance(key)
            new_K = sampler.update(key, g, decoded)
            d = wasserstein1(g, decoded)
            expected = K if before is None else min(max(K + 500.0 * (before - d), 0.05), 0.8)
            assert new_K == pytest.approx(expected, rel=1e-12) and sampler.distance(key) == d
            history.append((key, new_K))
    assert len({k for key, k in history if key == "fc1"}) > 3          # K moved
    state = sampler.state_dict()
    restored = DynamicSampling(K_init=0.2, step=500.0, K_min=0.05, K_max=0.8)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    g = rng.standard_normal(1000).astype(np.float32)
    decoded = codec.decode(codec.encode(g, K=sampler.sampling_amount("fc2")))
    assert restored.update("fc2", g, decoded) == sampler.update("fc2", g, decoded)


def test_dynamic_sampling_rejects_bad_settings_and_state():
    with pytest.raises(CodecError, match="K_min <= K_init <= K_max"):
        DynamicSampling(K_init=2.0, K_max=1.0)
    with pytest.raises(CodecError, match="step"):
        DynamicSampling(step=-1)
    with pytest.raises(CodecError, match="K must be"):
        DynamicSampling(K_min=0)
    sampler = DynamicSampling()
    with pytest.raises(CodecError, match="outside"):
        sampler.load_state_dict({"K": {"a": 5.0}, "distance": {"a": 0.1}})
    with pytest.raises(CodecError, match="different layers"):
        sampler.load_state_dict({"K": {"a": 0.1}, "distance": {}})
    assert sampler.state_dict() == {"K": {}, "distance": {}}


# ---- dynamic sampling inside the codec (dynamic=True) -------------------------------------------------
DYNAMIC = {"id": "mcgq", "K": 0.2, "seed": 5, "dynamic": True, "step": 500.0, "K_min": 0.05, "K_max": 0.8}


def layer_gradients(rng, sizes=(4000, 1000), steps=12):
    return [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(steps)]


def test_dynamic_codec_follows_algorithm_3_and_equals_the_external_sampler():
    codecs = [get_codec(DYNAMIC), get_codec(DYNAMIC)]               # one instance per layer
    sampler = DynamicSampling(K_init=0.2, step=500.0, K_min=0.05, K_max=0.8)
    plain = [MCGQ(K=0.2, seed=5), MCGQ(K=0.2, seed=5)]
    seen = set()
    for step_grads in layer_gradients(np.random.default_rng(4)):
        for layer, (codec, g) in enumerate(zip(codecs, step_grads)):
            K, previous = codec.sampling_amount(), codec.distance()
            assert codec.max_encoded_size(g.size) == codec.max_encoded_size(g.size, K=K)
            buf = codec.encode(g).copy()
            assert read_header(buf).param_a == sample_count(g.size, K)      # this call used K
            d = wasserstein1(g, codec.decode(buf))
            expected = K if previous is None else min(max(K + 500.0 * (previous - d), 0.05), 0.8)
            assert codec.distance() == d and codec.sampling_amount() == pytest.approx(expected, rel=1e-12)
            # Bit for bit what DynamicSampling plus encode(x, K=...) gives on a plain codec.
            reference = plain[layer].encode(g, K=sampler.sampling_amount(layer))
            np.testing.assert_array_equal(buf, reference)
            assert sampler.update(layer, g, plain[layer].decode(reference)) == codec.sampling_amount()
            seen.add(codec.sampling_amount())
    assert len(seen) > 6 and all(0.05 <= K <= 0.8 for K in seen)
    assert codecs[0].K == 0.2 and codecs[0].get_config() == DYNAMIC    # the config never changes


def test_dynamic_codec_moves_K_by_the_distance_difference():
    """Alg. 3's sign: K grows when the distance shrank, falls when it grew, stays within the bounds."""
    codec = get_codec({**DYNAMIC, "step": 10.0, "K_min": 0.01, "K_max": 1.0})
    g = np.float32([4, 0, 0, 0, 1, 0, 0, 3, 0, 2] * 10)
    codec.encode(g)
    d = codec.distance()
    assert codec.sampling_amount() == 0.2 and 0 < d < 0.05          # the first call only records d

    def after(K, previous):
        codec.load_state_dict({"calls": 1, "K": K, "distance": previous})
        codec.encode(g)
        return codec.sampling_amount(), codec.distance()

    previous = d + 0.05                         # the previous call was further off: K grows
    K, d = after(0.2, previous)
    assert K == pytest.approx(0.2 + 10.0 * (previous - d), rel=1e-12) and K > 0.2
    K, d = after(0.5, 0.0)                      # the distance grew from 0: K falls
    assert K == pytest.approx(0.5 - 10.0 * d, rel=1e-12) and K < 0.5
    assert after(0.02, 0.0)[0] == 0.01         # clipped at K_min
    assert after(0.9, 1.0)[0] == 1.0           # clipped at K_max


def test_dynamic_codec_allocates_nothing_gradient_sized_per_call():
    import tracemalloc
    codec = get_codec(DYNAMIC)
    g = np.random.default_rng(2).standard_normal(200_000).astype(np.float32)
    out = np.empty(codec.max_encoded_size(g.size, K=0.8), np.uint8)
    codec.encode(g, out=out)                    # the first call sizes the scratch arrays
    tracemalloc.start()
    try:
        for _ in range(3):
            codec.encode(g, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < g.nbytes // 8


def test_dynamic_state_round_trip_continues_exactly():
    grads = layer_gradients(np.random.default_rng(7), sizes=(3000,), steps=10)
    codec = get_codec(DYNAMIC)
    assert codec.state_dict() == {"calls": 0, "K": 0.2, "distance": None}
    for (g,) in grads[:5]:
        codec.encode(g)
    state = codec.state_dict()
    assert set(state) == {"calls", "K", "distance"} and state["calls"] == 5 and state["K"] != 0.2
    restored = get_codec(json.loads(json.dumps(codec.get_config())))
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    # Restoring the counter alone (what a resume without the adaptive state would be) samples
    # with the initial K again: another N on the wire.
    counter_only = get_codec(DYNAMIC)
    counter_only.calls = state["calls"]
    assert sample_count(3000, state["K"]) != sample_count(3000, 0.2)
    assert read_header(counter_only.encode(grads[5][0])).param_a == sample_count(3000, 0.2)
    for (g,) in grads[5:]:
        np.testing.assert_array_equal(restored.encode(g), codec.encode(g))
    assert restored.state_dict() == codec.state_dict()


@pytest.mark.parametrize("config, state, message", [
    (DYNAMIC, {"calls": 1}, "needs the 'K' and 'distance'"),
    (DYNAMIC, {"calls": 1, "K": 0.9, "distance": 0.1}, "outside"),
    (DYNAMIC, {"calls": 1, "K": float("nan"), "distance": 0.1}, "outside"),
    (DYNAMIC, {"calls": 1, "K": 0.3, "distance": -0.1}, "distance must be"),
    (DYNAMIC, {"calls": 1, "K": 0.3, "distance": "x"}, "distance must be"),
    ({"id": "mcgq"}, {"calls": 1, "K": 0.3, "distance": 0.1}, "dynamic=false"),
])
def test_dynamic_state_is_checked(config, state, message):
    codec = get_codec(config)
    before = codec.state_dict()
    with pytest.raises(CodecError, match=message):
        codec.load_state_dict(state)
    assert codec.state_dict() == before


def test_dynamic_config_round_trip_and_defaults():
    codec = get_codec({"id": "mcgq", "dynamic": True})
    defaults = DynamicSampling()
    assert codec.get_config() == {"id": "mcgq", "K": 0.1, "dynamic": True, "step": defaults.step,
                                  "K_min": defaults.K_min, "K_max": defaults.K_max, "seed": 0}
    for config in (DYNAMIC, {**DYNAMIC, "checksum": True}, codec.get_config()):
        built = get_codec(config)
        assert get_codec(json.loads(json.dumps(built.get_config()))) == built
        assert built.get_config() == get_codec(built.get_config()).get_config()
    assert get_codec(DYNAMIC) != get_codec({**DYNAMIC, "step": 1.0})
    assert get_codec({"id": "mcgq", "dynamic": False}) == MCGQ()
    # How `mpigrad train --codec mcgq --codec-opt dynamic=true` builds it.
    from mpigrad.options import parse_value
    assert get_codec({"id": "mcgq", "dynamic": parse_value("true"), "step": parse_value("1000")}).dynamic


@pytest.mark.parametrize("options, message", [
    ({"dynamic": "yes"}, "dynamic must be true or false"),
    ({"dynamic": 1}, "dynamic must be true or false"),
    ({"step": 2.0}, "step only apply with dynamic=true"),
    ({"K_min": 0.05, "K_max": 0.5}, "K_min, K_max only apply"),
    ({"dynamic": True, "K": 2.0}, "K_min <= K <= K_max"),
    ({"dynamic": True, "K_min": 0.2}, "K_min <= K <= K_max"),
    ({"dynamic": True, "step": -1}, "step must be"),
    ({"dynamic": True, "K_max": 2000}, "K must be"),
])
def test_dynamic_bad_options(options, message):
    with pytest.raises(CodecError, match=message):
        get_codec({"id": "mcgq", **options})


def test_dynamic_codec_refuses_per_call_K_and_keeps_state_on_errors():
    codec = get_codec(DYNAMIC)
    with pytest.raises(CodecError, match="chooses K itself"):
        codec.encode(np.ones(10, np.float32), K=0.5)
    with pytest.raises(CodecError, match="NaN or infinity"):
        codec.encode(np.float32([1, np.nan]))
    assert codec.state_dict() == {"calls": 1, "K": 0.2, "distance": None}
    codec.encode(np.zeros(5, np.float32))          # zero in, zero out: distance 0
    assert codec.distance() == 0.0 and codec.sampling_amount() == 0.2
    other = copy.deepcopy(codec)
    x = np.random.default_rng(1).standard_normal(300)
    np.testing.assert_array_equal(codec.encode(x), other.encode(x.astype(np.float32)))  # float64 in
    assert codec.state_dict() == other.state_dict() and codec.sampling_amount() != 0.2


def test_dynamic_off_keeps_config_and_bytes():
    config, calls, x = golden_cases()["mcgq_k01"]
    stored = np.load(GOLDEN / "mcgq_k01.npz")
    for codec in (get_codec(config), get_codec({**config, "dynamic": False})):
        assert codec.get_config() == config and codec.state_dict() == {"calls": 0}
        codec.load_state_dict({"calls": calls})
        np.testing.assert_array_equal(codec.encode(x), stored["encoded"])
    # Dynamic sampling changes no byte of the format: its first call (K = the initial K)
    # is the plain codec's buffer, and any codec instance decodes every later one.
    dynamic = get_codec({**config, "dynamic": True})
    np.testing.assert_array_equal(dynamic.encode(x), stored["encoded"])
    for _ in range(3):
        buf = dynamic.encode(x)
        np.testing.assert_array_equal(MCGQ().decode(buf), twin_of(MCGQ()).decode(buf))


def test_dynamic_codec_matches_its_numpy_twin():
    codec = get_codec(DYNAMIC)
    reference = twin_of(codec)
    for (g,) in layer_gradients(np.random.default_rng(9), sizes=(700,), steps=6):
        np.testing.assert_array_equal(codec.encode(g), reference.encode(g))
        assert codec.state_dict() == reference.state_dict()


# ---- the training runtime's per-layer codecs and their checkpoint state -------------------------------
def frame_encoder(codec_config: dict, sizes=(3000, 2000), rest: int = 10, feedback: bool = False):
    from mpigrad.feedback import ErrorFeedback
    from mpigrad.runtime.exchange.compressor import GradientCompressor
    from mpigrad.runtime.plan.layout import Layout, Segment, plan_shards
    segments, offset = [], 0
    for i, n in enumerate(sizes):
        segments.append(Segment(f"fc{i}", offset, n))
        offset += n
    layout = Layout(tuple(segments), Segment("small layers", offset, rest), offset + rest)
    (shard,) = plan_shards(layout, 1, len)
    return ShardEncoder(GradientCompressor(list(shard.pieces), get_codec(codec_config),
                                           seeds={i: 11 + i for i in range(len(sizes))},
                                           feedback=ErrorFeedback("residual") if feedback else None), shard)


class ShardEncoder:
    """A compressor with its one shard bound: encode(g, bits) -> frame."""

    def __init__(self, compressor, shard):
        self.compressor, self.shard = compressor, shard

    @property
    def calls(self):
        return self.compressor.calls

    def encode(self, g, bits):
        return self.compressor.encode(g, bits, self.shard)

    def state_dict(self):
        return self.compressor.state_dict()

    def load_state_dict(self, state):
        self.compressor.load_state_dict(state)


@pytest.mark.parametrize("feedback", [False, True])
def test_frame_encoder_checkpoints_each_layer_codec_state(feedback):
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5010).astype(np.float32) for _ in range(8)]
    encoder = frame_encoder(DYNAMIC, feedback=feedback)
    for g in grads[:4]:
        encoder.encode(g, [0, 0])
    state = encoder.state_dict()
    layer_states = {layer: s for layer, _, s in state["codecs"]}
    assert sorted(layer_states) == [0, 1] and state["calls"] == [4, 4]
    assert all(s["K"] != 0.2 and s["distance"] is not None for s in layer_states.values())
    assert layer_states[0]["K"] != layer_states[1]["K"]              # each layer adapts on its own

    resumed = frame_encoder(DYNAMIC, feedback=feedback)
    saved = {**copy.deepcopy(state), "codecs": json.loads(json.dumps(state["codecs"]))}
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["codecs"] == saved["codecs"]
    for g in grads[4:]:
        np.testing.assert_array_equal(resumed.encode(g, [0, 0]), encoder.encode(g, [0, 0]))
    # Restoring the counters alone (an older checkpoint without "codecs" still loads) starts
    # again from the initial K, so the next frame differs.
    counters_only = frame_encoder(DYNAMIC, feedback=feedback)
    counters_only.load_state_dict(copy.deepcopy({k: v for k, v in state.items() if k != "codecs"}))
    assert counters_only.state_dict()["calls"] == state["calls"]
    assert sample_count(3000, layer_states[0]["K"]) != sample_count(3000, 0.2)
    again = frame_encoder(DYNAMIC, feedback=feedback)
    again.load_state_dict(copy.deepcopy(state))
    assert not np.array_equal(counters_only.encode(grads[4], [0, 0]), again.encode(grads[4], [0, 0]))
    with pytest.raises(ValueError, match="quantized layer 5"):
        frame_encoder(DYNAMIC).load_state_dict({"calls": [0, 0], "codecs": [[5, 0, {"calls": 0}]]})


def test_frame_encoder_keeps_the_shared_counter_across_bit_changes():
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(5010).astype(np.float32) for _ in range(6)]
    bits = [[2, 2], [3, 2], [3, 4], [2, 4], [4, 4], [2, 3]]
    config = {"id": "qsgd", "bits": 2, "seed": 1}
    straight = frame_encoder(config)
    frames = [straight.encode(g, b).copy() for g, b in zip(grads, bits)]
    assert straight.calls == [6, 6]
    stopped = frame_encoder(config)
    for g, b in zip(grads[:3], bits[:3]):
        stopped.encode(g, b)
    state = stopped.state_dict()
    assert sorted((layer, b) for layer, b, _ in state["codecs"]) == [(0, 2), (0, 3), (1, 2), (1, 4)]
    assert all(set(s) == {"calls"} for _, _, s in state["codecs"])   # base behaviour for others
    resumed = frame_encoder(config)
    resumed.load_state_dict(state)
    for g, b, frame in zip(grads[3:], bits[3:], frames[3:]):
        np.testing.assert_array_equal(resumed.encode(g, b), frame)

if __name__ == "__main__" and "--regenerate" in sys.argv:
    for fixture, case in golden_cases().items():
        np.savez(GOLDEN / f"{fixture}.npz", **make_golden(*case))
    np.save(GOLDEN / "mcgq_paper_example.npy", rle_encode(PAPER))
    print(f"wrote {len(golden_cases()) + 1} fixtures to {GOLDEN}")
