"""``mpigrad bench codecs`` times every codec that has a NumPy twin on one float32 vector
(2**24 values by default, one Numba thread): encode and decode ns per element and GB/s
of float32 gradient processed, the ratio to ``np.copyto`` of the same vector measured in
the same run, the speed-up over the codec's NumPy twin, and the bits per element actually
produced (header and scales included). Encode writes into and decode reads into reused
buffers (``out=``), as the runtime does. ``acc ns/el`` times ``decode(buf, out,
accumulate=True)`` (add to a running sum, what the parameter server does for every worker
after the first), ``dec+add ns/el`` the same sum the unfused way: decode into a scratch
array, then ``np.add``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ..errors import UsageError

#: What the table's less obvious columns mean, printed under its header.
COLUMNS_KEY = ("key: enc/dec ns/el = ns per float32 element; x copy = that time over np.copyto's; "
               "acc ns/el = decode added into a running sum (decode(buf, out, accumulate=True), as the "
               "server sums the workers' frames); dec+add ns/el = the same sum unfused (decode into a scratch "
               "array, then np.add); twin enc/dec = speed-up over the codec's NumPy twin")

#: Configurations benchmarked per codec id; a registered codec with a twin and no entry
#: here is benchmarked with its default config. ``"levels": "sqrt"`` means s = sqrt(n).
BENCH_CONFIGS: dict[str, list[dict[str, Any]]] = {
    "fp32": [{}],
    "fp16": [{}],
    "uniform": [{"bits": b} for b in (1, 2, 4, 8)] + [
        {"bits": 4, "bucket_size": 512}, {"bits": 4, "rounding": "stochastic"}],
    "qsgd": [{"bits": b} for b in (2, 4, 8)] + [
        {"bits": 4, "norm": "l2"}, {"bits": 4, "coding": "elias"},
        {"levels": "sqrt", "norm": "l2", "bucket_size": None, "coding": "elias"}],
    "terngrad": [{}],
    "sign": [{}],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=2**24, help="float32 values per vector (default 2**24)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed calls per measurement; the minimum is kept (default 7)")
    parser.add_argument("--twin-size", type=int, default=2**20,
                        help="values for the NumPy-twin comparison, both sides timed on this prefix "
                             "(default 2**20)")
    parser.add_argument("--codecs", nargs="+", default=None, metavar="ID",
                        help="codec ids to run (default: every registered codec with a NumPy twin)")


def run(args: argparse.Namespace) -> int:
    import numba

    from ..codecs import available
    from ..codecs.reference import has_twin

    if args.size < 1 or args.repeat < 1 or args.twin_size < 1:
        raise UsageError("--size, --repeat and --twin-size must be positive")
    known = [c for c in available() if has_twin(c)]
    chosen = known if args.codecs is None else [c for part in args.codecs for c in part.split(",") if c]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise UsageError(f"no benchmarkable codec {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(known)}")
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        _codec_table(args, chosen)
    finally:
        numba.set_num_threads(threads)
    return 0


def _codec_table(args: argparse.Namespace, chosen: list[str]) -> None:
    import numba

    from ..codecs import get_codec
    from ..codecs.reference import twin_of

    n = args.size
    x = (np.random.default_rng(0).standard_normal(n) * 1e-3).astype(np.float32)
    y = np.empty_like(x)
    twin_n = min(args.twin_size, n)
    copy_s = _best(lambda: np.copyto(y, x), args.repeat)
    print(f"mpigrad bench codecs: n = {n} float32 values ({4 * n / 2**20:.0f} MiB), numba threads = "
          f"{numba.get_num_threads()}, best of {args.repeat}; GB/s = 4n bytes of float32 per second")
    print(f"np.copyto: {copy_s * 1e3:.2f} ms = {copy_s * 1e9 / n:.3f} ns/element, "
          f"{4 * n / copy_s / 1e9:.1f} GB/s; x copy = time / copy time; "
          f"twin speed-up measured on the first {twin_n} values")
    columns = ("codec config", "bits/el", "enc ns/el", "enc GB/s", "x copy", "dec ns/el", "dec GB/s",
               "x copy", "acc ns/el", "dec+add ns/el", "twin enc", "twin dec")
    print(_row(columns))
    print(COLUMNS_KEY)
    for codec_id in chosen:
        for raw in BENCH_CONFIGS.get(codec_id, [{}]):
            config = {"id": codec_id, **raw}
            if config.get("levels") == "sqrt":
                config["levels"] = max(1, int(round(n ** 0.5)))
            codec = get_codec(config)
            stats = _measure(codec, twin_of(codec), x, twin_n, args.repeat)
            label = " ".join(f"{k}={v}" for k, v in raw.items()) or "default"
            print(_row((f"{codec_id} {label}", f"{stats['bits']:.3f}",
                        *_speed(stats["enc"], n, copy_s), *_speed(stats["dec"], n, copy_s),
                        f"{stats['acc'] * 1e9 / n:.3f}", f"{stats['dec_add'] * 1e9 / n:.3f}",
                        f"{stats['twin_enc']:.1f}x", f"{stats['twin_dec']:.1f}x")))


def _speed(seconds: float, n: int, copy_seconds: float) -> tuple[str, str, str]:
    """ns per element, GB/s of float32, and the ratio to the copy time."""
    return f"{seconds * 1e9 / n:.3f}", f"{4 * n / seconds / 1e9:.1f}", f"{seconds / copy_seconds:.2f}"


def _measure(codec, twin, x: np.ndarray, twin_n: int, repeat: int) -> dict[str, float]:
    buf = np.empty(codec.max_encoded_size(x.size), np.uint8)
    y = np.empty_like(x)
    encoded = codec.encode(x, out=buf)
    codec.decode(encoded, out=y)
    enc = _best(lambda: codec.encode(x, out=buf), repeat)
    encoded = codec.encode(x, out=buf)
    dec = _best(lambda: codec.decode(encoded, out=y), repeat)
    total = np.zeros_like(x)
    codec.decode(encoded, out=total, accumulate=True)  # sizes a scratch array where one is used
    acc = _best(lambda: codec.decode(encoded, out=total, accumulate=True), repeat)
    dec_add = _best(lambda: np.add(total, codec.decode(encoded, out=y), out=total), repeat)

    head = x[:twin_n]
    small_buf = np.empty(codec.max_encoded_size(twin_n), np.uint8)
    small_y = np.empty(twin_n, np.float32)
    small = codec.encode(head, out=small_buf).copy()
    twin_repeat = min(repeat, 2)
    fast_enc = _best(lambda: codec.encode(head, out=small_buf), repeat)
    fast_dec = _best(lambda: codec.decode(small, out=small_y), repeat)
    slow_enc = _best(lambda: twin.encode(head, out=small_buf), twin_repeat)
    slow_dec = _best(lambda: twin.decode(small, out=small_y), twin_repeat)
    return {"bits": 8 * encoded.size / x.size, "enc": enc, "dec": dec, "acc": acc, "dec_add": dec_add,
            "twin_enc": slow_enc / fast_enc, "twin_dec": slow_dec / fast_dec}


def _best(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _row(cells) -> str:
    widths = (52, 8, 10, 9, 7, 10, 9, 7, 10, 13, 9, 9)
    return "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))
