"""Models the runtime trains, in a registry keyed by name, or from a user's factory::

    model = build_model("paper-cnn", input_shape=(3, 32, 32), num_classes=10, seed=0)
    model = build_model("resnet20", input_shape=(1, 8, 8), num_classes=10, norm="group")
    model = build_model("mypkg.nets:make_net", input_shape=(3, 32, 32), num_classes=10, seed=0)
    loss = model.loss(model(x), y, weight_decay)     # cross-entropy + l2 term
    model.l2_parameters()                            # the tensors the l2 term covers
    model.quantized_parameters()                     # the tensors the paper quantizes

Every model is a ``torch.nn.Module`` with ``forward``, ``loss``, ``l2_parameters``,
``get_config`` and optionally ``quantized_parameters`` (the tensors quantized by default); nothing inside is device-specific (the runtime moves it) and nothing sets
torch's thread count. ``seed``, when given, seeds torch's generator before the build, so
every rank builds the same initial weights.

A plugin factory (``package.module:factory``) is called as
``factory(input_shape=(C, H, W), num_classes=K, seed=S, **model_opts)`` and returns a
``torch.nn.Module`` mapping a float32 (N, C, H, W) batch to (N, K) logits. It may define
``loss(logits, targets, weight_decay)`` and ``l2_parameters()``; otherwise it trains on
``Classifier``'s (cross-entropy, l2 on the weights of 2+ dimensions). See docs/models.rst.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ..options import check_keys, keyword_names
from ..plugins import call_factory, is_plugin, load_factory
from ..registry import Registry
from .base import Classifier, ModelError, check_int, check_ints
from .cnn import DEFAULT_WEIGHT_DECAY, PaperCNN
from .resnet import ResNet18, ResNet20

__all__ = ["ModelError", "build_model", "check_model", "available_models", "Classifier", "PaperCNN",
           "ResNet20", "ResNet18", "PluginModel", "DEFAULT_WEIGHT_DECAY"]


#: The built-in models by name; a plugin is a factory (``package.module:factory``), built
#: by ``_build_plugin``.
MODELS: Registry[Callable[..., nn.Module]] = Registry("model", ModelError)
for _builder in (PaperCNN, ResNet20, ResNet18):
    MODELS.register(_builder, _builder.model_id)


def available_models() -> list[str]:
    """Sorted names accepted by ``build_model`` (besides ``package.module:factory``)."""
    return MODELS.names()


def build_model(name: str, *, seed: int | None = None, **options: Any) -> nn.Module:
    """Build model ``name`` with ``options``; ModelError for an unknown name or bad options."""
    if seed is not None:
        torch.manual_seed(seed)
    if is_plugin(name):
        return _build_plugin(name, seed, options)
    builder = MODELS.lookup(name)
    check_keys(f"model {name!r}", [k for k in options if k not in _CONTRACT],
               keyword_names(builder, exclude=_CONTRACT), error=ModelError)
    try:
        inspect.signature(builder).bind(**options)
    except TypeError as exc:
        raise ModelError(f"bad options for model {name!r}: {exc}") from None
    return builder(**options)


#: What every model builder and factory is given besides the user's model options.
_CONTRACT = ("input_shape", "num_classes", "seed")


class PluginModel(Classifier):
    """A factory's module with the model contract: ``loss``, ``l2_parameters``, ``get_config``.

    The module's own ``loss`` and ``l2_parameters`` are used when it defines them.
    """

    def __init__(self, net: nn.Module, spec: str, input_shape: tuple[int, ...], num_classes: int,
                 options: dict[str, Any]):
        super().__init__()
        self.net = net
        self.spec = spec
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.options = dict(options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def l2_parameters(self) -> list[nn.Parameter]:
        own = getattr(self.net, "l2_parameters", None)
        return list(own()) if callable(own) else super().l2_parameters()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, weight_decay: float) -> torch.Tensor:
        own = getattr(self.net, "loss", None)
        return own(logits, targets, weight_decay) if callable(own) else super().loss(logits, targets, weight_decay)

    def get_config(self) -> dict:
        return {"id": self.spec, "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                **self.options}


def _build_plugin(spec: str, seed: int | None, options: dict[str, Any]) -> PluginModel:
    try:
        input_shape = check_ints("input_shape", options.pop("input_shape"), length=3)
        num_classes = check_int("num_classes", options.pop("num_classes"), minimum=2)
    except KeyError as exc:
        raise ModelError(f"model {spec}: missing {exc.args[0]}") from None
    factory = load_factory(spec, ModelError)
    check_keys(f"model factory {spec}", options, keyword_names(factory, exclude=_CONTRACT), error=ModelError)
    kwargs = dict(input_shape=input_shape, num_classes=num_classes, seed=0 if seed is None else seed, **options)
    net = call_factory(spec, factory, kwargs, ModelError)
    if not isinstance(net, nn.Module):
        raise ModelError(f"model factory {spec} returned {type(net).__name__}, expected a torch.nn.Module")
    if not any(True for _ in net.parameters()):
        raise ModelError(f"model factory {spec} returned a module without parameters: nothing to train")
    return PluginModel(net, spec, input_shape, num_classes, options)


def check_model(name: str, *, input_shape: Sequence[int], num_classes: int, seed: int = 0,
                **options: Any) -> nn.Module:
    """Build and return the model; for a plugin, also run two examples through it. ModelError
    naming what is wrong.

    Registry models are built on torch's meta device (no memory, no time; their shapes are
    tested), a plugin on the CPU, since a user's code may need real tensors. (A forward pass
    on the meta device would import torch's Python meta kernels: about 80 MB more per rank.)
    """
    if not is_plugin(name):
        with torch.device("meta"):
            return build_model(name, input_shape=input_shape, num_classes=num_classes, **options)
    model = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=seed, **options)
    x = torch.zeros(2, *input_shape)
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
    except Exception as exc:  # noqa: BLE001 - the user's forward, reported in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"model {name} fails on a (2, {', '.join(map(str, input_shape))}) batch: "
                         f"{type(exc).__name__}: {first}") from None
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (2, num_classes) \
            or not logits.is_floating_point():
        got = f"shape {tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) \
            else type(logits).__name__
        raise ModelError(f"model {name} maps a (2, {', '.join(map(str, input_shape))}) batch to {got}, "
                         f"expected float logits of shape (2, {num_classes})")
    return model
