"""Mutate valid PowerSGD factor frames (quantized factors and rest) and decode them; only
CodecError or FrameError may come out. Without a payload CRC a frame of uniform buffers that
decodes gives finite values (its ranges are checked; a float payload is taken as it is);
with ``checksum=True`` one that decodes gives the original's values, its pieces in another
order aside (``swap``: the frame names no layer, only lengths).

Run by tests/test_powersgd_quantized.py in a subprocess, so a segfault in a kernel fails
that test instead of killing pytest:

    python tests/fuzz_lowrank.py --seed 1 --mutations 1000

Exit status 0 when every mutation behaved, 1 (with the offending case printed) otherwise;
stdout tallies the outcomes per mutation kind (``truncate:error=12 ...``).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter

import numpy as np

from mpigrad.codecs import CodecError, get_codec
from mpigrad.runtime.wire import FrameError

KINDS = ("flip", "bytes", "truncate", "extend", "lengths", "swap")


def factor_rounds(options: dict):
    """A small paper CNN's LowRank (worker side) and a valid frame of each round."""
    from mpigrad.data import load_dataset
    from mpigrad.models import build_model
    from mpigrad.runtime.exchange.lowrank import LowRank
    from mpigrad.runtime.exchange.replica import Replica

    digits = load_dataset("digits", seed=5)
    codec = get_codec({"id": "powersgd", "rank": 2, **options})
    model = build_model("paper-cnn", input_shape=digits.input_shape, num_classes=digits.num_classes, seed=5,
                        fc_sizes=[64, 64])
    replica = Replica(model, None, __import__("torch").device("cpu"), codec)
    lowrank = LowRank(model, replica.layout, codec, seed=5, worker=True)
    rng = np.random.default_rng(5)
    grad = rng.standard_normal(replica.layout.total).astype(np.float32)
    p = lowrank.first_factors(grad).copy()
    frame1 = lowrank.compressor1.encode(p, [0] * len(lowrank.layers), lowrank.round1).copy()
    q = lowrank.second_factors().copy()
    frame2 = lowrank.compressor2.encode(q, [0] * len(lowrank.layers), lowrank.round2).copy()
    return lowrank, ((frame1, lowrank.compressor1, lowrank.round1, lowrank.p_size),
                     (frame2, lowrank.compressor2, lowrank.round2, lowrank.q_size))


def mutate(rng: np.random.Generator, frame: np.ndarray, pieces: int) -> tuple[str, np.ndarray]:
    kind = str(rng.choice(KINDS))
    out = frame.copy()
    head = 16 + 8 * pieces  # FrameHeader
    if kind == "flip":
        for _ in range(rng.integers(1, 5)):
            bit = rng.integers(0, out.size * 8)
            out[bit // 8] ^= np.uint8(1 << (bit % 8))
    elif kind == "bytes":
        where = rng.integers(0, out.size, rng.integers(1, 9))
        out[where] = rng.integers(0, 256, where.size, dtype=np.uint8)
    elif kind == "truncate":
        out = out[:rng.integers(0, out.size)].copy()
    elif kind == "extend":
        out = np.concatenate([out, rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8)])
    elif kind == "lengths":  # move bytes between two pieces' lengths: the total still adds up
        lengths = out[16:head].view("<u8")
        i, j = rng.integers(0, pieces, 2)
        shift = np.uint64(rng.integers(1, 64))
        if lengths[i] > shift:
            lengths[i] -= shift
            lengths[j] += shift
    elif kind == "swap":  # the pieces' buffers in another order, lengths kept
        lengths = out[16:head].view("<u8").copy()
        starts = np.concatenate([[head], head + np.cumsum(lengths)[:-1]]).astype(np.int64)
        order = rng.permutation(pieces)
        body = np.concatenate([frame[starts[k]:starts[k] + int(lengths[k])] for k in order])
        out = np.concatenate([frame[:16], lengths[order].astype("<u8").view(np.uint8), body])
    return kind, out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mutations", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    tally: Counter[str] = Counter()
    for options in ({"factor_bits": 8, "rest_bits": 8}, {"factor_bits": 3, "rest_bits": 16, "checksum": True}):
        _, rounds = factor_rounds(options)
        originals = []
        for frame, compressor, shard, size in rounds:
            originals.append(np.zeros(size, np.float32))
            compressor.decode(frame, shard, originals[-1])
        for _ in range(args.mutations // 2):
            which = rng.integers(0, 2)
            frame, compressor, shard, size = rounds[which]
            kind, bad = mutate(rng, frame, len(shard.pieces))
            out = np.zeros(size, np.float32)
            try:
                compressor.decode(bad, shard, out)
            except (CodecError, FrameError):
                tally[f"{kind}:error"] += 1
                continue
            except Exception:  # noqa: BLE001 - the finding
                print(f"{options} {kind}: {traceback.format_exc()}", file=sys.stderr)
                return 1
            if options.get("checksum") and kind != "swap" and not np.array_equal(out, originals[which]):
                print(f"{options} {kind}: a corrupt frame passed the CRC", file=sys.stderr)
                return 1
            if not np.isfinite(out).all():
                print(f"{options} {kind}: decoded non-finite values", file=sys.stderr)
                return 1
            tally[f"{kind}:ok"] += 1
    print(" ".join(f"{key}={value}" for key, value in sorted(tally.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
