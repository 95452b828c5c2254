"""Numba codecs (uniform, qsgd, terngrad, sign): twins, properties, statistics, errors, bench CLI."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mpigrad.cli import main as cli_main
from mpigrad.codecs import HEADER_SIZE, CodecError, get_codec, read_header
from mpigrad.codecs.base import _write_header
from mpigrad.codecs.contract import check_contract
from mpigrad.codecs.kernels import common
from mpigrad.codecs.reference import numpy_kernels as nk
from mpigrad.codecs.reference import twin_of

CONFIGS = [
    {"id": "uniform", "bits": 1},
    {"id": "uniform", "bits": 3},
    {"id": "uniform", "bits": 8},
    {"id": "uniform", "bits": 5, "bucket_size": 100, "rounding": "stochastic", "seed": 3},
    {"id": "qsgd"},
    {"id": "qsgd", "bits": 2, "bucket_size": 7, "seed": 9},
    {"id": "qsgd", "bits": 8, "norm": "l2", "bucket_size": None},
    {"id": "qsgd", "levels": 5},
    {"id": "qsgd", "coding": "elias"},
    {"id": "qsgd", "coding": "elias", "norm": "l2", "levels": 300, "bucket_size": None},
    {"id": "terngrad"},
    {"id": "terngrad", "bucket_size": 333, "clip": 0},
    {"id": "sign"},
    {"id": "sign", "bucket_size": 64},
]
IDS = [json.dumps({k: v for k, v in c.items()}, separators=(",", ":")) for c in CONFIGS]
SIZES = [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 5]


def edge_inputs(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    normal = rng.standard_normal(n).astype(np.float32)
    return {
        "normal": normal,
        "zeros": np.zeros(n, np.float32),
        "constant": np.full(n, -3.25, np.float32),
        "huge": normal * np.float32(1e36),
        "tiny": (normal.astype(np.float64) * 1e-42).astype(np.float32),
        "spiky": np.where(rng.random(n) < 0.01, normal * 1e4, normal * 1e-4).astype(np.float32),
    }


def reheader(buf: np.ndarray, extra: bytes = b"", **fields) -> np.ndarray:
    """A copy of valid ``buf`` plus ``extra`` bytes, header fields replaced, header CRC valid."""
    out = np.concatenate([buf, np.frombuffer(extra, np.uint8)])
    header = read_header(buf)._replace(**fields)
    _write_header(out, header, with_crc=False)
    return out


def bits_identical(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


# ---- twins: the kernels against plain NumPy, byte for byte ------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("n", SIZES)
def test_kernels_match_numpy_twins(config, n):
    for name, x in edge_inputs(n).items():
        codec = get_codec(config)
        twin = twin_of(codec)
        try:
            fast = codec.encode(x).copy()
        except CodecError as exc:
            with pytest.raises(CodecError, match=str(exc)[:30]):
                twin.encode(x)
            assert name == "huge" and config["id"] in ("uniform", "qsgd"), (name, exc)
            continue
        slow = twin.encode(x)
        assert np.array_equal(fast, slow), (name, np.flatnonzero(fast != slow)[:5])
        y = codec.decode(fast)
        assert bits_identical(y, twin.decode(fast)), name
        assert np.isfinite(y).all()


def test_half_kernels_cast_as_numpy_does():
    """kernels/half.py against NumPy's casts, bit for bit: random float32 bit patterns, every
    half and the float32s around each one (the rounding boundaries), infinities and NaNs."""
    from mpigrad.codecs.kernels import half

    rng = np.random.default_rng(0)
    halves = half.HALF_TO_FLOAT.view(np.uint32)
    near = np.concatenate([halves + d for d in (0, 1, 0xFFF, 0x1000, 0x1001)] + [halves - 1])
    special = np.array([0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x387FF000, 0x7F800000, 0xFF800000,
                        0x7FC00000, 0x7F800001, 0x80000000], np.uint32)
    for src in (rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32), near.astype(np.uint32), special):
        values = src.view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            want = values.astype(np.float16)
        got = np.empty(src.size, np.uint16)
        not_finite = half.narrow(src, got)
        nan = np.isnan(values)
        np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])
        assert np.isnan(got.view(np.float16)[nan]).all()
        assert not_finite == (~np.isfinite(want)).sum()
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(every.size, np.float32)
    half.widen(every, half.HALF_TO_FLOAT, out)
    np.testing.assert_array_equal(out.view(np.uint32), every.view(np.float16).astype(np.float32).view(np.uint32))
    acc = np.ones(every.size, np.float32)
    half.widen_add(every, half.HALF_TO_FLOAT, acc)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(acc, np.float32(1) + every.view(np.float16).astype(np.float32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_twins_and_error_bounds(data):
    """Random codec configs over random shapes and values, edge values included."""
    codec_id = data.draw(st.sampled_from(["uniform", "qsgd", "terngrad", "sign"]))
    bucket = data.draw(st.one_of(st.none(), st.integers(1, 5000)))
    config = {"id": codec_id, "bucket_size": bucket}
    if codec_id == "uniform":
        config.update(bits=data.draw(st.integers(1, 8)),
                      rounding=data.draw(st.sampled_from(["nearest", "stochastic"])))
    elif codec_id == "qsgd":
        config.update(bits=data.draw(st.integers(2, 8)), norm=data.draw(st.sampled_from(["max", "l2"])),
                      coding=data.draw(st.sampled_from(["fixed", "elias"])))
    codec = get_codec(config)
    magnitude = data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
    elements = st.floats(-1.0, 1.0, width=32) | st.sampled_from([0.0, -0.0, 1.0, -1.0])
    x = data.draw(hnp.arrays(np.float32, st.integers(0, 9000), elements=elements))
    x = (x * np.float32(magnitude)).astype(np.float32)

    buf = codec.encode(x).copy()
    assert np.array_equal(buf, twin_of(get_codec(config)).encode(x))
    assert buf.size <= codec.max_encoded_size(x.size)
    y = codec.decode(buf)
    assert np.isfinite(y).all() and y.dtype == np.float32 and y.size == x.size
    if x.size:
        _check_error_bound(codec, x, y, buf)


def _check_error_bound(codec, x, y, buf):
    header = read_header(buf)
    bucket = codec.bucket_size or x.size
    for start in range(0, x.size, bucket):
        xs, ys = x[start:start + bucket].astype(np.float64), y[start:start + bucket].astype(np.float64)
        lo, hi = xs.min(), xs.max()
        top = np.abs(xs).max()
        ulp = 4 * np.spacing(np.float32(max(abs(lo), abs(hi), 1e-38)))
        if codec.codec_id == "uniform":
            step = (hi - lo) / ((1 << header.bits) - 1)
            limit = step * (0.5 if codec.rounding == "nearest" else 1.0)
            assert np.abs(ys - xs).max() <= limit * 1.001 + ulp
            assert ys.min() >= lo - ulp and ys.max() <= hi + ulp
        elif codec.codec_id == "qsgd":
            scale = top if codec.norm == "max" else np.sqrt((xs * xs).sum())
            assert np.abs(ys - xs).max() <= scale / codec.levels * 1.001 + ulp
            assert np.all(ys * xs >= 0)
        elif codec.codec_id == "terngrad":
            assert len(np.unique(np.abs(ys))) <= 2 and np.abs(ys).max() <= top * 1.0001
            assert np.all(ys * xs >= 0)
        else:
            assert np.allclose(np.abs(ys), np.abs(xs).mean(), rtol=1e-5, atol=1e-38)
            assert np.all((ys < 0) == (xs < 0))


# ---- decode(accumulate=True): fused kernels against out + decode, bit for bit -------------
ACC_CONFIGS = CONFIGS + [{"id": "fp32"}, {"id": "fp16"}, {"id": "qsgd", "levels": 100},
                         {"id": "uniform", "bits": 2, "bucket_size": 4096}]
ACC_IDS = [json.dumps(c, separators=(",", ":")) for c in ACC_CONFIGS]


def running_sum(n: int, seed: int = 0) -> np.ndarray:
    """A plausible float32 running sum with signed zeros, tiny and huge values in it."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal(n).astype(np.float32)
    picks = rng.integers(0, 5, n)
    out[picks == 0] = -0.0
    out[picks == 1] = 0.0
    out[picks == 2] *= np.float32(1e-40)
    out[picks == 3] *= np.float32(1e30)
    return out


def check_accumulate(codec, buf: np.ndarray, before: np.ndarray) -> None:
    """codec's fused accumulate, the twin's scratch + add, and out + decode agree bit for bit."""
    with np.errstate(over="ignore"):
        expect = before + codec.decode(buf)
    got = before.copy()
    assert codec.decode(buf, got, accumulate=True) is got
    assert bits_identical(got, expect), np.flatnonzero(got.view(np.int32) != expect.view(np.int32))[:5]
    reference = before.copy()
    with np.errstate(over="ignore"):
        twin_of(codec).decode(buf, reference, accumulate=True)
    assert bits_identical(reference, expect)


@pytest.mark.parametrize("config", ACC_CONFIGS, ids=ACC_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_accumulate_equals_out_plus_decode(config, n):
    for name, x in edge_inputs(n).items():
        codec = get_codec(config)
        try:
            buf = codec.encode(x).copy()
        except CodecError:
            continue
        check_accumulate(codec, buf, running_sum(n, seed=n))
        check_accumulate(codec, buf, np.zeros(n, np.float32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_accumulate_equals_out_plus_decode(data):
    """Random fused-kernel configs, sizes (blocks and tails) and buckets."""
    codec_id = data.draw(st.sampled_from(["uniform", "qsgd", "terngrad", "sign"]))
    config = {"id": codec_id, "bucket_size": data.draw(st.one_of(st.none(), st.integers(1, 5000)))}
    if codec_id == "uniform":
        config["bits"] = data.draw(st.integers(1, 8))
    elif codec_id == "qsgd":
        if data.draw(st.booleans()):
            config["bits"] = data.draw(st.integers(2, 8))
        else:
            config["levels"] = data.draw(st.integers(1, 127))
    n = data.draw(st.integers(0, 3 * common.BLOCK + 9))
    seed = data.draw(st.integers(0, 2**16))
    x = (np.random.default_rng(seed).standard_normal(n) * 10.0 ** (seed % 9 - 4)).astype(np.float32)
    codec = get_codec(config)
    check_accumulate(codec, codec.encode(x).copy(), running_sum(n, seed))


def test_accumulate_needs_a_float32_out_of_the_right_size():
    codec = get_codec({"id": "uniform"})
    buf = codec.encode(np.ones(100, np.float32))
    with pytest.raises(CodecError, match="accumulate=True.* needs out="):
        codec.decode(buf, accumulate=True)
    for bad in (np.zeros(99, np.float32), np.zeros(100, np.float64), np.zeros(200, np.float32)[::2]):
        before = bad.copy()
        with pytest.raises(CodecError, match="out="):
            codec.decode(buf, bad, accumulate=True)
        assert np.array_equal(bad, before)
    out = np.ones(100, np.float32)
    assert codec.decode(buf, out, accumulate=False) is out and np.array_equal(out, np.ones(100))


def _corrupted_buffers(x: np.ndarray):
    """(codec config, good buffer, damaged copy, message) for damage found only by the checks
    next to the kernels, or inside them (codes and streams)."""
    def encoded(config):
        return get_codec(config).encode(x).copy()

    def shortened(buf, nbytes):
        """``buf`` less its last ``nbytes``, with a header that agrees."""
        short = buf[:-nbytes].copy()
        _write_header(short, read_header(buf)._replace(payload_len=short.size - HEADER_SIZE), False)
        return short

    def with_byte(buf, at, value):
        bad = buf.copy()
        bad[at] = value
        return bad

    nan = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    last = 4 * (-(-x.size // 1000) - 1)  # the last bucket's scale (uniform: its lo)
    for config in ({"id": "uniform"}, {"id": "qsgd"}, {"id": "terngrad"}, {"id": "sign"},
                   {"id": "qsgd", "coding": "elias"}):
        config = {**config, "bucket_size": 1000}
        good = encoded(config)
        bad = good.copy()
        at = HEADER_SIZE + (2 * last if config["id"] == "uniform" else last)
        bad[at:at + 4] = nan
        yield config, good, bad, "scale"
    good = encoded({"id": "uniform", "bucket_size": 1000})
    bad = good.copy()
    bad[HEADER_SIZE + 16:HEADER_SIZE + 24] = np.frombuffer(np.float32([1.0, -1.0]).tobytes(), np.uint8)
    yield {"id": "uniform"}, good, bad, "out of order"
    # Bad codes at the first element (the kernel would write everything after it) and the last.
    tern = encoded({"id": "terngrad"})
    yield {"id": "terngrad"}, tern, with_byte(tern, HEADER_SIZE + 4, 0x03), "cannot contain"
    yield {"id": "terngrad"}, tern, with_byte(tern, -1, tern[-1] | 0xC0 >> (2 * ((x.size - 1) % 4))), \
        "cannot contain"
    levels = encoded({"id": "qsgd", "levels": 5, "bucket_size": None})  # 4-bit codes, levels <= 5
    yield {"id": "qsgd"}, levels, with_byte(levels, HEADER_SIZE + 4, 0x07), "cannot contain"
    yield {"id": "qsgd"}, levels, with_byte(levels, -1, 0x77), "cannot contain"
    elias = encoded({"id": "qsgd", "coding": "elias"})
    yield {"id": "qsgd"}, elias, reheader(elias, b"\0", payload_len=elias.size - 39), "corrupted payload"
    yield {"id": "qsgd"}, elias, shortened(elias, 3), "corrupted payload"
    half = encoded({"id": "fp16"})
    yield {"id": "fp16"}, half, shortened(half, 2), "cannot hold"


def test_corrupted_buffer_with_accumulate_raises_and_leaves_out_unchanged():
    n = 2 * common.BLOCK + 1234
    x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    for config, good, bad, message in _corrupted_buffers(x):
        codec = get_codec(config)
        for decoder in (codec, twin_of(codec)):
            out = running_sum(n)
            before = out.copy()
            with pytest.raises(CodecError, match=message):
                decoder.decode(bad, out, accumulate=True)
            assert bits_identical(out, before), (config, message)
        # The same instance (its scratch, where it has one) then adds a good buffer right.
        check_accumulate(codec, good, running_sum(n, 1))


def test_mutated_buffers_with_accumulate_raise_before_writing():
    """The fuzzer's mutations (tests/fuzz_codecs.py), decoded with accumulate=True in a
    subprocess: CodecError with ``out`` untouched, or exactly ``out + decode(buf)``."""
    import subprocess
    import sys
    from pathlib import Path
    script = f"""
import sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fuzz_codecs import CONFIGS, SIZES, mutate
from mpigrad.codecs import CodecError, get_codec, read_header
rng = np.random.default_rng(99)
valid = [(c, get_codec(c).encode((rng.standard_normal(n) * 1e-2).astype(np.float32)).copy())
         for c in CONFIGS for n in SIZES]
seen = {{"ok": 0, "error": 0}}
for i in range(1500):
    config, buf = valid[rng.integers(len(valid))]
    kind, bad = mutate(rng, buf)
    try:
        n = read_header(bad).n
    except CodecError:
        n = read_header(buf).n
    if n > 1 << 20:
        continue
    codec = get_codec({{"id": config["id"]}})
    out = rng.standard_normal(n).astype(np.float32)
    before = out.copy()
    try:
        codec.decode(bad, out, accumulate=True)
    except CodecError:
        assert np.array_equal(out.view(np.int32), before.view(np.int32)), (i, kind, config)
        seen["error"] += 1
        continue
    expect = before + codec.decode(bad)
    assert np.array_equal(out.view(np.int32), expect.view(np.int32)), (i, kind, config)
    seen["ok"] += 1
print(seen["ok"], seen["error"])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    ok, errors = map(int, result.stdout.split())
    assert ok > 100 and errors > 100


# ---- the shared primitives against their NumPy versions -------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_match_numpy(bits):
    rng = np.random.default_rng(bits)
    n = 2 * common.BLOCK + 77
    codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
    packed = np.zeros(common.packed_nbytes(n, bits), np.uint8)
    words = np.empty(common.GROUPS, np.uint64)
    for block in range(2):
        common.pack_block(codes[block * common.BLOCK:], bits, packed, block * bits * common.GROUPS, words)
    common.pack_tail(codes[2 * common.BLOCK:], 77, bits, packed, 2 * bits * common.GROUPS)
    assert np.array_equal(packed, nk.pack_codes(codes, bits))
    assert packed.size == (n * bits + 7) // 8
    back = np.empty(common.BLOCK, np.uint8)
    common.unpack_block(packed, bits * common.GROUPS, bits, back, words)
    assert np.array_equal(back, codes[common.BLOCK:2 * common.BLOCK])
    assert np.array_equal(nk.unpack_codes(packed, n, bits), codes)


def test_rng_order_keys_and_lane_sums_match_numpy():
    key = nk.stream_key(12345, 6)
    assert key == int(common.stream_key(12345, 6))
    draws = nk.uniform01(key, 1000, 64)
    assert np.array_equal(draws, np.array([common.uniform01(np.uint64(key), i) for i in range(1000, 1064)],
                                          np.float32))
    x = np.array([0.0, -0.0, 1.5, -2.0, 3e38, -3e38, 1e-45, -1e-45], np.float32)
    keys = nk.order_keys(x)
    assert np.array_equal(np.argsort(keys, kind="stable"), [5, 3, 7, 1, 0, 6, 2, 4])
    assert bits_identical(nk.key_floats(keys), x)
    lo, hi = common.key_range(x.view(np.int32), 0, x.size)
    assert (lo, hi) == (keys.min(), keys.max())
    values = np.random.default_rng(0).standard_normal(1003).astype(np.float32)
    for mode, term in ((common.SUM_PLAIN, lambda v: v), (common.SUM_ABS, np.abs),
                       (common.SUM_SQUARES, lambda v: v * v)):
        expect = nk.lane_sums(term(values.astype(np.float64)), 100)
        got = [common.lane_sum(values, s, min(s + 100, 1003), mode) for s in range(0, 1003, 100)]
        assert np.array_equal(expect, got)


def test_elias_omega_codes():
    known = {1: "0", 2: "100", 3: "110", 4: "101000", 7: "101110", 8: "1110000", 16: "10100100000"}
    for value, code in known.items():
        assert common.omega_len(value) == len(code)
        assert tuple(common.omega_code(value)) == (int(code, 2), len(code))
        buf = np.zeros(4, np.uint8)
        common.put_bits(buf, 3, *common.omega_code(value))
        assert "".join(map(str, np.unpackbits(buf)))[3:3 + len(code)] == code
        assert tuple(common.get_omega(buf, 3, 32)) == (value, 3 + len(code))
        assert common.get_omega(buf, 3, 3 + len(code) - 1)[0] == common.ERR_OVERRUN
        values, widths = nk.omega_fields(np.array([value]))
        assert np.array_equal(nk.msb_pack(values, widths), np.packbits([int(c) for c in code]))
    for value in (1023, 1024, 5000, 2**24, 2**34 + 5):  # past the lookup table
        code, length = common.omega_code(value)
        values, widths = nk.omega_fields(np.array([value]))
        assert length == common.omega_len(value) == widths.sum()
        buf = np.zeros(8, np.uint8)
        common.put_bits(buf, 5, code, length)
        expect = np.unpackbits(nk.msb_pack(values, widths))[:length]
        assert np.array_equal(np.unpackbits(buf)[5:5 + length], expect)
        assert tuple(common.get_omega(buf, 5, 64)) == (value, 5 + length)
    endless = np.full(16, 0xFF, np.uint8)
    assert common.get_omega(endless, 0, 128)[0] in (common.ERR_OVERRUN, common.ERR_BAD_CODE)


# ---- statistics: unbiasedness and the QSGD variance bound -----------------------------
def _mean_and_var(codec, x, draws):
    total = np.zeros(x.size)
    squares = np.zeros(x.size)
    y = np.empty_like(x)
    for _ in range(draws):
        codec.decode(codec.encode(x), out=y)
        total += y
        squares += (y.astype(np.float64) - x) ** 2
    return total / draws, squares / draws


@pytest.mark.parametrize("config", [
    {"id": "qsgd", "bits": 2, "bucket_size": 16},
    {"id": "qsgd", "levels": 3, "coding": "elias", "norm": "l2"},
    {"id": "terngrad", "clip": 0},
    {"id": "uniform", "bits": 2, "rounding": "stochastic"},
], ids=["qsgd", "qsgd-elias-l2", "terngrad", "uniform-stochastic"])
def test_stochastic_codecs_are_unbiased(config):
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    draws = 4000
    mean, mse = _mean_and_var(get_codec(config), x, draws)
    # Per-element standard error of the mean, from the observed variance; 5 sigma.
    stderr = np.sqrt(mse / draws)
    assert np.all(np.abs(mean - x) <= 5 * stderr + 1e-6), np.max(np.abs(mean - x) / (stderr + 1e-12))
    assert mse.max() > 0


def test_qsgd_variance_bound_l2():
    """E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2 (Lemma 3.1), l2 scaling."""
    rng = np.random.default_rng(2)
    for n, s in ((256, 1), (256, 4), (1024, 32)):
        v = rng.standard_normal(n).astype(np.float32)
        codec = get_codec({"id": "qsgd", "levels": s, "norm": "l2", "bucket_size": None,
                           "coding": "elias" if s > 127 else "fixed"})
        _, mse = _mean_and_var(codec, v, 300)
        bound = min(n / s**2, np.sqrt(n) / s) * float(np.dot(v.astype(np.float64), v))
        assert mse.sum() <= bound, (n, s, mse.sum(), bound)
        assert mse.sum() >= 0.05 * bound  # the test can fail: quantization does add variance


def test_qsgd_elias_size_within_paper_bound():
    """At s = sqrt(n) with l2 scaling, the stream stays within about 2.8n + 32 bits."""
    for n in (4096, 65536):
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        codec = get_codec({"id": "qsgd", "levels": int(np.sqrt(n)), "norm": "l2",
                           "bucket_size": None, "coding": "elias"})
        payload_bits = 8 * (codec.encode(x).size - HEADER_SIZE) - 64  # less the nonzero count
        assert payload_bits <= 2.8 * n + 32, payload_bits / n


# ---- wire sizes, determinism, config -------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_and_qsgd_fixed_sizes(bits):
    n = 10_001
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    assert get_codec({"id": "uniform", "bits": bits}).encode(x).size == HEADER_SIZE + 8 + -(-n * bits // 8)
    buckets = get_codec({"id": "uniform", "bits": bits, "bucket_size": 1000}).encode(x)
    assert buckets.size == HEADER_SIZE + 8 * 11 + -(-n * bits // 8)
    if bits >= 2:
        qsgd = get_codec({"id": "qsgd", "bits": bits, "bucket_size": 512}).encode(x)
        assert qsgd.size == HEADER_SIZE + 4 * 20 + -(-n * bits // 8)
    assert get_codec({"id": "terngrad"}).encode(x).size == HEADER_SIZE + 4 + -(-n // 4)
    assert get_codec({"id": "sign"}).encode(x).size == HEADER_SIZE + 4 + -(-n // 8)


EXACT = {"fp32", "fp16", "uniform", "sign", "terngrad"}  # and qsgd with fixed codes


@pytest.mark.parametrize("config", ACC_CONFIGS + [{"id": "mcgq"}], ids=ACC_IDS + ["mcgq"])
def test_exact_size_codecs_fill_their_max_encoded_size_on_any_data(config):
    """``exact_size`` lets every rank size a broadcast frame from the element count alone:
    it must hold on every input (zeros, constants, sparse, huge range), and only where declared."""
    codec = get_codec(config)
    exact = config["id"] in EXACT or (config["id"] == "qsgd" and config.get("coding", "fixed") == "fixed")
    assert codec.exact_size is exact
    rng = np.random.default_rng(4)
    sizes = set()
    for n in (1, 7, 4097):
        sparse = np.zeros(n, np.float32)
        sparse[::97] = rng.standard_normal(sparse[::97].size)
        for x in (np.zeros(n, np.float32), np.full(n, -2.5, np.float32), sparse,
                  (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float32)):
            size = codec.encode(x).size
            sizes.add(size == codec.max_encoded_size(n))
            if exact:
                assert size == codec.max_encoded_size(n), (n, size)
    if not exact:
        assert False in sizes  # the data sets the size: a length has to travel


def test_a_codec_that_declares_exact_size_and_writes_less_is_caught():
    elias = get_codec({"id": "qsgd", "coding": "elias"})
    codec = type("Liar", (type(elias),), {"exact_size": True})(coding="elias")  # a wrong declaration
    with pytest.raises(AssertionError, match="declares exact_size"):
        codec.encode(np.zeros(100, np.float32))


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_config_round_trip_and_determinism(config):
    codec = get_codec(config)
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    first = codec.encode(x).copy()
    state = codec.state_dict()
    second = codec.encode(x).copy()
    replay = get_codec(codec.get_config())
    assert np.array_equal(replay.encode(x), first)
    replay.load_state_dict(state)
    assert np.array_equal(replay.encode(x), second)
    assert codec.stochastic == (not np.array_equal(first, second))
    # The header carries what decoding needs: a default instance of the class decodes it.
    assert bits_identical(get_codec({"id": config["id"]}).decode(first), codec.decode(first))


def test_with_bits_and_options():
    q = get_codec({"id": "qsgd", "levels": 5, "coding": "elias", "seed": 4})
    assert q.with_bits(3).get_config() == {"id": "qsgd", "bits": 3, "bucket_size": 512, "norm": "max",
                                           "coding": "elias", "seed": 4}
    u = get_codec({"id": "uniform", "bits": 2, "rounding": "stochastic", "seed": 1})
    assert u.with_bits(7) == get_codec({"id": "uniform", "bits": 7, "rounding": "stochastic", "seed": 1})
    assert u.stochastic and not get_codec({"id": "uniform"}).stochastic
    assert "seed" not in get_codec({"id": "uniform"}).get_config()
    with pytest.raises(CodecError, match="no 'bits' option"):
        get_codec({"id": "sign"}).with_bits(2)


@pytest.mark.parametrize("config, message", [
    ({"id": "uniform", "bits": 0}, "bits must be"),
    ({"id": "uniform", "bits": 9}, "bits must be"),
    ({"id": "uniform", "bits": True}, "bits must be"),
    ({"id": "uniform", "rounding": "up"}, "rounding must be"),
    ({"id": "uniform", "bucket_size": 0}, "bucket_size must be"),
    ({"id": "qsgd", "bits": 1}, "bits must be"),
    ({"id": "qsgd", "bits": 4, "levels": 7}, "not both"),
    ({"id": "qsgd", "levels": 128}, "levels must be"),
    ({"id": "qsgd", "levels": 0, "coding": "elias"}, "levels must be"),
    ({"id": "qsgd", "norm": "l1"}, "norm must be"),
    ({"id": "qsgd", "coding": "huffman"}, "coding must be"),
    ({"id": "qsgd", "seed": -1}, "seed must be"),
    ({"id": "terngrad", "clip": -1}, "clip must be"),
    ({"id": "terngrad", "clip": float("nan")}, "clip must be"),
    ({"id": "sign", "seed": 1}, r"codec .sign.: unknown option\(s\) seed; valid: bucket_size, checksum"),
])
def test_bad_options_rejected(config, message):
    with pytest.raises(CodecError, match=message):
        get_codec(config)


# ---- input handling and buffer validation ---------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_non_finite_input_rejected(config):
    codec = get_codec(config)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(5000, np.float32)
        x[4321] = bad
        with pytest.raises(CodecError, match="NaN or infinity"):
            codec.encode(x)
    assert codec.encode(np.ones(5000, np.float32)).size  # the codec still works


def test_float64_and_strided_input_converted_2d_rejected():
    codec = get_codec({"id": "uniform", "bits": 4})
    x = np.random.default_rng(0).standard_normal(2000)
    expect = codec.encode(x.astype(np.float32)).copy()
    assert np.array_equal(codec.encode(x), expect)
    wide = np.zeros(4000, np.float32)
    wide[::2] = x
    assert np.array_equal(codec.encode(wide[::2]), expect)
    with pytest.raises(CodecError, match="1-D"):
        codec.encode(x.reshape(40, 50))
    with pytest.raises(CodecError, match="floating-point"):
        codec.encode(np.arange(10))
    with pytest.raises(CodecError, match="float32 range"):
        codec.encode(np.array([-3e38, 3e38], np.float32))


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_damaged_buffers_raise_codec_error(config):
    codec = get_codec(config)
    x = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    buf = codec.encode(x).copy()
    header = read_header(buf)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(buf[:-1])
    with pytest.raises(CodecError, match="version"):
        bad = buf.copy()
        bad[2] = 9
        codec.decode(bad)
    with pytest.raises(CodecError, match="header CRC"):
        bad = buf.copy()
        bad[20] ^= 1
        codec.decode(bad)
    other = "sign" if config["id"] != "sign" else "uniform"
    with pytest.raises(CodecError, match=f"encoded by codec '{config['id']}', not '{other}'"):
        get_codec({"id": other}).decode(buf)
    # Header fields rewritten with a valid CRC: the codec's own checks must catch them.
    # (A changed n is only detectable where the payload length depends on it.)
    changes = [{"bits": 0}, {"bits": 9}, {"flags": 0x80}, {"param_b": header.param_b + 1000}, {"param_a": 3}]
    if config.get("coding") != "elias":
        changes += [{"n": header.n + 64}, {"n": header.n - 64}]
    for fields in changes:
        with pytest.raises(CodecError, match=config["id"]):
            codec.decode(reheader(buf, **fields))
    with pytest.raises(CodecError, match="out= holds"):
        codec.decode(buf, out=np.empty(4999, np.float32))


@pytest.mark.parametrize("config", ACC_CONFIGS + [{"id": "mcgq"}],
                         ids=[json.dumps(c, separators=(",", ":")) for c in ACC_CONFIGS + [{"id": "mcgq"}]])
def test_built_in_codecs_meet_the_contract_plugins_are_held_to(config):
    """One rule, one place: mpigrad.codecs.contract checks a plugin when it is built, and
    mpigrad's own codecs meet the same contract (they declare no error_bound: the property
    tests above hold each to its own)."""
    check_contract(get_codec(config))


def test_corrupted_scales_and_codes_detected():
    x = np.random.default_rng(6).standard_normal(3000).astype(np.float32)
    for config in ({"id": "uniform"}, {"id": "qsgd"}, {"id": "terngrad"}, {"id": "sign"}):
        buf = get_codec(config).encode(x).copy()
        buf[HEADER_SIZE:HEADER_SIZE + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
        with pytest.raises(CodecError, match="scale"):
            get_codec(config).decode(buf)
    lohi = get_codec({"id": "uniform"}).encode(x).copy()
    lohi[HEADER_SIZE:HEADER_SIZE + 8] = np.frombuffer(np.array([1.0, -1.0], np.float32).tobytes(), np.uint8)
    with pytest.raises(CodecError, match="out of order"):
        get_codec({"id": "uniform"}).decode(lohi)
    tern = get_codec({"id": "terngrad"}).encode(x).copy()
    tern[-1] = 0xFF
    with pytest.raises(CodecError, match="cannot contain"):
        get_codec({"id": "terngrad"}).decode(tern)
    levels = get_codec({"id": "qsgd", "levels": 5}).encode(x).copy()
    levels[-1] = 0x77  # level 7 > s = 5 in a 4-bit code
    with pytest.raises(CodecError, match="cannot contain"):
        get_codec({"id": "qsgd"}).decode(levels)
    elias = get_codec({"id": "qsgd", "coding": "elias"}).encode(x).copy()
    with pytest.raises(CodecError, match="corrupted payload"):
        get_codec({"id": "qsgd"}).decode(reheader(elias, b"\0", payload_len=elias.size - 39))


def test_decode_into_out_allocates_nothing_gradient_sized():
    n = 1 << 20
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)
    for config in ACC_CONFIGS:
        codec = get_codec(config)
        buf = codec.encode(x).copy()
        for accumulate in (False, True):
            codec.decode(buf, out=out, accumulate=accumulate)  # sizes Elias's scratch, once
            tracemalloc.start()
            codec.decode(buf, out=out, accumulate=accumulate)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < n // 16, (config, accumulate, peak)
    # Only the codecs that find corruption while decoding keep a scratch array.
    fused = [c for c in ACC_CONFIGS if c.get("coding") != "elias"]
    for config in fused:
        codec = get_codec(config)
        codec.decode(codec.encode(x), out=out, accumulate=True)
        assert codec._scratch.size == 0, config


def test_compressor_decode_accumulates_every_piece():
    from mpigrad.runtime.exchange.compressor import GradientCompressor
    from mpigrad.runtime.plan.layout import Layout, Segment, plan_shards
    sizes, rest = (5000, 3 * common.BLOCK + 7), 33
    segments, offset = [], 0
    for i, size in enumerate(sizes):
        segments.append(Segment(f"layer{i}", offset, size))
        offset += size
    layout = Layout(tuple(segments), Segment("small layers", offset, rest), offset + rest)
    rng = np.random.default_rng(4)
    for config in ({"id": "qsgd", "bits": 3}, {"id": "qsgd", "coding": "elias"}, {"id": "sign"}):
        codec = get_codec(config)
        (shard,) = plan_shards(layout, 1, len)
        compressor = GradientCompressor(list(shard.pieces), codec, seeds={0: 1, 1: 2})
        frame = compressor.encode(rng.standard_normal(layout.total).astype(np.float32), [3, 3], shard).copy()
        decoded = np.empty(layout.total, np.float32)
        compressor.decode(frame, shard, decoded)
        before = running_sum(layout.total)
        total = before.copy()
        compressor.decode(frame, shard, total, accumulate=True)
        assert bits_identical(total, before + decoded), config


# ---- semantics worth pinning -------------------------------------------------------
def test_uniform_matches_min_combined_formula():
    x = np.array([-1.0, -0.5, 0.1, 0.2, 1.0, 2.0], np.float32)
    codec = get_codec({"id": "uniform", "bits": 2})
    lo, hi = -1.0, 2.0
    q = np.rint((x.astype(np.float64) - lo) * 3 / (hi - lo))
    assert np.allclose(codec.decode(codec.encode(x)), lo + q * (hi - lo) / 3, atol=1e-6)
    constant = np.full(100, 0.123, np.float32)
    assert np.array_equal(codec.decode(codec.encode(constant)), constant)


def test_terngrad_clips_and_sign_scales():
    x = np.concatenate([np.random.default_rng(8).standard_normal(999), [1000.0]]).astype(np.float32)
    y = get_codec({"id": "terngrad"}).decode(get_codec({"id": "terngrad"}).encode(x))
    sigma = float(np.std(x.astype(np.float64)))
    assert np.abs(y).max() == pytest.approx(2.5 * sigma, rel=1e-5)
    assert np.abs(get_codec({"id": "terngrad", "clip": 0}).decode(
        get_codec({"id": "terngrad", "clip": 0}).encode(x))).max() == 1000.0
    z = np.array([0.0, -0.0, 2.0, -4.0], np.float32)
    sign = get_codec({"id": "sign"})
    assert sign.decode(sign.encode(z)).tolist() == [1.5, 1.5, 1.5, -1.5]


# ---- mpigrad bench codecs ------------------------------------------------------------
def test_bench_codecs_cli(capsys):
    assert cli_main(["bench", "codecs", "--size", "5000", "--repeat", "1", "--twin-size", "3000",
                     "--codecs", "uniform", "sign"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("uniform", "sign"))]
    assert len(rows) == 7 and "np.copyto" in out
    assert "acc ns/el = decode added into a running sum" in out and "dec+add ns/el = the same sum unfused" in out
    sign_bits = float(next(r for r in rows if r.startswith("sign")).split()[2])
    assert sign_bits == pytest.approx(8 * (HEADER_SIZE + 4 + 625) / 5000, abs=1e-3)
    assert cli_main(["bench", "codecs", "--codecs", "nope"]) == 2
    assert "mpigrad bench: error: no benchmarkable codec 'nope'" in capsys.readouterr().err
