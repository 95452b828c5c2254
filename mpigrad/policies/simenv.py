"""A simulated training run for testing and comparing bit policies without MPI or torch.

The model: the true loss l relaxes every iteration towards a floor that depends on the
bits in force, and each iteration costs compute plus the time to move the quantized
layers over a slow link::

    floor(b)   = optimum + noise_floor * sum_l w_l / (2**b_l - 1)**2   (w_l: layer share)
    l[m+1]     = floor(b) + (1 - rate) * (l[m] - floor(b))
    L[m]       = l[m] + loss_noise * N(0, 1)                            (what the policy sees)
    time[m]    = (compute_ms + transfers * sum_l size_l * b_l / 8 / bandwidth) * (1 + jitter)

so low-bit iterations are cheap but plateau (quantization noise, ~4^-b, sets the floor)
and high-bit iterations are dear but keep improving. An episode ends when l reaches
``target`` (time-to-target: the summed iteration times before that) or after
``max_iterations``. Policies that use gradients (``adaptive``) also see per-layer
Gaussian gradient samples whose scale shrinks with the excess loss, and ``codec``.

    python -m mpigrad.policies.simenv --seeds 20     # the comparison table of docs/policies.rst
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .base import Observation, Policy, get_policy

#: The comparison of docs/policies.rst: the paper's baselines, our Adaptive, MQGrad.
DEFAULT_POLICIES = {
    "fixed-2": {"id": "fixed", "bits": 2},
    "fixed-4": {"id": "fixed", "bits": 4},
    "fixed-8": {"id": "fixed", "bits": 8},
    "adaptive": {"id": "adaptive"},
    "mqgrad": {"id": "mqgrad"},
}


@dataclass(frozen=True)
class SimEnv:
    """Parameters of the simulated run (defaults: the paper's two FC layers at 10 MB/s)."""

    layer_sizes: tuple[int, ...] = (3136 * 2304, 2304 * 3840)
    compute_ms: float = 150.0
    bandwidth_bytes_per_ms: float = 10_000.0
    transfers: int = 2
    initial_loss: float = 2.3
    optimum: float = 0.2
    noise_floor: float = 4.0
    rate: float = 0.004
    loss_noise: float = 0.05
    time_jitter: float = 0.02
    target: float = 0.22
    max_iterations: int = 4000
    gradient_sample: int = 4096

    def floor(self, bits: tuple[int, ...]) -> float:
        shares = np.asarray(self.layer_sizes, np.float64) / sum(self.layer_sizes)
        levels = 2.0 ** np.asarray(bits, np.float64) - 1.0
        return self.optimum + self.noise_floor * float(np.sum(shares / levels**2))

    def iteration_ms(self, bits: tuple[int, ...]) -> float:
        wire_bytes = sum(size * b / 8.0 for size, b in zip(self.layer_sizes, bits))
        return self.compute_ms + self.transfers * wire_bytes / self.bandwidth_bytes_per_ms


@dataclass
class Episode:
    """One simulated run: per-iteration bits, true and observed losses, durations."""

    reached: bool
    time_to_target_s: float
    bits: np.ndarray            # (iterations, n_layers)
    true_loss: np.ndarray       # l[m]
    observed_loss: np.ndarray   # L[m]
    iteration_ms: np.ndarray
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def iterations(self) -> int:
        return len(self.iteration_ms)


def run_episode(env: SimEnv, policy: Policy, seed: int, codec: Any = None,
                stop_at_target: bool = True) -> Episode:
    """Drive ``policy`` through one simulated run; the noise streams depend on ``seed`` only."""
    rng = np.random.default_rng([seed, 7])
    n_layers = len(env.layer_sizes)
    if policy.n_layers != n_layers:
        raise ValueError(f"policy has {policy.n_layers} layers, the environment {n_layers}")
    true_loss, elapsed_ms, last_ms = env.initial_loss, 0.0, 0.0
    bits_log, true_log, observed_log, ms_log, records = [], [], [], [], []
    gradients: tuple[np.ndarray, ...] = ()
    reached_ms = math.inf
    for m in range(env.max_iterations):
        if true_loss <= env.target and math.isinf(reached_ms):
            reached_ms = elapsed_ms
            if stop_at_target:
                break
        observed = true_loss + env.loss_noise * rng.standard_normal()
        bits = policy.decide(Observation(m, observed, last_ms, gradients, codec))
        records.extend(policy.drain_records())
        floor = env.floor(bits)
        last_ms = env.iteration_ms(bits) * (1.0 + env.time_jitter * rng.standard_normal())
        true_loss = floor + (1.0 - env.rate) * (true_loss - floor)
        elapsed_ms += last_ms
        if policy.uses_gradients and env.gradient_sample:
            scale = math.sqrt(max(true_loss - env.optimum, 0.0)) + 1e-3
            gradients = tuple((scale * rng.standard_normal(env.gradient_sample)).astype(np.float32)
                              for _ in range(n_layers))
        bits_log.append(bits)
        true_log.append(true_loss)
        observed_log.append(observed)
        ms_log.append(last_ms)
    return Episode(reached=not math.isinf(reached_ms), time_to_target_s=reached_ms / 1000.0,
                   bits=np.array(bits_log, np.int64).reshape(-1, n_layers),
                   true_loss=np.array(true_log), observed_loss=np.array(observed_log),
                   iteration_ms=np.array(ms_log), records=records)


def compare(env: SimEnv, policies: dict[str, dict[str, Any]], seeds: range | list[int],
            codec: Any = None) -> dict[str, list[Episode]]:
    """Run every policy config over every seed (policy seed = run seed); episodes by name."""
    n_layers = len(env.layer_sizes)
    return {name: [run_episode(env, get_policy(config, n_layers=n_layers, seed=seed), seed, codec)
                   for seed in seeds]
            for name, config in policies.items()}


def summarise(episodes: list[Episode]) -> dict[str, float]:
    """Median time-to-target (inf when fewer than half reach it), reach rate, mean bits by
    quarter of the episode (averaged over episodes and layers)."""
    times = np.sort([e.time_to_target_s for e in episodes])
    quarters = np.array([[e.bits[q * e.iterations // 4:(q + 1) * e.iterations // 4].mean()
                          for q in range(4)] for e in episodes])
    return {"median_time_s": float(np.median(times)), "reached": float(np.mean(np.isfinite(times))),
            "best_time_s": float(times[0]), "worst_time_s": float(times[-1]),
            **{f"bits_q{q + 1}": float(quarters[:, q].mean()) for q in range(4)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpigrad.policies.simenv",
                                     description="compare bit policies on the simulated run")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--policy", action="append", default=[], metavar="NAME=JSON",
                        help="extra policy, e.g. 'mq-taken={\"id\":\"mqgrad\",\"transition\":\"taken\"}'")
    args = parser.parse_args(argv)
    policies = dict(DEFAULT_POLICIES)
    for item in args.policy:
        name, _, text = item.partition("=")
        policies[name] = json.loads(text)
    from ..codecs import available, get_codec
    codec = get_codec({"id": "uniform", "bits": 8}) if "uniform" in available() else None
    if codec is None:
        policies.pop("adaptive", None)
        print("codec 'uniform' not registered: skipping the adaptive policy")
    results = compare(SimEnv(), policies, range(args.seeds), codec)
    width = max(len(name) for name in results) + 1
    print(f"{'policy':<{width}} {'median s':>9} {'reached':>8} {'best s':>8} {'worst s':>8}  "
          f"mean bits by quarter")
    for name, episodes in results.items():
        s = summarise(episodes)
        print(f"{name:<{width}} {s['median_time_s']:9.0f} {s['reached']:8.0%} {s['best_time_s']:8.0f} "
              f"{s['worst_time_s']:8.0f}  " + " ".join(f"{s[f'bits_q{q}']:.2f}" for q in range(1, 5)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
