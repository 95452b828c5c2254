"""Models the runtime trains, in a registry keyed by name::

    model = build_model("paper-cnn", input_shape=(3, 32, 32), num_classes=10)
    loss = model.loss(model(x), y, weight_decay)     # cross-entropy + l2 term
    model.l2_parameters()                            # the tensors the l2 term covers
    model.quantized_parameters()                     # the tensors the paper quantizes

Every model is a ``torch.nn.Module`` with ``forward``, ``loss``, ``l2_parameters``,
``quantized_parameters`` and ``get_config``; nothing inside is device-specific (the runtime moves it) and nothing sets
torch's thread count.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from .base import ModelError
from .cnn import DEFAULT_WEIGHT_DECAY, PaperCNN

__all__ = ["ModelError", "build_model", "available_models", "PaperCNN", "DEFAULT_WEIGHT_DECAY"]


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    PaperCNN.model_id: PaperCNN,
}


def available_models() -> list[str]:
    """Sorted names accepted by ``build_model``."""
    return sorted(_BUILDERS)


def build_model(name: str, **options: Any) -> nn.Module:
    """Build model ``name`` with ``options``; ModelError for an unknown name or bad options."""
    try:
        builder = _BUILDERS[name]
    except (KeyError, TypeError):
        raise ModelError(f"unknown model {name!r}; available: {', '.join(available_models())}") from None
    try:
        inspect.signature(builder).bind(**options)
    except TypeError as exc:
        raise ModelError(f"bad options for model {name!r}: {exc}") from None
    return builder(**options)
