"""``mpigrad bench calibrate``: measure the cost model of local work on this machine.

Times, for every codec at every width it takes (its fixed width when a policy cannot set
it), ``encode`` into a reused buffer, ``decode`` into a reused array and ``accumulate``
(decode-add into a running sum, what a server does for every worker after the first), and
the codec-free work: the server's in-place average (``np.multiply``) and the error-feedback
memory's compensate + update. Each is timed on vectors of several element counts in
process CPU time on one Numba thread (as a rank of a run on one thread), the median of
``--repeat`` measurements of enough calls to take about a millisecond. Each built-in bit
policy's decision (default options, the uniform codec, the elements in two layers) is
averaged over 100 iterations after 100 unmeasured ones, so that its periodic work counts
as in a run (median of up to 3). The model goes through the measured points
(:class:`mpigrad.costmodel.Cost`); ``seconds = a + b * elements`` is also fitted per entry
(:func:`mpigrad.costmodel.fit_linear`), with its largest relative residual. The JSON it
writes (``-o``) carries the machine's fingerprint (:func:`mpigrad.machine.fingerprint`)
and the sizes; ``mpigrad train --compute-time X --cost-model FILE`` charges it. The
package's default, ``mpigrad/cost_model.json``, was written by this command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..costmodel import CODEC_OPERATIONS, FORMAT, VERSION, CostModel, fit_linear
from ..errors import UsageError
from ..options import check_overwrite

DEFAULT_SIZES = (1024, 16384, 262144, 1048576, 4194304)
#: Each timed measurement repeats the call until it has taken about this much CPU time.
MEASURE_SECONDS = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="the cost model to write (JSON), for mpigrad train --cost-model FILE")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), metavar="N,N,...",
                        help=f"element counts timed (at least two different; default {','.join(map(str, DEFAULT_SIZES))})")
    parser.add_argument("--repeat", type=int, default=5,
                        help="measurements per size; the median is kept (default 5)")
    parser.add_argument("--codecs", nargs="+", default=None, metavar="ID",
                        help="codec ids to calibrate (default every registered codec; fp32 always)")
    parser.add_argument("--policies", nargs="+", default=None, metavar="ID",
                        help="bit policies to calibrate (default every built-in policy; none: no policy)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--sizes {text!r}: expected element counts such as 1024,65536,1048576") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise UsageError(f"--sizes {text!r}: give at least two different positive element counts")
    return sizes


def run(args: argparse.Namespace) -> int:
    import numba

    from ..codecs import available, codec_class

    sizes = parse_sizes(args.sizes)
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    output = Path(args.output)
    check_overwrite([output], args.force, error=UsageError)
    if output.parent and not output.parent.is_dir():
        raise UsageError(f"{output.parent}, where the cost model should go, is not a directory")
    known = [c for c in available() if not codec_class(c).two_rounds]  # powersgd's matmuls: not modelled
    chosen = known if args.codecs is None else [c for part in args.codecs for c in part.split(",") if c]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise UsageError(f"no codec {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    chosen = ["fp32"] + [c for c in dict.fromkeys(chosen) if c != "fp32"]
    from ..policies import available as policies

    named = policies() if args.policies is None else [p for part in args.policies for p in part.split(",") if p]
    named = [] if named == ["none"] else list(dict.fromkeys(named))
    unknown = sorted(set(named) - set(policies()))
    if unknown:
        raise UsageError(f"no built-in policy {', '.join(map(repr, unknown))}; choose from {', '.join(policies())} "
                         "or none")
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    started = time.perf_counter()
    try:
        document = calibrate(chosen, sizes, args.repeat, log=print, policies=named)
    finally:
        numba.set_num_threads(threads)
    CostModel.from_dict(document, source=str(output))  # what train reads back
    output.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {output}: {sum(len(w) for w in document['codecs'].values())} codec widths, "
          f"{len(sizes)} sizes, {time.perf_counter() - started:.1f} s")
    return 0


def calibrate(codec_ids: list[str], sizes: list[int], repeat: int, log: Callable[[str], None] = print,
              policies: list[str] = ()) -> dict:
    """The cost-model document (see the module docstring) for ``codec_ids`` and ``policies``
    at ``sizes``."""
    from ..codecs import get_codec
    from ..feedback import ErrorFeedback
    from ..machine import fingerprint
    from ..trace import collect_versions

    rng = np.random.default_rng(0)
    vectors = {n: (rng.standard_normal(n) * 1e-3).astype(np.float32) for n in sizes}
    log(f"mpigrad bench calibrate: sizes {', '.join(map(str, sizes))}; process CPU time, one Numba thread, "
        f"median of {repeat}; seconds = a + b * elements")
    log(f"{'codec':<10} {'bits':>4}  {'operation':<20} {'a us':>9} {'b ns/el':>9} {'max resid':>9}")
    codecs: dict[str, dict[str, dict]] = {}
    for codec_id in codec_ids:
        for bits, codec in _widths(get_codec({"id": codec_id})):
            times = {op: [] for op in CODEC_OPERATIONS}
            for n in sizes:
                x = vectors[n]
                buf = np.empty(codec.max_encoded_size(n), np.uint8)
                y = np.empty(n, np.float32)
                total = np.zeros(n, np.float32)
                encoded = codec.encode(x, out=buf)
                codec.decode(encoded, out=y)
                codec.decode(encoded, out=total, accumulate=True)  # compiles, sizes scratch arrays
                times["encode"].append(_median_seconds(lambda: codec.encode(x, out=buf), repeat))
                encoded = codec.encode(x, out=buf)
                times["decode"].append(_median_seconds(lambda: codec.decode(encoded, out=y), repeat))
                times["accumulate"].append(_median_seconds(
                    lambda: codec.decode(encoded, out=total, accumulate=True), repeat))
            codecs.setdefault(codec_id, {})[str(bits)] = {
                op: _fit(sizes, times[op], log, f"{codec_id:<10} {bits:>4}  {op:<20}") for op in CODEC_OPERATIONS}
    operations = {}
    times = []
    for n in sizes:
        part = vectors[n].copy()
        scale = np.float32(1.0 / 3)
        times.append(_median_seconds(lambda: np.multiply(part, scale, out=part), repeat))
    operations["average"] = _fit(sizes, times, log, f"{'-':<10} {'-':>4}  {'average':<20}")
    for mode in ("residual", "accumulate"):
        times = []
        for n in sizes:
            memory, g = ErrorFeedback(mode), vectors[n]
            decoded = np.where(np.arange(n) % 3 == 0, g, np.float32(0))  # what a codec delivered
            memory.update("x", memory.compensate("x", g), decoded)

            def step(memory=memory, g=g, decoded=decoded):
                memory.update("x", memory.compensate("x", g), decoded)
            times.append(_median_seconds(step, repeat))
        operations[f"feedback:{mode}"] = _fit(sizes, times, log, f"{'-':<10} {'-':>4}  {'feedback:' + mode:<20}")
    fitted_policies = {}
    for policy_id in policies:
        times = [statistics.median(_policy_seconds(policy_id, vectors[n]) for _ in range(min(repeat, 3)))
                 for n in sizes]
        fitted_policies[policy_id] = _fit(sizes, times, log, f"{'-':<10} {'-':>4}  {'policy:' + policy_id:<20}")
        fitted_policies[policy_id]["iterations"] = POLICY_ITERATIONS
    return {"format": FORMAT, "version": VERSION, "policies": fitted_policies,
            "machine": fingerprint(collect_versions()),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "clock": f"process CPU time, one Numba thread, median of {repeat}",
            "command": "mpigrad bench calibrate " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "calibrate"]
            else "mpigrad bench calibrate",
            "sizes": list(sizes), "codecs": codecs, "operations": operations}


#: A policy is timed over this many decisions after as many unmeasured ones: every built-in
#: policy's periodic work (L-GreCo's default interval is 50) is then in the mean.
POLICY_ITERATIONS = 100
#: Options a policy cannot do without, for calibration.
POLICY_OPTIONS = {"schedule": {"schedule": "0:2,50:4"}}


def _policy_seconds(policy_id: str, x: np.ndarray) -> float:
    """Mean process CPU seconds of one ``decide`` of ``policy_id`` (default options, the
    uniform codec) over POLICY_ITERATIONS iterations, the vector split into two layers as
    the paper CNN's two FC layers."""
    from ..codecs import get_codec
    from ..policies import Observation, get_policy

    half = x.size // 2
    layers = (x[:half], x[half:])
    policy = get_policy({"id": policy_id, **POLICY_OPTIONS.get(policy_id, {})}, n_layers=2, seed=0)
    codec = get_codec({"id": "uniform", "bits": 2})
    total = 0.0
    for m in range(2 * POLICY_ITERATIONS):
        observation = Observation(iteration=m, loss=2.0 / (1 + 0.01 * m), last_iteration_ms=400.0,
                                  gradients=layers if m else (), codec=codec,
                                  last_comm_ms=200.0 if m else 0.0, last_bytes=x.size // 4 if m else 0)
        start = time.process_time()
        policy.decide(observation)
        if m >= POLICY_ITERATIONS:
            total += time.process_time() - start
    return max(total / POLICY_ITERATIONS, 1e-9)


def _widths(codec) -> list[tuple[int, object]]:
    """(bits, codec) for every width a policy can give ``codec``, or its fixed width."""
    if not codec.takes_policy_bits:
        return [(codec.fixed_bits, codec)]
    widths = []
    for bits in range(1, 33):
        try:
            widths.append((bits, codec.with_bits(bits)))
        except ValueError:
            continue
    return widths


def _fit(sizes: list[int], times: list[float], log, label: str) -> dict:
    a, b = fit_linear(sizes, times)
    residual = max(abs(a + b * n - t) / t for n, t in zip(sizes, times))
    log(f"{label} {a * 1e6:>9.2f} {b * 1e9:>9.3f} {residual:>9.1%}")
    return {"a": a, "b": b, "max_relative_residual": round(residual, 4),
            "measured": [[n, t] for n, t in zip(sizes, times)]}


def _median_seconds(call: Callable[[], object], repeat: int) -> float:
    """Median over ``repeat`` measurements of the process CPU seconds of one ``call``, each
    measurement timing enough calls to take about MEASURE_SECONDS."""
    start = time.process_time()
    call()
    once = time.process_time() - start
    loops = max(1, min(1000, int(MEASURE_SECONDS / once) if once > 0 else 1000))
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(loops):
            call()
        samples.append((time.process_time() - start) / loops)
    return max(statistics.median(samples), 1e-9)
