"""Mutate valid codec buffers and decode them; only CodecError may ever come out.

Run by tests/test_codec_fuzz.py in a subprocess, so a segfault in a kernel fails that
test instead of killing pytest:

    python tests/fuzz_codecs.py --seed 1 --mutations 3000

Each mutated buffer is decoded by the Numba codec and by its NumPy twin. Both must agree:
both raise CodecError, or both return the same finite values. Exit status 0 when every
mutation behaved, 1 (with the offending case printed) otherwise.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter

import numpy as np

from mpigrad.codecs import HEADER_SIZE, CodecError, get_codec, read_header
from mpigrad.codecs.base import _write_header
from mpigrad.codecs.reference import twin_of

CONFIGS = [
    {"id": "uniform", "bits": 3},
    {"id": "uniform", "bits": 8, "bucket_size": 100, "rounding": "stochastic"},
    {"id": "qsgd", "bits": 4, "bucket_size": 64},
    {"id": "qsgd", "levels": 5, "bucket_size": None},
    {"id": "qsgd", "coding": "elias", "bucket_size": 128},
    {"id": "qsgd", "coding": "elias", "norm": "l2", "levels": 90, "bucket_size": None},
    {"id": "terngrad"},
    {"id": "sign", "bucket_size": 50},
    {"id": "qsgd", "bits": 3, "checksum": True},
]
SIZES = (1, 9, 8195)
HEADER_FIELDS = ("bits", "flags", "param_a", "param_b", "n", "payload_len")


def mutate(rng: np.random.Generator, buf: np.ndarray) -> tuple[str, np.ndarray]:
    kind = rng.choice(["flip", "bytes", "truncate", "extend", "header", "header+resize", "scales"])
    out = buf.copy()
    payload = out.size - HEADER_SIZE
    if kind == "flip" and payload:
        for _ in range(rng.integers(1, 5)):
            bit = rng.integers(HEADER_SIZE * 8, out.size * 8)
            out[bit // 8] ^= np.uint8(1 << (bit % 8))
    elif kind == "bytes" and payload:
        where = rng.integers(HEADER_SIZE, out.size, rng.integers(1, 9))
        out[where] = rng.integers(0, 256, where.size, dtype=np.uint8)
    elif kind == "truncate":
        out = out[:rng.integers(0, out.size)].copy()
    elif kind == "extend":
        out = np.concatenate([out, rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8)])
    elif kind in ("header", "header+resize"):
        header = read_header(buf)
        field = HEADER_FIELDS[rng.integers(len(HEADER_FIELDS))]
        old = getattr(header, field)
        limit = 255 if field in ("bits", "flags") else 2**32 - 1
        value = [0, 1, limit, old + 1, old - 1, int(rng.integers(0, limit + 1))][rng.integers(6)]
        value = int(min(max(value, 0), limit))
        if field == "n":
            value = int(min(value, 2**22))  # an Elias buffer of 2**34 zeros is valid and huge
        header = header._replace(**{field: value})
        if kind == "header+resize" and field == "payload_len":
            extra = value - payload
            if -payload <= extra <= 1 << 16:
                out = out[:HEADER_SIZE + value].copy() if extra < 0 else np.concatenate(
                    [out, rng.integers(0, 256, extra, dtype=np.uint8)])
        _write_header(out, header, with_crc=False)
    elif kind == "scales" and payload >= 4:
        at = HEADER_SIZE + 4 * rng.integers(0, min(payload // 4, 8))
        value = rng.choice(np.array([np.nan, np.inf, -np.inf, -1.0, 3e38, 0.0, 1e-45], np.float32))
        out[at:at + 4] = np.frombuffer(value.tobytes(), np.uint8)
    return str(kind), out


def decode_outcome(codec, buf):
    """('ok', values) or ('error', message); any other exception propagates."""
    try:
        return "ok", codec.decode(buf)
    except CodecError as exc:
        return "error", str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mutations", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    valid = []
    for config in CONFIGS:
        for n in SIZES:
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
            x[rng.random(n) < 0.3] = 0
            valid.append((config, get_codec(config).encode(x).copy()))
    tally: Counter[str] = Counter()
    for i in range(args.mutations):
        config, buf = valid[rng.integers(len(valid))]
        kind, bad = mutate(rng, buf)
        codec = get_codec({"id": config["id"]})
        try:
            fast = decode_outcome(codec, bad)
            slow = decode_outcome(twin_of(codec), bad)
        except Exception:
            print(f"mutation {i} ({kind}) of {config}: an exception other than CodecError",
                  file=sys.stderr)
            traceback.print_exc()
            return 1
        if fast[0] != slow[0] or (fast[0] == "ok" and not (
                np.array_equal(fast[1], slow[1]) and np.isfinite(fast[1]).all())):
            print(f"mutation {i} ({kind}) of {config}: kernel {fast[0]}, twin {slow[0]}: "
                  f"{fast[1] if fast[0] == 'error' else slow[1]}", file=sys.stderr)
            return 1
        tally[f"{kind}:{fast[0]}"] += 1
    print(" ".join(f"{k}={v}" for k, v in sorted(tally.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
