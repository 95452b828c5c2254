"""The map over bandwidths and the congestion runs (mpigrad issue 25, items 2 and 3).

    python examples/map/run.py --out runs/map --part bandwidths    # every run, then the map
    python examples/map/run.py --out runs/map --part congestion    # needs the bandwidths part
    python examples/map/run.py --out runs/map --part bandwidths --list     # the plan and its wall time
    python examples/map/run.py --out runs/map --part bandwidths --report   # only the tables and figure
    python examples/map/run.py --out runs/map --smoke              # a tiny version of both parts
    python examples/map/run.py --setup hard --out runs/map-hard --part bandwidths   # examples/hard's task

The task is that of examples/compare (digits, paper CNN with fc [1024, 2048], 1 server + 2
workers, 400 iterations, 50 ms of compute charged per iteration, the default cost model), or
with ``--setup hard`` that of examples/hard (the teacher data, ResNet-20 with every
convolution quantized, 500 iterations; the same methods from examples/hard's configs, rates
0.05-0.2, target 1.3): SETUPS.

Part ``bandwidths``: every method at every rate of LRS and seed of SEEDS, at every bandwidth
of BANDWIDTHS. A method whose runs ``trace retime`` can re-charge (``retime_refusal``: a
policy that does not read the clock, a one-round codec) trains once per (rate, seed), at the
configs' 10 MB/s, into OUT/base/, and is re-timed to each bandwidth; the others (MQGrad and
``aimd`` and ``progress`` read the clock; low rank's two rounds cannot be re-timed) run at
each bandwidth. torch DDP (fp32, fp16 hook, PowerSGD r1 and
r2) trains once per rate under ``mpigrad bench peers`` (loopback, seeds of SEEDS) into
OUT/peers/lrR/, and is modelled on each bandwidth by mpigrad/analysis/peers.py (its real
losses, a modelled clock). Traces: OUT/bandwidths/<bandwidth>/<method>-lr<R>-s<S>.h5. Report:
OUT/map.{txt,md,csv} (each method at its best rate per bandwidth: time to the target, its
ratio to FP32 paired by seed with a 95 % interval, its ratio to the best DDP variant),
OUT/map.png (the ratio to FP32 against bandwidth, log axes, a band per method) and
OUT/crossovers.{txt,md} (below which bandwidth each method beats FP32 and DDP, and where no
method does), all computed by mpigrad.analysis.maps.

Part ``congestion``: the bandwidth alternating between 10 MB/s and 1 GB/s, in fixed stretches
and as the two-state random process (drawn from each run's seed), CONGESTION; every method at
its best rate at 10 MB/s in the bandwidths part; re-timed where it can be, run otherwise, DDP
modelled. Report: OUT/congestion.{txt,md,csv}: per schedule and method, time to the target and
its ratio to the best fixed width, paired by seed, with a 95 % interval.

Each step writes one trace; a complete one is skipped (rerun the same command after an
interruption), an incomplete one is run again. ``--task N`` prints step N of the plan for a
job array (examples/map/array.sbatch), nothing once it is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPARE = HERE.parent / "compare"
RANKS = 3
#: method -> its config; the order of the tables and the figure.
CONFIGS = {
    "fp32": COMPARE / "fp32.toml", "fp16": COMPARE / "fp16.toml", "fix2": COMPARE / "fix2.toml",
    "fix4": COMPARE / "fix4.toml", "fix8": COMPARE / "fix8.toml", "lowrank": COMPARE / "lowrank.toml",
    "mqgrad": COMPARE / "mqgrad.toml", "adaptive": COMPARE / "adaptive.toml",
    "accordion": COMPARE / "accordion.toml", "lgreco": COMPARE / "lgreco.toml", "aimd": HERE / "aimd.toml",
    "progress": COMPARE / "progress.toml",   # mpigrad's own controller (issue 25 item 6)
}
LRS = (0.01, 0.02, 0.04)
SEEDS = (1, 2, 3)
BASE_BANDWIDTH = "10MB/s"              # the configs' bandwidth: the base runs of re-timed methods
BANDWIDTHS = ("1MB/s", "10MB/s", "100MB/s", "1000MB/s", "10GB/s")
CONGESTION = {"stretches": "10MB/s@0s,1GB/s@60s,repeat@120s",
              "markov": "markov:10MB/s,1GB/s,dwell=30s,30s"}
#: DDP variants of `mpigrad bench peers`; PowerSGD from iteration 2 (torch's least with error
#: feedback; mpigrad's low rank starts at 0).
DDP_VARIANTS = "fp32,fp16,powersgd1,powersgd2"
DDP_POWERSGD_START = 2
TARGET_LOSS = 2.5
SMOOTH = 20
ITERATIONS = 400
SMOKE = dict(methods=("fp32", "fix2"), seeds=(1,), bandwidths=("10MB/s", "1000MB/s"),
             iterations=12, smooth=1, peers=False, congestion={"stretches": "10MB/s@0s,1GB/s@1s,repeat@2s"})


@dataclass(frozen=True)
class Setup:
    """A task the map runs on: a config per method (the same task, differing in codec and
    policy), the rate grid, the target (trailing mean of ``smooth`` iterations), and the
    smoke's rate and target (reached in its 12 iterations)."""

    configs: dict
    lrs: tuple
    target_loss: float
    smooth: int
    smoke_lr: float
    smoke_target_loss: float


HARD = HERE.parent / "hard"
#: ``--setup``: examples/compare's digits (the default), or examples/hard's teacher task
#: (ResNet-20, every convolution quantized, 500 iterations: issue 25 item 4; its target 1.3 is
#: the early one of docs/results.rst, "A task where bits matter", which float32 reaches
#: after 170-260 iterations).
SETUPS = {
    "digits": Setup(CONFIGS, LRS, TARGET_LOSS, SMOOTH, smoke_lr=0.02, smoke_target_loss=4.34),
    "hard": Setup({method: HARD / path.name for method, path in CONFIGS.items()}, (0.05, 0.1, 0.2), 1.3, SMOOTH,
                  smoke_lr=0.1, smoke_target_loss=4.0),
}
#: Wall seconds assumed per step when OUT has no measured ones (a shared 2-core machine:
#: examples/compare/README.md, about 35 s per 400-iteration run of which ~13 s start-up).
DEFAULT_TIMES = {"startup": 13.0, "per_iteration": 0.055, "retime": 1.5, "peers_per_run_iteration": 0.08}


@dataclass(frozen=True)
class Step:
    """One trace to make: ``kind`` "train" (mpiexec, ``bandwidth`` None: the config's),
    "retime" (from ``source``) or "peers" (a bench peers run, ``trace`` its peers.json)."""

    kind: str
    method: str
    config: Path        # the method's config (a peers step: FP32's, whose task DDP trains)
    lr: float
    seed: int | None
    trace: Path
    bandwidth: str | None = None
    source: Path | None = None

    def line(self) -> str:
        """The step as 'KIND CONFIG SEED LR TRACE BANDWIDTH SOURCE' (- for none): --task's output."""
        return " ".join(str(x) for x in (self.kind, self.config, self.seed if self.seed is not None else "-",
                                         f"{self.lr:g}", self.trace, self.bandwidth or "-", self.source or "-"))


@dataclass
class Settings:
    configs: dict = field(default_factory=lambda: dict(CONFIGS))
    methods: tuple = tuple(CONFIGS)
    lrs: tuple = LRS
    seeds: tuple = SEEDS
    bandwidths: tuple = BANDWIDTHS
    congestion: dict = field(default_factory=lambda: dict(CONGESTION))
    iterations: int = ITERATIONS
    target_loss: float = TARGET_LOSS
    smooth: int = SMOOTH
    peers: bool = True


def settings_for(setup: str, smoke: bool = False) -> Settings:
    """The whole plan of ``setup`` (a key of SETUPS), or its smoke: run lengths from its FP32
    config (every config of a setup runs as long)."""
    chosen = SETUPS[setup]
    s = Settings(configs=dict(chosen.configs), lrs=chosen.lrs, target_loss=chosen.target_loss, smooth=chosen.smooth,
                 iterations=_config(chosen.configs["fp32"]).iterations)
    if smoke:
        s = Settings(configs=dict(chosen.configs), lrs=(chosen.smoke_lr,), target_loss=chosen.smoke_target_loss,
                     **SMOKE)
    return s


def tag(bandwidth: str) -> str:
    """A folder name for a bandwidth: '10MB/s' -> '10MBps'."""
    return bandwidth.replace("/", "p")


def available(config: Path) -> bool:
    """A method is planned when its config exists and its policy is known to the package."""
    from mpigrad.policies import PolicyError, policy_class

    if not config.exists():
        return False
    try:
        policy_class(_config(config).policy)
    except PolicyError:
        return False
    return True


def _config(config: Path):
    from mpigrad.config import RunConfig

    return RunConfig.from_sources(str(config), {})


def retimable(config: Path) -> bool:
    """True when a run of this config can be re-timed to another network (``retime_refusal``)."""
    from mpigrad.analysis.retime import retime_refusal

    return retime_refusal(_config(config).to_dict()) is None


def trace_name(method: str, lr: float, seed: int) -> str:
    return f"{method}-lr{lr:g}-s{seed}.h5"


def _network_steps(out: Path, method: str, config: Path, lr: float, seed: int,
                   networks: dict[str, str]) -> list[Step]:
    """The steps that give ``method`` a trace on each network (folder -> bandwidth)."""
    steps = []
    name = trace_name(method, lr, seed)
    if retimable(config):
        base = out / "base" / name
        steps.append(Step("train", method, config, lr, seed, base))
        steps += [Step("retime", method, config, lr, seed, out / folder / name, bandwidth, base)
                  for folder, bandwidth in networks.items()]
    else:
        steps += [Step("train", method, config, lr, seed, out / folder / name, bandwidth)
                  for folder, bandwidth in networks.items()]
    return steps


def plan_bandwidths(out: Path, s: Settings) -> list[Step]:
    """Seed-major: an interrupted map has whole seeds of every method."""
    networks = {f"bandwidths/{tag(b)}": b for b in s.bandwidths}
    steps = []
    for seed in s.seeds:
        for method in (m for m in s.methods if available(s.configs[m])):
            for lr in s.lrs:
                steps += _network_steps(out, method, s.configs[method], lr, seed, networks)
    if s.peers:
        steps += [Step("peers", "ddp", s.configs["fp32"], lr, None, out / "peers" / f"lr{lr:g}" / "peers.json")
                  for lr in s.lrs]
    return steps


def best_rates(out: Path, s: Settings) -> dict[str, float]:
    """Method -> its best rate at BASE_BANDWIDTH in the bandwidths part (from its traces);
    SystemExit (exit 2) when that part has none."""
    from mpigrad.analysis.maps import map_cells

    rows = {}
    folder = out / "bandwidths" / tag(BASE_BANDWIDTH if BASE_BANDWIDTH in s.bandwidths else s.bandwidths[0])
    traces = _load_all(sorted(folder.glob("*.h5")))
    for method in s.methods:
        mine = [t for t in traces if t.path.name.startswith(f"{method}-lr")]
        cells = map_cells(mine, s.target_loss, s.smooth) if mine else []
        if cells and cells[0].best_lr() is not None:
            rows[method] = cells[0].best_lr()
    if not rows:
        print(f"run.py: no complete bandwidths part in {out} to take the best rates from; "
              "run --part bandwidths first", file=sys.stderr)
        raise SystemExit(2)
    return rows


def plan_congestion(out: Path, s: Settings) -> list[Step]:
    rates = best_rates(out, s)
    networks = {f"congestion/{name}": schedule for name, schedule in s.congestion.items()}
    steps = []
    for seed in s.seeds:
        for method in (m for m in s.methods if available(s.configs[m]) and m in rates):
            steps += [st for st in _network_steps(out, method, s.configs[method], rates[method], seed, networks)
                      if not (st.kind == "train" and st.bandwidth is None)]   # the base runs exist
    return steps


def plan(out: Path, part: str, s: Settings) -> list[Step]:
    return plan_bandwidths(out, s) if part == "bandwidths" else plan_congestion(out, s)


def done(step: Step, iterations: int = ITERATIONS) -> bool:
    """A step is done when its trace is complete and ran ``iterations`` (so a smoke's short
    traces in the same OUT are run again, not taken); a peers step when its peers.json
    exists for that many iterations."""
    if not step.trace.exists():
        return False
    if step.kind == "peers":
        try:
            return json.loads(step.trace.read_text())["config"]["iterations"] == iterations
        except (OSError, ValueError, KeyError, TypeError):
            return False
    from mpigrad.trace import TraceError, read_raw

    try:
        attrs = read_raw(step.trace).attrs
    except TraceError:
        return False
    config = attrs.get("config") if isinstance(attrs.get("config"), dict) else {}
    return str(attrs.get("status", "running")) == "complete" and config.get("iterations") == iterations


def command(step: Step, s: Settings) -> list[str]:
    from mpigrad.mpiexec import mpiexec_command

    if step.kind == "train":
        extra = [] if step.bandwidth is None else ["--bandwidth", step.bandwidth]
        if s.iterations != _config(step.config).iterations:
            extra += ["--iterations", str(s.iterations), "--eval-every", "0"]
        return mpiexec_command(RANKS, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train", "--config",
                                       str(step.config), "--seed", str(step.seed), "--lr", f"{step.lr:g}",
                                       "--trace", str(step.trace), "--force", "--progress-every", "0", *extra])
    if step.kind == "retime":
        return [sys.executable, "-m", "mpigrad", "trace", "retime", str(step.source), "--bandwidth",
                step.bandwidth, "-o", str(step.trace), "--force"]
    seeds = ",".join(map(str, s.seeds))
    return [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(step.config), "--no-mpigrad",
            "--variants", DDP_VARIANTS, "--powersgd-start", str(DDP_POWERSGD_START), "--seeds", seeds,
            "--iterations", str(s.iterations), "--target-loss", f"{s.target_loss:g}", "--smooth", str(s.smooth),
            "--out", str(step.trace.parent), "--", "--lr", f"{step.lr:g}"]


def run_steps(steps: list[Step], out: Path, s: Settings, log=print) -> int:
    """Run every step that is not done; return how many failed. Each step's wall time goes
    to OUT/timings.json (what --list estimates from)."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env.setdefault(name, "1")
    failed = 0
    for k, step in enumerate(steps, 1):
        where = f"[{k}/{len(steps)}] {step.trace.relative_to(out)}"
        if done(step, s.iterations):
            log(f"{where}: complete, skipped")
            continue
        if step.kind == "retime" and not done(Step("train", step.method, step.config, step.lr, step.seed,
                                                   step.source), s.iterations):
            failed += 1
            log(f"{where}: not re-timed: its run {step.source.name} is not complete")
            continue
        step.trace.parent.mkdir(parents=True, exist_ok=True)
        log(f"{where}: {step.kind}")
        started = time.perf_counter()
        result = subprocess.run(command(step, s), env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            failed += 1
            last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
            log(f"{where}: failed (exit {result.returncode}): {last}")
            continue
        record_timing(out, step, seconds, s)
    return failed


def record_timing(out: Path, step: Step, seconds: float, s: Settings) -> None:
    path = out / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else []
    entry = {"kind": step.kind, "method": step.method, "seconds": round(seconds, 3), "iterations": s.iterations,
             "load": round(os.getloadavg()[0], 2)}
    if step.kind == "train":   # the trace's own wall time splits start-up from the iterations
        from mpigrad.trace import load

        wall = load(step.trace).steps["wall_time"].to_numpy(float)
        # the first two iterations (compilation, first touches) count as start-up
        entry["train_seconds"] = float(wall[-1] - wall[1]) * len(wall) / (len(wall) - 2) if len(wall) > 2 else None
    if step.kind == "peers":
        entry["runs"] = len(s.seeds) * len(DDP_VARIANTS.split(","))
    timings.append(entry)
    path.write_text(json.dumps(timings, indent=1))


def estimate(steps: list[Step], out: Path, s: Settings) -> tuple[float, str]:
    """Wall seconds the steps not yet done would take at ``s.iterations`` per run, from
    OUT/timings.json where it has measured steps (a smoke's), else DEFAULT_TIMES."""
    path = out / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else []
    figures, source = dict(DEFAULT_TIMES), "assumed figures (no measured steps in OUT/timings.json)"
    trains = [t for t in timings if t["kind"] == "train" and t.get("train_seconds") is not None]
    retimes = [t for t in timings if t["kind"] == "retime"]
    if trains:
        figures["startup"] = sum(t["seconds"] - t["train_seconds"] for t in trains) / len(trains)
        figures["per_iteration"] = sum(t["train_seconds"] / t["iterations"] for t in trains) / len(trains)
        source = f"{len(trains)} measured runs in {path}"
    if retimes:
        figures["retime"] = sum(t["seconds"] for t in retimes) / len(retimes)
    peers = [t for t in timings if t["kind"] == "peers" and t.get("runs")]
    if peers:
        figures["peers_per_run_iteration"] = sum(t["seconds"] / (t["runs"] * t["iterations"]) for t in peers) / len(peers)
    left = [st for st in steps if not done(st, s.iterations)]
    runs = sum(1 for st in left if st.kind == "train")
    total = (runs * (figures["startup"] + s.iterations * figures["per_iteration"])
             + sum(1 for st in left if st.kind == "retime") * figures["retime"]
             + sum(1 for st in left if st.kind == "peers") * len(s.seeds) * len(DDP_VARIANTS.split(","))
             * s.iterations * figures["peers_per_run_iteration"])
    text = (f"{len(left)} of {len(steps)} steps to do ({runs} runs, "
            f"{sum(1 for st in left if st.kind == 'retime')} re-timings, "
            f"{sum(1 for st in left if st.kind == 'peers')} bench peers runs): about {total / 3600:.1f} h of wall "
            f"time at {s.iterations} iterations per run on a 2-core machine (start-up {figures['startup']:.1f} s + "
            f"{figures['per_iteration'] * 1000:.0f} ms per iteration per run, {figures['retime']:.1f} s per "
            f"re-timing; from {source})")
    return total, text


def _load_all(paths):
    from mpigrad.trace import TraceError, load

    traces = []
    for path in paths:
        try:
            traces.append(load(path))
        except TraceError as exc:
            print(f"report: left out {path}: {exc}", file=sys.stderr)
    return traces


def _peer_traces(out: Path, lrs) -> list:
    from mpigrad.analysis.peers import load_peer_runs

    traces = []
    for lr in lrs:
        path = out / "peers" / f"lr{lr:g}" / "peers.json"
        if path.exists():
            traces += load_peer_runs(path)
    return traces


def _networked(out: Path, folders: dict[str, str], s: Settings) -> list:
    """The traces of each folder, and DDP's runs modelled on each folder's network."""
    from mpigrad.analysis.peers import model_peers_at

    traces = []
    peers = _peer_traces(out, s.lrs) if s.peers else []
    for folder, network in folders.items():
        mine = _load_all(sorted((out / folder).glob("*.h5")))
        traces += mine
        if peers and mine:
            compute = mine[0].config.get("compute_time")
            latency = mine[0].config.get("latency")
            traces += model_peers_at(peers, [{"bandwidth": network_value(network), "latency": latency,
                                               "compute_time": compute}])
    return traces


def network_value(text: str):
    """A bandwidth as a config keeps it: a rate in bytes/s, a schedule as its text."""
    from mpigrad.units import parse_bandwidth

    return parse_bandwidth(text)


def _write(out: Path, name: str, rows, columns, notes: str = "") -> str:
    from mpigrad.analysis import render

    for fmt, suffix in (("text", "txt"), ("markdown", "md"), ("csv", "csv")):
        (out / f"{name}.{suffix}").write_text(render(rows, columns, fmt) + (notes if fmt != "csv" else ""))
    return render(rows, columns, "text") + notes


def report_bandwidths(out: Path, s: Settings, log=print, dest: Path | None = None) -> None:
    """The map's tables, crossovers and figure from OUT's traces, written into DEST (default OUT)."""
    from mpigrad.analysis.maps import (crossovers, map_cells, map_columns, map_pivot, map_rows, none_beats,
                                       plot_map)
    from mpigrad.units import format_network_value

    traces = _networked(out, {f"bandwidths/{tag(b)}": b for b in s.bandwidths}, s)
    if not traces:
        raise SystemExit("run.py: no traces to report on")
    to = dest or out
    rows = sorted(map_rows(map_cells(traces, s.target_loss, s.smooth)),
                  key=lambda r: (r["ddp"], r["method"] != "FP32", r["method"], r["bandwidth"] or 0.0))
    log(_write(to, "map", rows, map_columns(s.target_loss)))
    for value, name in (("vs_fp32", "map-vs-fp32"), ("vs_best_fixed", "map-vs-best-fixed")):
        _write(to, name, *map_pivot(rows, value))
    lines = [entry[key] for entry in crossovers(rows) for key in ("vs_fp32_text", "vs_ddp_text") if key in entry]
    nobody = none_beats(rows)
    lines.append(f"no method beats FP32 at {', '.join(format_network_value(b) for b in nobody)}" if nobody
                 else "at every bandwidth of the map some method beats FP32")
    text = "\n".join(f"- {line}" for line in lines) + "\n"
    for suffix in ("txt", "md"):
        (to / f"crossovers.{suffix}").write_text(text)
    log(text)
    try:
        plot_map(rows, to / "map.png", title=f"Time to loss {s.target_loss:g} relative to FP32")
    except Exception as exc:  # noqa: BLE001  the tables stand without the figure
        log(f"report: no figure: {exc}")
    log(f"wrote {to}/map.*, {to}/crossovers.*")


def report_congestion(out: Path, s: Settings, log=print, dest: Path | None = None) -> None:
    """The congestion table from OUT's traces, written into DEST (default OUT)."""
    from mpigrad.analysis.labels import flat_config
    from mpigrad.analysis.maps import congestion_columns, congestion_rows, map_cells, method_of

    traces = _networked(out, {f"congestion/{name}": sched for name, sched in s.congestion.items()}, s)
    if not traces:
        raise SystemExit("run.py: no congestion traces to report on")
    rows = congestion_rows(map_cells(traces, s.target_loss, s.smooth))
    policies = {method_of(t): flat_config(t.config).get("policy", flat_config(t.config).get("policy.id")) for t in traces}
    moving = {method for method, policy in policies.items() if policy not in (None, "fixed")}
    winners = sorted({r["method"] for r in rows if r["beats"] == "yes" and r["kind"] not in ("fixed", "fp32")})
    note = ("\n* policies (moving bits) whose 95 % interval of the ratio to the best fixed width lies below 1: "
            + (", ".join(w for w in winners if w in moving) or "none")
            + "\n* baselines (fp16, low rank, DDP) whose interval lies below 1: "
            + (", ".join(w for w in winners if w not in moving) or "none") + "\n")
    log(_write(dest or out, "congestion", rows, congestion_columns(s.target_loss), note))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for traces and the report")
    parser.add_argument("--setup", choices=tuple(SETUPS), default="digits",
                        help="the task: digits (examples/compare's, default) or hard (examples/hard's teacher "
                             "task, ResNet-20; give it an OUT of its own)")
    parser.add_argument("--part", choices=("bandwidths", "congestion"), help="which part (--smoke: both)")
    parser.add_argument("--smoke", action="store_true", help="a tiny version of both parts (checks the pipeline)")
    parser.add_argument("--list", action="store_true", help="print the plan and its estimated wall time, then exit")
    parser.add_argument("--task", type=int, metavar="N",
                        help="print step N of the plan as 'KIND CONFIG SEED LR TRACE BANDWIDTH SOURCE' (nothing when "
                             "it is done, or a re-timing, which the closing run.py call does); for job arrays")
    parser.add_argument("--do", type=int, metavar="N", help="run step N of the plan only (job arrays: bench peers)")
    parser.add_argument("--report", action="store_true", help="only write the report from existing traces")
    parser.add_argument("--target-loss", type=float, metavar="LOSS",
                        help="with --report: report the time to this loss (trailing mean) instead of the setup's, "
                             "into OUT/target-LOSS/")
    parser.add_argument("--methods", help="a part of the plan only: these methods (comma-separated, of "
                                          f"{','.join(CONFIGS)}, plus ddp for bench peers)")
    parser.add_argument("--lrs", help="a part of the plan only: these rates (comma-separated)")
    parser.add_argument("--seeds", help="a part of the plan only: these seeds (comma-separated)")
    args = parser.parse_args(argv)
    if not args.smoke and args.part is None:
        parser.error("--part bandwidths|congestion is required (or --smoke)")
    if args.target_loss is not None and not args.report:
        parser.error("--target-loss only changes a report: give --report too")
    s = settings_for(args.setup, args.smoke)
    dest = None
    if args.target_loss is not None:
        s.target_loss, dest = args.target_loss, args.out / f"target-{args.target_loss:g}"
    try:
        if args.methods:
            methods = tuple(args.methods.split(","))
            unknown = [m for m in methods if m not in s.configs and m != "ddp"]
            if unknown:
                parser.error(f"--methods: unknown {', '.join(unknown)}")
            s.methods, s.peers = tuple(m for m in methods if m != "ddp"), s.peers and "ddp" in methods
        if args.lrs:
            s.lrs = tuple(float(x) for x in args.lrs.split(","))
        if args.seeds:
            s.seeds = tuple(int(x) for x in args.seeds.split(","))
    except ValueError as exc:
        parser.error(f"--lrs/--seeds: {exc}")
    parts = [args.part] if args.part else ["bandwidths", "congestion"]
    if args.list:
        for part in parts:
            steps = plan(args.out, part, s)
            for k, step in enumerate(steps):
                print(k, step.line())
            print(f"# {part}: {estimate(steps, args.out, s)[1]}")
        return 0
    if args.task is not None or args.do is not None:
        steps = plan(args.out, parts[0], s)
        number = args.task if args.task is not None else args.do
        if not 0 <= number < len(steps):
            print(f"run.py: step {number} is outside the plan's {len(steps)} steps", file=sys.stderr)
            return 2
        step = steps[number]
        if args.do is not None:
            return 1 if run_steps([step], args.out, s, log=lambda line: print(line, flush=True)) else 0
        if not done(step, s.iterations) and step.kind != "retime":   # re-timings: the closing run.py call does them
            print(step.line())
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for part in parts:
        if not args.report:
            steps = plan(args.out, part, s)
            print(f"{part}: {len(steps)} steps into {args.out} (complete traces are skipped)", flush=True)
            failed += run_steps(steps, args.out, s, log=lambda line: print(line, flush=True))
        if dest is not None:
            dest.mkdir(exist_ok=True)
        (report_bandwidths if part == "bandwidths" else report_congestion)(args.out, s, dest=dest)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
