"""Error feedback: a codec-agnostic memory per layer, in GRACE's order.

    p = memory.compensate(key, g)      # p = g + decay * e   (a buffer the memory owns)
    buf = codec.encode(p)
    memory.update(key, p, codec.decode(buf))

Two modes, both configurations of the same memory:

``residual`` (EF-SGD / EF-signSGD, Karimireddy et al. 2019): e <- p - decoded, the part of
the compensated gradient that the codec did not deliver. Over T steps,
sum(decoded) = sum(g) + e_0 - e_T exactly (with decay 1), so nothing is lost for good.

``accumulate`` (MCGQ Alg. 4, DGC-style): e <- p with the sent entries (decoded != 0) set to
zero. Entries the codec did not send keep accumulating until they are sampled.

``decay`` scales the memory before it is added (1.0 keeps all of it). The memory of a key
is allocated on its first ``compensate``; afterwards no call allocates gradient-sized arrays.
``compensate`` does not change the memory, so if encode fails the memory is as before.
"""

from __future__ import annotations

from numbers import Real
from typing import Any, Hashable

import numpy as np

from .counters import launched

__all__ = ["ErrorFeedback", "FeedbackError", "MODES", "MomentumCorrection"]

MODES = ("residual", "accumulate")


class FeedbackError(ValueError):
    """A configuration, gradient or state that the error-feedback memory cannot accept."""


class _Slot:
    """Memory e, compensated buffer p and a mask scratch for one layer."""

    __slots__ = ("error", "compensated", "unsent")

    def __init__(self, error: np.ndarray):
        self.error = error
        self.compensated = np.empty_like(error)
        self.unsent = np.empty(error.shape, bool)


class ErrorFeedback:
    """Per-layer error memory: ``compensate`` -> (encode, decode) -> ``update``.

    ``mode`` "residual" (e = p - decoded) or "accumulate" (e = p where decoded == 0, else 0);
    ``decay`` in [0, 1]. Keys are any hashable layer names; gradients are float32 or
    float64 arrays whose shape and dtype stay fixed per key.
    """

    def __init__(self, mode: str = "residual", decay: float = 1.0):
        if mode not in MODES:
            raise FeedbackError(f"error feedback mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(decay, bool) or not isinstance(decay, Real) or not 0.0 <= decay <= 1.0:
            raise FeedbackError(f"error feedback decay must be a number in [0, 1], got {decay!r}")
        self.mode = mode
        self.decay = float(decay)
        self._slots: dict[Hashable, _Slot] = {}

    def __repr__(self) -> str:
        return f"ErrorFeedback(mode={self.mode!r}, decay={self.decay!r})"

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def keys(self) -> list[Hashable]:
        return list(self._slots)

    def error(self, key: Hashable) -> np.ndarray:
        """A read-only view of the memory e of ``key``."""
        view = self._slot(key).error.view()
        view.flags.writeable = False
        return view

    def compensate(self, key: Hashable, g: np.ndarray) -> np.ndarray:
        """p = g + decay * e, written into (and returned as) a buffer owned by the memory.

        The buffer is reused: it is valid until the next ``compensate`` of the same key.
        """
        g = _check_gradient(g, "g")
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(np.zeros_like(g))
        else:
            _check_like(slot.error, g, key, "g")
        p = slot.compensated
        if self.decay == 1.0:
            np.add(g, slot.error, out=p)
        else:
            np.multiply(slot.error, self.decay, out=p)
            np.add(p, g, out=p)
        return p

    def update(self, key: Hashable, p: np.ndarray, decoded: np.ndarray) -> None:
        """Set the memory of ``key`` from the compensated ``p`` and what the codec delivered."""
        slot = self._slot(key)
        p = _check_like(slot.error, _check_gradient(p, "p"), key, "p")
        decoded = _check_gradient(decoded, "decoded")
        if decoded.shape != p.shape:
            raise FeedbackError(f"error feedback {key!r}: decoded has shape {decoded.shape}, p {p.shape}")
        if self.mode == "residual":
            np.subtract(p, decoded, out=slot.error)
        else:
            np.equal(decoded, 0, out=slot.unsent)
            np.multiply(p, slot.unsent, out=slot.error)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the memory of ``key`` (all keys when None)."""
        if key is None:
            self._slots.clear()
        else:
            self._slots.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """{"mode", "decay", "memory": {key: copy of e}} (numpy arrays, for checkpoints)."""
        return {"mode": self.mode, "decay": self.decay,
                "memory": {key: slot.error.copy() for key, slot in self._slots.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the memories; the mode and decay must match this object's."""
        if state.get("mode") != self.mode or state.get("decay") != self.decay:
            raise FeedbackError(f"error feedback state is for mode={state.get('mode')!r}, "
                                f"decay={state.get('decay')!r}; this memory has mode={self.mode!r}, "
                                f"decay={self.decay!r}")
        slots = {}
        for key, error in state["memory"].items():
            error = _check_gradient(error, f"memory of {key!r}")
            if not np.isfinite(error).all():
                raise FeedbackError(f"error feedback state: memory of {key!r} holds NaN or infinity")
            slots[key] = _Slot(np.array(error, copy=True))
        self._slots = slots

    def _slot(self, key: Hashable) -> _Slot:
        try:
            return self._slots[key]
        except KeyError:
            raise FeedbackError(f"error feedback: no memory for {key!r} (call compensate first)") from None


class MomentumCorrection:
    """DGC's momentum correction (Lin et al. 2018, sec. 3.2): each worker keeps a velocity
    ``u <- m * u + g`` of its own gradients, and the codec (after error feedback, when there
    is one: GRACE's order) encodes ``u`` instead of ``g``; the update applied to the average
    is then plain SGD, ``w <- w - lr * mean(u)``. Since the average is linear, in float32
    this is SGD with heavy-ball momentum ``m`` (no dampening) on the averaged gradient, to
    rounding; with a lossy codec the momentum is accumulated before the loss, not after it.

    Hyperparameter ``momentum`` in (0, 1); state: the velocity (allocated by the first
    ``accumulate``, a float32 array or torch tensor like the gradient, on its device)."""

    def __init__(self, momentum: float):
        if isinstance(momentum, bool) or not isinstance(momentum, Real) or not 0.0 < momentum < 1.0:
            raise FeedbackError(f"momentum correction must be a number in (0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.velocity = None

    def __repr__(self) -> str:
        return f"MomentumCorrection(momentum={self.momentum!r})"

    def accumulate(self, g):
        """``u <- m * u + g`` (``u = g`` the first time), in place; returns ``u`` (valid until
        the next call). ``g``: a flat float32 array, or torch tensor, of fixed size."""
        on_device = not isinstance(g, np.ndarray)
        if on_device:  # the device path's operations, counted as its others are
            launched("torch", 1 if self.velocity is None else 2)
        if self.velocity is None:
            self.velocity = g.copy() if not on_device else g.clone()
            return self.velocity
        if self.velocity.shape != g.shape or type(self.velocity) is not type(g):
            raise FeedbackError(f"momentum correction: the gradient is {type(g).__name__}{list(g.shape)}, "
                                f"the velocity {type(self.velocity).__name__}{list(self.velocity.shape)}")
        if not on_device:
            np.multiply(self.velocity, np.float32(self.momentum), out=self.velocity)
            np.add(self.velocity, g, out=self.velocity)
        else:
            self.velocity.mul_(self.momentum).add_(g)
        return self.velocity

    def state_dict(self) -> dict[str, Any]:
        """{"momentum", "velocity": a host copy of u, or None before the first iteration}."""
        velocity = self.velocity
        if velocity is not None and not isinstance(velocity, np.ndarray):
            velocity = velocity.detach().cpu().numpy()
        return {"momentum": self.momentum, "velocity": None if velocity is None else np.array(velocity, copy=True)}

    def load_state_dict(self, state: dict[str, Any], like=None) -> None:
        """Restore the velocity (onto ``like``'s device and type, a gradient, when given); the
        momentum must match this object's."""
        if state.get("momentum") != self.momentum:
            raise FeedbackError(f"momentum correction state is for momentum={state.get('momentum')!r}; "
                                f"this run has {self.momentum!r}")
        velocity = state.get("velocity")
        if velocity is None:
            self.velocity = None
            return
        velocity = np.asarray(velocity)
        if velocity.dtype not in (np.float32, np.float64) or velocity.ndim != 1:
            raise FeedbackError(f"momentum correction state: the velocity must be a 1-D float array, got "
                                f"{velocity.dtype}{list(velocity.shape)}")
        if not np.isfinite(velocity).all():
            raise FeedbackError("momentum correction state: the velocity holds NaN or infinity")
        if like is not None and tuple(like.shape) != velocity.shape:
            raise FeedbackError(f"momentum correction state holds {velocity.size} values, the model has {like.numel()}")
        if like is None or isinstance(like, np.ndarray):
            self.velocity = np.array(velocity, dtype=np.float32, copy=True)
        else:
            import torch

            self.velocity = torch.from_numpy(np.array(velocity, dtype=np.float32)).to(like.device)


def _check_gradient(x: Any, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64):
        raise FeedbackError(f"error feedback: {name} must be a float32 or float64 numpy array, "
                            f"got {getattr(x, 'dtype', type(x).__name__)}")
    return x


def _check_like(error: np.ndarray, x: np.ndarray, key: Hashable, name: str) -> np.ndarray:
    if x.shape != error.shape or x.dtype != error.dtype:
        raise FeedbackError(f"error feedback {key!r}: {name} is {x.dtype}{list(x.shape)}, "
                            f"the memory holds {error.dtype}{list(error.shape)}")
    return x

