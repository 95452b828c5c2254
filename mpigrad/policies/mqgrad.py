"""``mqgrad``: the SARSA bit controller of MQGrad (Cui et al., Sec. 3.3 and Alg. 2).

Every iteration m the policy receives the global loss L^m and the duration of iteration
m-1. When m % T == 0 it takes MDP step t = m // T:

1. Eq. 1: smooth the T losses of iterations (t-1)T+1 .. tT with an exponential moving
   average that carries its last value over from step t-1: ``smooth_losses``.
2. Eq. 3: the state is s_t = [n_t, Lbar_t] with n_t = n_{t-1} + argmax_a Q(s_{t-1}, a)
   (``transition="greedy"``, ties keep) or n_{t-1} + a_{t-1} (``transition="taken"``).
3. Eq. 2: the reward of the previous action, r_{t-1} = -beta * gamma / c with beta the
   least-squares slope of Lbar_t against i = 1..T and c the milliseconds the T
   iterations (t-1)T .. tT-1 took: ``least_squares_slope``, ``mdp_reward``.
4. Choose a_t epsilon-greedily: the greedy action with probability 1 - epsilon, the
   other one with probability epsilon (the paper's pi over its two actions). At
   n_t = max_bits only "keep" exists.
5. Alg. 2 line 4, semi-gradient SARSA:
   v += eta * (r_{t-1} + discount * Q(s_t, a_t) - Q(s_{t-1}, a_{t-1})) * dQ(s_{t-1}, a_{t-1})/dv.
6. The bits n_t + a_t hold for iterations tT .. tT+T-1.

Q(s, a) = Qnet(features(Lbar))[n + a - min_bits]: one network output per bit level,
the Q-network's input is the T smoothed losses (``input_norm`` may divide them by the
first loss). How each gap in the paper is resolved is documented in docs/policies.rst.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import (Observation, Policy, PolicyError, check_bits_range, check_bool, check_choice,
                   check_float, check_int, register_policy)
from .qnet import OUTPUT_INITS, QNetwork

TRANSITIONS = ("greedy", "taken")
INPUT_NORMS = ("none", "first_loss")


def smooth_losses(losses: Sequence[float], previous: float, alpha: float) -> np.ndarray:
    """Eq. 1: Lbar^1 = alpha L^1 + (1-alpha) previous, Lbar^i = alpha L^i + (1-alpha) Lbar^(i-1)."""
    out = np.empty(len(losses))
    value = previous
    for i, loss in enumerate(losses):
        value = alpha * loss + (1.0 - alpha) * value
        out[i] = value
    return out


def least_squares_slope(values: np.ndarray) -> float:
    """beta of argmin_(beta, b) sum_i (beta * i + b - values[i-1])^2 over i = 1..len(values)."""
    i = np.arange(1, len(values) + 1, dtype=np.float64)
    i -= i.mean()
    return float(i @ (values - np.mean(values)) / (i @ i))


def mdp_reward(beta: float, c_ms: float, gamma: float) -> float:
    """Eq. 2: R = -(1 / c) * beta * gamma."""
    return -beta * gamma / c_ms


class SarsaAgent:
    """One learner: its bits n_t, Q-network, exploration RNG and last (state, action)."""

    def __init__(self, *, n_inputs: int, hidden: int, min_bits: int, max_bits: int, initial_bits: int,
                 epsilon: float, eta: float, discount: float, transition: str, output_init: str,
                 seed: int, index: int):
        self.min_bits, self.max_bits = min_bits, max_bits
        self.epsilon, self.eta, self.discount, self.transition = epsilon, eta, discount, transition
        self.net = QNetwork(n_inputs, hidden, max_bits - min_bits + 1,
                            np.random.default_rng([seed, index, 0]), output_init)
        self.rng = np.random.default_rng([seed, index, 1])
        self.n = initial_bits
        self._previous: dict[str, Any] | None = None   # x, k (output index), greedy, action

    def step(self, x: np.ndarray, reward: float | None) -> dict[str, Any]:
        """One MDP step on features ``x``; ``reward`` is r_{t-1} (None at t = 0)."""
        with np.errstate(over="ignore", invalid="ignore"):
            q = self.net.values(x)
        if not np.isfinite(q).all():
            raise _diverged("a Q-value", q[~np.isfinite(q)][0])
        previous = self._previous
        if previous is not None:
            self.n += previous["greedy"] if self.transition == "greedy" else previous["action"]
        n, lo = self.n, self.min_bits
        can_raise = n < self.max_bits
        greedy = int(can_raise and q[n + 1 - lo] > q[n - lo])
        exploratory = bool(can_raise and self.rng.random() < self.epsilon)
        action = 1 - greedy if exploratory else greedy
        k = n + action - lo
        td_error = math.nan
        if previous is not None and reward is not None:
            q_previous = self.net.values(previous["x"])[previous["k"]]
            td_error = float(reward + self.discount * q[k] - q_previous)
            if not math.isfinite(td_error):
                raise _diverged("TD error", td_error)
            with np.errstate(over="ignore", invalid="ignore"):
                self.net.add_(self.net.gradient(previous["x"], previous["k"]), self.eta * td_error)
        self._previous = {"x": x, "k": k, "greedy": greedy, "action": action}
        return {"n": n, "action": action, "greedy_action": greedy, "exploratory": exploratory,
                "bits": n + action, "q_values": q, "td_error": td_error}

    def state_dict(self) -> dict[str, Any]:
        previous = None if self._previous is None else {
            k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self._previous.items()}
        return {"n": self.n, "net": self.net.state_dict(), "rng": self.rng.bit_generator.state,
                "previous": previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])
        self.net.load_state_dict(state["net"])
        self.rng.bit_generator.state = state["rng"]
        previous = state["previous"]
        self._previous = None if previous is None else {
            "x": np.array(previous["x"], dtype=np.float64), "k": int(previous["k"]),
            "greedy": int(previous["greedy"]), "action": int(previous["action"])}


def _diverged(what: str, value: Any) -> PolicyError:
    return PolicyError(f"policy 'mqgrad': the Q-network diverged ({what} {value}); "
                       f"lower eta or use input_norm='first_loss'")


@register_policy
class MQGradPolicy(Policy):
    """MQGrad's SARSA agent over a small Q-network (defaults are the paper's values).

    ``per_layer=True`` gives every quantized layer its own agent (own Q-network, RNG and
    bits); all agents see the same global losses, time and reward.
    """

    policy_id = "mqgrad"
    reads_clock = True  # the reward divides by the time of the last T iterations

    def __init__(self, *, T: int = 5, alpha: float = 0.01, gamma: float = 300.0,
                 discount: float = 0.5, epsilon: float = 0.1, eta: float = 0.1, hidden: int = 10,
                 min_bits: int = 2, max_bits: int = 8, initial_bits: int = 2,
                 transition: str = "greedy", input_norm: str = "first_loss", output_init: str = "zero",
                 per_layer: bool = False, n_layers: int = 1, seed: int = 0):
        super().__init__(n_layers=n_layers, seed=seed)
        pid = self.policy_id
        self.T = check_int(pid, "T", T, 2)
        self.alpha = check_float(pid, "alpha", alpha, 0.0, 1.0, low_open=True)
        self.gamma = check_float(pid, "gamma", gamma, 0.0, low_open=True)
        self.discount = check_float(pid, "discount", discount, 0.0, 1.0)
        self.epsilon = check_float(pid, "epsilon", epsilon, 0.0, 1.0)
        self.eta = check_float(pid, "eta", eta, 0.0, low_open=True)
        self.hidden = check_int(pid, "hidden", hidden, 1)
        self.min_bits, self.max_bits = check_bits_range(pid, min_bits, max_bits)
        self.initial_bits = check_int(pid, "initial_bits", initial_bits, self.min_bits, self.max_bits)
        self.transition = check_choice(pid, "transition", transition, TRANSITIONS)
        self.input_norm = check_choice(pid, "input_norm", input_norm, INPUT_NORMS)
        self.output_init = check_choice(pid, "output_init", output_init, OUTPUT_INITS)
        self.per_layer = check_bool(pid, "per_layer", per_layer)
        self._agents = [
            SarsaAgent(n_inputs=self.T, hidden=self.hidden, min_bits=self.min_bits,
                       max_bits=self.max_bits, initial_bits=self.initial_bits, epsilon=self.epsilon,
                       eta=self.eta, discount=self.discount, transition=self.transition,
                       output_init=self.output_init, seed=self.seed, index=index)
            for index in range(self.n_layers if self.per_layer else 1)]
        self._next_iteration = 0
        self._losses: list[float] = []       # raw global losses of the current MDP step
        self._c_ms = 0.0                     # time of the current step's iterations so far
        self._last_smoothed = math.nan       # Lbar_{t-1}^T, carried into Eq. 1
        self._first_loss = math.nan
        self._bits: tuple[int, ...] = (self.initial_bits,) * self.n_layers
        self._records: list[dict[str, Any]] = []

    def _config(self):
        return {"T": self.T, "alpha": self.alpha, "gamma": self.gamma, "discount": self.discount,
                "epsilon": self.epsilon, "eta": self.eta, "hidden": self.hidden,
                "min_bits": self.min_bits, "max_bits": self.max_bits,
                "initial_bits": self.initial_bits, "transition": self.transition,
                "input_norm": self.input_norm, "output_init": self.output_init,
                "per_layer": self.per_layer}

    def bits_range(self):
        return self.initial_bits, self.max_bits

    @property
    def agents(self) -> tuple[SarsaAgent, ...]:
        return tuple(self._agents)

    # ---- decisions ----------------------------------------------------------------
    def decide(self, obs: Observation) -> tuple[int, ...]:
        m = int(obs.iteration)
        if m != self._next_iteration:
            raise PolicyError(f"policy 'mqgrad' expected iteration {self._next_iteration}, got {m} "
                              f"(decide() must be called once per iteration, in order)")
        loss = float(obs.loss)
        if not math.isfinite(loss):
            raise PolicyError(f"policy 'mqgrad': global loss at iteration {m} is {loss}; "
                              f"the MDP state needs finite losses")
        if m == 0:
            if self.input_norm == "first_loss" and loss <= 0.0:
                raise PolicyError(f"policy 'mqgrad': input_norm='first_loss' needs a positive first "
                                  f"loss, got {loss}")
            self._first_loss = self._last_smoothed = loss
            self._losses = [loss] * self.T
        else:
            self._losses.append(loss)
            self._c_ms += float(obs.last_iteration_ms)
        if m % self.T == 0:
            self._step(m // self.T, m)
        self._next_iteration = m + 1
        return self._bits

    def bits_ahead(self, iteration: int) -> tuple[int, ...] | None:
        """Between two MDP steps the bits stay those of the last step (Alg. 1: the action is
        taken every T iterations)."""
        if iteration == self._next_iteration and iteration % self.T != 0:
            return self._bits
        return None

    def _step(self, t: int, m: int) -> None:
        smoothed = smooth_losses(self._losses, self._last_smoothed, self.alpha)
        self._last_smoothed = float(smoothed[-1])
        beta = c_ms = reward = math.nan
        if t > 0:
            beta, c_ms = least_squares_slope(smoothed), self._c_ms
            if c_ms <= 0.0:
                raise PolicyError(f"policy 'mqgrad': iterations {m - self.T}..{m - 1} took {c_ms} ms; "
                                  f"the reward -beta*gamma/c needs c > 0")
            reward = mdp_reward(beta, c_ms, self.gamma)
        x = smoothed / self._first_loss if self.input_norm == "first_loss" else smoothed
        bits = []
        for index, agent in enumerate(self._agents):
            row = agent.step(x, None if t == 0 else reward)
            row.update(t=t, iteration=m, layer=index if self.per_layer else -1,
                       smoothed_loss=smoothed, reward=reward, beta=beta, c_ms=c_ms, gamma=self.gamma)
            self._records.append(row)
            bits.append(row["bits"])
        self._bits = tuple(bits) if self.per_layer else (bits[0],) * self.n_layers
        self._losses, self._c_ms = [], 0.0

    def record_columns(self):
        levels = self.max_bits - self.min_bits + 1
        return {"t": ("i8", ()), "iteration": ("i8", ()), "layer": ("i4", ()),
                "smoothed_loss": ("f8", (self.T,)), "n": ("i4", ()), "action": ("i1", ()),
                "greedy_action": ("i1", ()), "exploratory": ("?", ()), "bits": ("i4", ()),
                "q_values": ("f8", (levels,)), "reward": ("f8", ()), "beta": ("f8", ()),
                "c_ms": ("f8", ()), "gamma": ("f8", ()), "td_error": ("f8", ())}

    def drain_records(self):
        records, self._records = self._records, []
        return records

    # ---- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.get_config(), "n_layers": self.n_layers,
                "next_iteration": self._next_iteration, "losses": list(self._losses),
                "c_ms": self._c_ms, "last_smoothed": self._last_smoothed,
                "first_loss": self._first_loss, "bits": list(self._bits),
                "agents": [agent.state_dict() for agent in self._agents]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config") != self.get_config() or state.get("n_layers") != self.n_layers:
            raise PolicyError(f"policy 'mqgrad': checkpoint was written with config {state.get('config')} "
                              f"and {state.get('n_layers')} layers, this run has {self.get_config()} "
                              f"and {self.n_layers}")
        for agent, agent_state in zip(self._agents, state["agents"], strict=True):
            agent.load_state_dict(agent_state)
        self._next_iteration = int(state["next_iteration"])
        self._losses = [float(v) for v in state["losses"]]
        self._c_ms = float(state["c_ms"])
        self._last_smoothed = float(state["last_smoothed"])
        self._first_loss = float(state["first_loss"])
        self._bits = tuple(int(b) for b in state["bits"])
        self._records = []
