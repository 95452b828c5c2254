"""Mutate valid mcgq buffers and decode them; only CodecError may ever come out.

Run by tests/test_mcgq.py in a subprocess, so a segfault in a kernel fails that test
instead of killing pytest:

    python tests/fuzz_mcgq.py --seed 1 --mutations 3000

Each mutated buffer is decoded by the Numba codec and by its NumPy twin: both raise
CodecError, or both return the same finite float32 values of the header's length.
Buffers with a payload CRC must always be refused ("checksum" mutations). Prints a
tally ``KIND:OUTCOME=COUNT ...``; exit status 0 when every mutation behaved, 1 (with the
offending case) otherwise.
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

KS = (0.01, 0.1, 1.0, 4.0)
SIZES = (1, 7, 300, 5000)
STREAM = HEADER_SIZE + 4          # first byte of the RLE stream
KINDS = ("flip", "stream-bytes", "truncate", "extend", "widths", "scale", "samples",
         "n", "splice", "checksum")


def mutate(rng: np.random.Generator, buf: np.ndarray, donor: np.ndarray) -> tuple[str, np.ndarray]:
    """One random mutation of ``buf``; header fields are rewritten with a valid header CRC."""
    kind = str(rng.choice(KINDS[:-1]))
    out = buf.copy()
    header = read_header(buf)
    if kind == "flip":
        for _ in range(rng.integers(1, 4)):
            bit = rng.integers(HEADER_SIZE * 8, out.size * 8)
            out[bit // 8] ^= np.uint8(1 << (bit % 8))
    elif kind == "stream-bytes" and out.size > STREAM:
        where = rng.integers(STREAM, out.size, rng.integers(1, 4))
        out[where] = rng.integers(0, 256, where.size, dtype=np.uint8)
    elif kind == "truncate":
        out = out[:rng.integers(0, out.size)].copy()
        if out.size >= HEADER_SIZE:
            _write_header(out, header._replace(payload_len=out.size - HEADER_SIZE), False)
    elif kind == "extend":
        out = np.concatenate([out, rng.integers(0, 256, rng.integers(1, 16), dtype=np.uint8)])
        _write_header(out, header._replace(payload_len=out.size - HEADER_SIZE), False)
    elif kind == "widths":
        field = STREAM + 4 * rng.integers(0, 2)
        value = int(rng.choice([0, 1, 2, 57, 58, 2**32 - 1, rng.integers(0, 64)]))
        out[field:field + 4] = np.frombuffer(value.to_bytes(4, "big"), np.uint8)
        if rng.random() < 0.5 and field == STREAM and value < 256:
            _write_header(out, header._replace(bits=value), False)
    elif kind == "scale":
        value = rng.choice(np.array([np.nan, np.inf, -1.0, -0.0, 0.0, 3.4e38, 1e-45, 7.0], np.float32))
        out[HEADER_SIZE:HEADER_SIZE + 4] = np.frombuffer(value.tobytes(), np.uint8)
    elif kind == "samples":
        n_samples = header.param_a | header.param_b << 32
        value = int(rng.choice([0, 1, n_samples - 1, n_samples + 1, 2**32, rng.integers(0, 2**40)]))
        value = max(value, 0)
        _write_header(out, header._replace(param_a=value & 0xFFFFFFFF, param_b=value >> 32), False)
    elif kind == "n":
        value = int(rng.choice([0, 1, header.n - 1, header.n + 1, 2 * header.n, rng.integers(0, 20000)]))
        _write_header(out, header._replace(n=max(value, 0)), False)
    elif kind == "splice":
        out = np.concatenate([buf[:STREAM], donor[STREAM:]])
        _write_header(out, header._replace(payload_len=out.size - HEADER_SIZE), False)
    return kind, out


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
    valid, checked = [], []
    for K in KS:
        for n in SIZES:
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
            x[rng.random(n) < 0.3] = 0
            seed = int(rng.integers(1 << 30))
            valid.append(get_codec({"id": "mcgq", "K": K, "seed": seed}).encode(x).copy())
            checked.append(get_codec({"id": "mcgq", "K": K, "checksum": True}).encode(x).copy())
    codec = get_codec({"id": "mcgq"})
    reference = twin_of(codec)
    tally: Counter[str] = Counter()
    for i in range(args.mutations):
        if i % 8 == 7:
            kind = "checksum"
            buf = checked[rng.integers(len(checked))].copy()
            for _ in range(rng.integers(1, 4)):
                bit = rng.integers(HEADER_SIZE * 8, buf.size * 8)
                buf[bit // 8] ^= np.uint8(1 << (bit % 8))
        else:
            kind, buf = mutate(rng, valid[rng.integers(len(valid))], valid[rng.integers(len(valid))])
        try:
            fast = decode_outcome(codec, buf)
            slow = decode_outcome(reference, buf)
        except Exception:
            print(f"mutation {i} ({kind}): an exception other than CodecError", file=sys.stderr)
            traceback.print_exc()
            return 1
        agree = fast[0] == slow[0] and (fast[0] == "error" or (
            np.array_equal(fast[1], slow[1]) and np.isfinite(fast[1]).all()
            and fast[1].dtype == np.float32 and fast[1].size == read_header(buf).n))
        if not agree or (kind == "checksum" and fast[0] == "ok"):
            print(f"mutation {i} ({kind}): kernel {fast[0]}, twin {slow[0]}: "
                  f"{fast[1] if fast[0] == 'error' else slow[1]}", file=sys.stderr)
            return 1
        tally[f"{kind}:{fast[0]}"] += 1
    print(" ".join(f"{k}={v}" for k, v in sorted(tally.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
