"""The update rule: the optimizer and the learning-rate schedule every replica applies to
the decoded, averaged update.

The default is the paper's plain SGD, ``w <- w - lr * g`` at a constant rate, computed as it
always was (one ``add_`` per piece: the same numbers and time as before optimizers existed).
Any other optimizer is a ``torch.optim`` class by name (``--optimizer sgd --optimizer-opt
momentum=0.9``) or a plugin ``package.module:factory``, built once per *piece* of the layout
(``runtime/plan/layout.py``): its parameter is that piece's flat slice of the parameters and its
gradient the same slice of the update, so its state (momentum, Adam's moments) lies flat
beside the parameters and the pipelined iteration applies it piece by piece as the pieces
arrive. Every rank builds the same pieces, so replicas stay identical, as under DDP.

The schedule is any ``torch.optim.lr_scheduler`` class by name with its options, stepped once
per iteration, times a linear warm-up over ``lr_warmup`` iterations; ``lr_scaling = "linear"``
multiplies the base rate by the number of workers (Goyal et al.'s rule).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch

from .options import check_keys, check_values, keyword_names
from .plugins import call_factory, is_plugin, load_factory

__all__ = ["OptimizerError", "OPTIMIZERS", "SCALINGS", "optimizer_class", "schedule_class", "check_recipe",
           "UpdateRule", "LearningRate", "build_torch_optimizer", "rate_moves", "is_plain"]


class OptimizerError(ValueError):
    """A bad optimizer or schedule name or option (one line)."""


#: torch.optim's optimizers that work element by element on any flat slice of the
#: parameters (so a piece is as good as a layer), by the lower-case names mpigrad takes.
OPTIMIZERS = {name.lower(): name for name in
              ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")}
#: torch.optim's other optimizers, and why mpigrad refuses them.
REFUSED = {"lbfgs": "it needs a closure that re-evaluates the loss", "sparseadam": "it needs sparse gradients",
           "adafactor": "it factors each matrix's second moment, which needs whole layers, not flat pieces"}
SCALINGS = ("none", "linear")
#: Options mpigrad sets itself on every optimizer and schedule.
_OWN = ("params", "lr", "optimizer")


def optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer class (or plugin factory) ``name`` stands for; OptimizerError listing the
    choices for an unknown name."""
    if is_plugin(name):
        return load_factory(name, OptimizerError)
    key = name.lower()
    if key in REFUSED:
        raise OptimizerError(f"optimizer {name!r} is refused: {REFUSED[key]}")
    if key not in OPTIMIZERS:
        raise OptimizerError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}, "
                             "or a plugin package.module:factory")
    return getattr(torch.optim, OPTIMIZERS[key])


def schedule_class(name: str):
    """The ``torch.optim.lr_scheduler`` class (or plugin factory) ``name`` stands for."""
    if is_plugin(name):
        return load_factory(name, OptimizerError)
    import torch.optim.lr_scheduler as schedulers

    choices = {n.lower(): n for n, c in vars(schedulers).items()
               if inspect.isclass(c) and issubclass(c, schedulers.LRScheduler) and c is not schedulers.LRScheduler
               and not n.startswith("_") and n not in ("SequentialLR", "ChainedScheduler", "LambdaLR", "MultiplicativeLR", "ReduceLROnPlateau")}
    if name.lower() not in choices:
        raise OptimizerError(f"unknown lr schedule {name!r}; choose from {', '.join(sorted(choices.values()))}, "
                             "or a plugin package.module:factory")
    return getattr(schedulers, choices[name.lower()])


def rate_moves(schedule: str | None, warmup: int) -> bool:
    """True where the rate changes during the run (a schedule or a warm-up): the trace then
    has a ``steps/lr`` column and progress lines show the rate."""
    return bool(schedule) or warmup > 0


def is_plain(optimizer: str, options: dict[str, Any]) -> bool:
    """True for the paper's update: SGD without options (momentum, weight decay, ...)."""
    return optimizer.lower() == "sgd" and not options


def build_torch_optimizer(name: str, params, lr: float, options: dict[str, Any]) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``params`` at ``lr`` with ``options``: OptimizerError (one
    line) for an option its class does not take (naming those it does), a value of another kind
    than its parameter's (``check_values``: ``nesterov must be true or false, got 'yes'``) or
    a value it refuses."""
    cls = optimizer_class(name)
    if is_plugin(name):
        optimizer = call_factory(name, cls, {"params": params, "lr": lr, **options}, OptimizerError)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerError(f"optimizer factory {name} returned a {type(optimizer).__name__}, "
                                 "not a torch.optim.Optimizer")
        return optimizer
    valid = keyword_names(cls, exclude=_OWN)
    check_keys(f"optimizer {name!r}", options, valid, error=OptimizerError)
    check_values(f"optimizer {name!r}", cls, options, error=OptimizerError)
    if valid and "fused" in valid and not {"fused", "foreach"} & set(options):
        # One fused pass per step: torch's CPU default runs Adam's update as a dozen passes,
        # 43 against 4 ms for 8.8M parameters on one thread (docs/training.rst).
        options = {**options, "fused": True}
    try:
        return cls(params, lr=lr, **options)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise OptimizerError(f"optimizer {name!r}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch's signature dumps run to 20 lines), or its
    type's name where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(":") if text else type(exc).__name__


class LearningRate:
    """The rate of each iteration. Hyperparameters: the base rate, the schedule (a
    ``torch.optim.lr_scheduler`` class name or plugin, None for a constant rate) and its
    options, the warm-up iterations, the scaling rule and the number of workers. State: the
    scheduler's (it lives on a one-element stand-in optimizer and is stepped once per
    iteration). ``at(m)`` is the rate of iteration m; iterations advance in order."""

    def __init__(self, lr: float, schedule: str | None = None, schedule_opts: dict[str, Any] | None = None,
                 warmup: int = 0, scaling: str = "none", workers: int = 1):
        if scaling not in SCALINGS:
            raise OptimizerError(f"lr_scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
        if int(warmup) < 0:
            raise OptimizerError(f"lr_warmup must be >= 0 iterations, got {warmup}")
        self.base = lr * (workers if scaling == "linear" else 1)
        self.warmup = int(warmup)
        self.schedule_name = schedule
        # Without a schedule no torch optimizer is built: its first construction imports
        # torch._dynamo, 1.7 s of every rank's start-up.
        self._stand_in = torch.optim.SGD([torch.zeros(1)], lr=self.base) if schedule else None
        self.scheduler = None
        if schedule:
            cls = schedule_class(schedule)
            options = dict(schedule_opts or {})
            if is_plugin(schedule):
                self.scheduler = call_factory(schedule, cls, {"optimizer": self._stand_in, **options}, OptimizerError)
            else:
                check_keys(f"lr schedule {schedule!r}", options, keyword_names(cls, exclude=_OWN),
                           error=OptimizerError)
                check_values(f"lr schedule {schedule!r}", cls, options, error=OptimizerError)
                try:
                    self.scheduler = cls(self._stand_in, **options)
                except (TypeError, ValueError, KeyError) as exc:
                    raise OptimizerError(f"lr schedule {schedule!r}: {first_line(exc)}") from None
        self.iteration = 0
        self._recent: dict[int, float] = {}

    @property
    def constant(self) -> bool:
        return not rate_moves(self.schedule_name, self.warmup)

    def _scheduled(self) -> float:
        """The schedule's current rate, before warm-up."""
        return self._stand_in.param_groups[0]["lr"] if self._stand_in is not None else self.base

    def at(self, m: int) -> float:
        """The rate of iteration ``m``: the scheduler is stepped forward to m; the rates of the
        last few iterations before it are kept (the Control ahead of the losses asks for the
        next iteration's rate before this one's update); older ones are an error."""
        while self.iteration < m:
            self._recent[self.iteration] = self._scheduled()
            self._recent.pop(self.iteration - 4, None)
            if self.scheduler is not None:
                self._stand_in.step()  # no gradient, nothing moves: torch wants a step before the scheduler's
                self.scheduler.step()
            self.iteration += 1
        if m == self.iteration:
            rate = self._scheduled()
        elif m in self._recent:
            rate = self._recent[m]
        else:
            raise ValueError(f"the rate of iteration {m} is gone: the schedule is at iteration {self.iteration}")
        if m < self.warmup:
            rate *= (m + 1) / self.warmup
        return float(rate)

    def state_dict(self) -> dict:
        return {"iteration": self.iteration,
                "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
                "lr": self._scheduled(), "recent": dict(self._recent)}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self._stand_in is not None:
            self._stand_in.param_groups[0]["lr"] = state["lr"]
        self._recent = {int(m): rate for m, rate in state.get("recent", {}).items()}


class UpdateRule:
    """How a replica applies the decoded update to its flat parameters. Hyperparameters: the
    optimizer's name and options, and the pieces ((offset, size) pairs, the layout's) each
    of which gets its own optimizer. State: each piece's optimizer state (none for plain SGD).

    ``apply(flat, update, lr, offset, end)`` applies the update of elements offset..end, which
    must be whole pieces (a whole step, or one piece of the pipelined iteration)."""

    def __init__(self, optimizer: str, options: dict[str, Any], pieces: list[tuple[int, int]],
                 flat: torch.Tensor, lr: float):
        self.name, self.options = optimizer, dict(options)
        self.plain = is_plain(optimizer, self.options)
        self.pieces = [(int(offset), int(size)) for offset, size in pieces]
        self._index = {offset: i for i, (offset, _) in enumerate(self.pieces)}
        self._params: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        if not self.plain:
            for offset, size in self.pieces:
                param = flat[offset:offset + size]  # a view: the optimizer writes the replica's parameters
                self._params.append(param)
                self.optimizers.append(build_torch_optimizer(optimizer, [param], lr, self.options))

    def apply(self, flat: torch.Tensor, update: torch.Tensor, lr: float, offset: int, end: int) -> None:
        if self.plain:
            flat[offset:end].add_(update[offset:end], alpha=-lr)
            return
        first = self._index.get(offset)
        if first is None:
            raise ValueError(f"update of elements {offset}..{end} does not start a piece")
        i = first
        while i < len(self.pieces) and self.pieces[i][0] < end:
            start, size = self.pieces[i]
            param, optimizer = self._params[i], self.optimizers[i]
            param.grad = update[start:start + size]
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            param.grad = None
            i += 1

    def state_dict(self) -> dict:
        # Copies: torch's state_dict holds the live state tensors, which the next step changes.
        return {"optimizer": self.name, "pieces": self.pieces,
                "states": [copy.deepcopy(optimizer.state_dict()) for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("pieces", self.pieces) != self.pieces or len(state.get("states", [])) != len(self.optimizers):
            raise ValueError("the checkpoint's optimizer state is for another layout of the parameters")
        for optimizer, saved in zip(self.optimizers, state["states"]):
            optimizer.load_state_dict(copy.deepcopy(saved))


def recipe_description(config) -> str:
    """The update rule of ``config`` (a RunConfig) in a few words: ``lr 0.01`` for the paper's
    plain SGD at a constant rate, else ``lr 0.1, sgd(momentum=0.9) MultiStepLR(...) warm-up 5``."""
    from .config import describe_recipe

    recipe = describe_recipe(config.to_dict())
    return f"lr {config.lr:g}" + ("" if recipe == "sgd" else f", {recipe}")


def check_recipe(optimizer: str, options: dict[str, Any], schedule: str | None, schedule_opts: dict[str, Any],
                 warmup: int, scaling: str) -> None:
    """OptimizerError (one line, naming the optimizer or schedule) for a recipe that cannot be
    built or used, before any rank starts: the options' values are checked against their
    parameters' kinds (``check_values``), the optimizer is built on a stand-in parameter and
    takes one step on a stand-in gradient (torch checks some options only in its step, e.g.
    the fused kernels' arguments), and the schedule is built and stepped twice."""
    param = torch.zeros(2)
    built = build_torch_optimizer(optimizer, [param], 0.1, options)
    param.grad = torch.full_like(param, 0.5)
    try:
        built.step()
    except Exception as exc:  # noqa: BLE001 - whatever the step raises, the run would die of it
        raise OptimizerError(f"optimizer {optimizer!r}: its first step fails: {first_line(exc)}") from None
    rate = LearningRate(0.1, schedule, schedule_opts, warmup, scaling)
    try:
        rate.at(2)  # some schedules check their options only when stepped
    except (TypeError, ValueError, KeyError, ZeroDivisionError, IndexError, AttributeError) as exc:
        raise OptimizerError(f"lr schedule {schedule!r}: {first_line(exc)}") from None
