"""The cost model of local work: what the policy, encoding, decoding and averaging cost on the simulated clock.

With ``compute_time`` fixed (the deterministic mode every comparison uses) the clock charges
the fixed figure for the workers' forward and backward pass, the modelled messages
(:mod:`mpigrad.clockmodel`), and, from this model, the local work around them: rank 0's
policy decision, each worker's encode of its frames, each server's decode of the P frames
of its shard, its average and re-encode, and the decode of the broadcast. The model is
measured on a machine by ``mpigrad bench calibrate`` (process CPU time, one Numba thread,
median of repeats) per codec, width and operation, and per policy, at several element
counts, and evaluated through those points (:class:`Cost`: piecewise linear; per element,
costs rise by up to 2x once a vector leaves the caches, which one line ``a + b *
elements`` fits only to 8-63 %; the fit is kept for hand-written models and below the
smallest size). A run records the model it charged in its trace (root attribute
``cost_model``) with what it charged it for (``local_work``: the pieces of each server's
shard, the codecs, the policy), so that two runs of one seed are identical and ``mpigrad
trace retime`` charges the same local work again.

``cost_model.json`` beside this module (measured on the machine named in it) is the
default; ``--cost-model FILE`` takes another, ``--cost-model none`` charges no local work
(the clock before issue 24).

A leaf module, like :mod:`mpigrad.clockmodel`: it imports neither MPI, torch, Numba nor the
codecs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["Cost", "CostModel", "CostModelError", "LocalWork", "DEFAULT_MODEL_PATH", "FORMAT", "VERSION",
           "CODEC_OPERATIONS", "OPERATIONS", "resolve", "fit_linear"]

FORMAT = "mpigrad-cost-model"
VERSION = 1
#: The package's model: the default of ``--cost-model``.
DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "cost_model.json"
#: Per (codec, width): encode into a reused buffer, decode into one, decode-add into a sum.
CODEC_OPERATIONS = ("encode", "decode", "accumulate")
#: Codec-independent work per element: the server's in-place average (``np.multiply``) and
#: an error-feedback memory's compensate + update (besides the decode it needs).
OPERATIONS = ("average", "feedback:residual", "feedback:accumulate")
#: The float32 path: the layers that travel unquantized (and fp32 broadcasts).
FLOAT32 = ("fp32", 32)


class CostModelError(ValueError):
    """A cost model that cannot be read or used (one line)."""


def resolve(option: str | None) -> "CostModel | None":
    """The model ``--cost-model`` names: ``default`` (the package's), ``none`` (None) or a
    JSON file. CostModelError for a file that is missing or malformed."""
    if option is None or option == "none":
        return None
    return CostModel.load(DEFAULT_MODEL_PATH if option == "default" else option)


@dataclass(frozen=True)
class Cost:
    """Seconds of one operation as a function of the elements it handles: through the
    measured points (``measured``: (elements, seconds), sizes ascending) piecewise
    linearly, beyond the largest along the last two points' slope, below the smallest
    along the fitted line, never below 0; ``a + b * elements`` where nothing was measured
    (a hand-written model)."""

    a: float
    b: float
    points: tuple[tuple[float, float], ...] = ()

    def __call__(self, elements: float) -> float:
        points = self.points
        if len(points) < 2 or elements <= points[0][0]:
            if points and elements <= points[0][0]:
                return min(points[0][1], max(0.0, self.a + self.b * elements))
            return self.a + self.b * elements
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if elements <= n1:
                break
        return max(0.0, t0 + (t1 - t0) * (elements - n0) / (n1 - n0))


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _pair(value: Any, where: str) -> Cost:
    if isinstance(value, Mapping) and set(value) >= {"a", "b"}:
        a, b = value["a"], value["b"]
    else:
        raise CostModelError(f"{where}: expected {{\"a\": seconds, \"b\": seconds per element}}, got {value!r}")
    for name, number in (("a", a), ("b", b)):
        if not _number(number):
            raise CostModelError(f"{where}: {name} must be a finite number >= 0, got {number!r}")
    measured = value.get("measured", [])
    if not isinstance(measured, list) or any(
            not isinstance(p, (list, tuple)) or len(p) != 2 or not all(map(_number, p)) for p in measured):
        raise CostModelError(f"{where}: measured must be a list of [elements, seconds] pairs >= 0")
    sizes = [p[0] for p in measured]
    if any(n1 <= n0 for n0, n1 in zip(sizes, sizes[1:])):
        raise CostModelError(f"{where}: measured sizes must increase")
    return Cost(float(a), float(b), tuple((float(n), float(t)) for n, t in measured))


@dataclass(frozen=True)
class CostModel:
    """``codecs[codec][bits][operation]`` and ``operations[name]``: a :class:`Cost` each.
    ``document`` is the JSON it was read from (what a trace records)."""

    codecs: Mapping[str, Mapping[int, Mapping[str, Cost]]]
    operations: Mapping[str, Cost]
    document: Mapping[str, Any]
    source: str = "<dict>"
    #: ``policies[id] = (a, b)``: a policy's decision per iteration, averaged over many
    #: iterations (the periodic ones included), b per quantized element; optional.
    policies: Mapping[str, Cost] = None  # type: ignore[assignment]

    # ---- reading ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CostModelError(f"cost model {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CostModelError(f"cannot read cost model {path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CostModelError(f"cost model {path} is not JSON: {exc}") from None
        return cls.from_dict(document, source=str(path))

    @classmethod
    def from_dict(cls, document: Any, source: str = "<dict>") -> "CostModel":
        """The model of a JSON document (a file's, or a trace's ``cost_model`` attribute)."""
        where = f"cost model {source}"
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            raise CostModelError(f"{where}: not a cost model (no \"format\": \"{FORMAT}\"; write one with "
                                 "mpigrad bench calibrate)")
        if document.get("version") != VERSION:
            raise CostModelError(f"{where}: version {document.get('version')!r}, this mpigrad reads version {VERSION}")
        raw_codecs, raw_ops = document.get("codecs"), document.get("operations")
        if not isinstance(raw_codecs, Mapping) or not raw_codecs:
            raise CostModelError(f"{where}: \"codecs\" must be a non-empty table of codec -> bits -> operation")
        if not isinstance(raw_ops, Mapping):
            raise CostModelError(f"{where}: \"operations\" must be a table of {', '.join(OPERATIONS)}")
        codecs: dict[str, dict[int, dict[str, Cost]]] = {}
        for codec, widths in raw_codecs.items():
            if not isinstance(widths, Mapping) or not widths:
                raise CostModelError(f"{where}: codecs.{codec} must be a non-empty table of bits -> operation")
            codecs[codec] = {}
            for bits, ops in widths.items():
                if not str(bits).isdigit():
                    raise CostModelError(f"{where}: codecs.{codec}: width {bits!r} is not a whole number of bits")
                if not isinstance(ops, Mapping) or any(op not in ops for op in CODEC_OPERATIONS):
                    raise CostModelError(f"{where}: codecs.{codec}.{bits} must give {', '.join(CODEC_OPERATIONS)}")
                codecs[codec][int(bits)] = {op: _pair(ops[op], f"{where}: codecs.{codec}.{bits}.{op}")
                                            for op in CODEC_OPERATIONS}
        if FLOAT32[0] not in codecs:
            raise CostModelError(f"{where}: no costs for fp32, which every run's unquantized layers use")
        missing = [op for op in OPERATIONS if op not in raw_ops]
        if missing:
            raise CostModelError(f"{where}: operations lacks {', '.join(missing)}")
        operations = {op: _pair(raw_ops[op], f"{where}: operations.{op}") for op in OPERATIONS}
        raw_policies = document.get("policies", {})
        if not isinstance(raw_policies, Mapping):
            raise CostModelError(f"{where}: \"policies\" must be a table of policy -> {{\"a\", \"b\"}}")
        policies = {name: _pair(fit, f"{where}: policies.{name}") for name, fit in raw_policies.items()}
        return cls(codecs, operations, json.loads(json.dumps(document)), source, policies)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.document))

    def check_codec(self, codec: str) -> None:
        """CostModelError unless the model has costs for ``codec``."""
        if codec not in self.codecs:
            raise CostModelError(f"cost model {self.source} has no costs for codec {codec!r} (it has "
                                 f"{', '.join(sorted(self.codecs))}): calibrate it with mpigrad bench calibrate "
                                 f"--codecs {codec}, or run with --cost-model none")

    @property
    def machine(self) -> str:
        """The machine the model was measured on, in words."""
        machine = self.document.get("machine") or {}
        return str(machine.get("cpu") or "an unnamed machine")

    # ---- evaluating ---------------------------------------------------------------------
    def seconds(self, codec: str, bits: int, operation: str, elements: int) -> float:
        """``a + b * elements`` of ``operation`` by ``codec`` at ``bits``; a width the model
        lacks takes the nearest measured one (the wider on a tie)."""
        widths = self.codecs[codec]
        fit = widths.get(bits)
        if fit is None:
            fit = widths[min(widths, key=lambda w: (abs(w - bits), -w))]
        return fit[operation](elements)

    def operation(self, name: str, elements: int) -> float:
        return self.operations[name](elements)

    def policy(self, name: str, elements: int) -> float:
        """Policy ``name``'s decision per iteration for ``elements`` quantized elements; 0 for
        a policy the model lacks (a plugin's: ``charges_policy`` says so)."""
        fit = (self.policies or {}).get(name)
        return 0.0 if fit is None else fit(elements)

    def charges_policy(self, name: str) -> bool:
        return name in (self.policies or {})


@dataclass(frozen=True)
class LocalWork:
    """What one iteration's local work handles, for the cost model.

    ``shards[s]``: server s's pieces as (quantized layer, elements), layer -1 for the
    float32 piece; workers encode every shard, server s decodes its shard's P frames (the
    first into the sum, the others added to it), averages and re-encodes it, and every
    rank decodes every shard's broadcast. ``codec_bits``/``down_bits``: the workers' and
    the broadcast's fixed widths, None where they follow the policy's bits per layer.
    ``feedback``: the error-feedback mode (``none``, ``residual``, ``accumulate``), which
    applies to the workers' encode and the servers' re-encode. ``policy``: the bit policy's
    id, whose decision rank 0 makes before the gradients are sent. ``slices``: the
    hierarchical exchange's L workers per node (1: the flat exchange): a worker of local rank
    j encodes and decodes only the shards s with s % L == j, a server decodes the N = P / L
    frames of its local rank's workers, and a worker's reduce-scatter adds L float32 slices.
    """

    workers: int
    codec: str
    codec_bits: int | None
    down_codec: str
    down_bits: int | None
    feedback: str
    shards: tuple[tuple[tuple[int, int], ...], ...]
    policy: str = ""
    slices: int = 1

    def seconds(self, model: CostModel, bits: Sequence[int]) -> float:
        """Local work on the simulated clock: rank 0's policy decision, the slowest worker's
        encode (all alike in the model), then the slowest server's decode, average and
        re-encode, then the decode of the broadcast (the workers' and rank 0's at once), as
        ``iteration_seconds`` orders measured local work."""
        bits = [int(b) for b in bits]

        def up(layer: int) -> tuple[str, int]:
            if layer < 0:
                return FLOAT32
            return self.codec, self.codec_bits if self.codec_bits is not None else bits[layer]

        def down(layer: int) -> tuple[str, int]:
            if layer < 0:
                return FLOAT32
            return self.down_codec, self.down_bits if self.down_bits is not None else bits[layer]

        def encode(layer: int, n: int, key: tuple[str, int]) -> float:
            t = model.seconds(*key, "encode", n)
            if layer >= 0 and self.feedback != "none":
                t += model.seconds(*key, "decode", n) + model.operation(f"feedback:{self.feedback}", n)
            return t

        L = self.slices
        slices = [[shard for s, shard in enumerate(self.shards) if s % L == j] for j in range(L)]
        worker = 0.0  # the slowest local rank's (all of them with one slice)
        for shards in slices:
            t = 0.0
            for shard in shards:
                for layer, n in shard:
                    t += encode(layer, n, up(layer))
                    if L > 1:  # the node's L slices added, and their mean
                        t += (L - 1) * model.seconds(*FLOAT32, "accumulate", n) + model.operation("average", n)
            worker = max(worker, t)
        contributors = self.workers // L
        server = 0.0
        for shard in self.shards:
            t = 0.0
            for layer, n in shard:
                key = up(layer)
                t += model.seconds(*key, "decode", n) + (contributors - 1) * model.seconds(*key, "accumulate", n)
            for layer, n in shard:
                t += model.operation("average", n)
            for layer, n in shard:
                t += encode(layer, n, down(layer))
            server = max(server, t)
        broadcast = 0.0
        for shards in slices:
            t = 0.0  # added one by one (sum() compensates from Python 3.12: not the same float)
            for shard in shards:
                for layer, n in shard:
                    t += model.seconds(*down(layer), "decode", n)
            broadcast = max(broadcast, t)
        policy = model.policy(self.policy, self.quantized) if self.policy else 0.0
        return policy + worker + server + broadcast

    @property
    def quantized(self) -> int:
        """Quantized elements: what a policy's decision is charged by."""
        return sum(n for shard in self.shards for layer, n in shard if layer >= 0)

    def check(self, model: CostModel) -> None:
        """CostModelError unless ``model`` has costs for every codec this work uses."""
        model.check_codec(self.codec)
        model.check_codec(self.down_codec)

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "codec": self.codec, "codec_bits": self.codec_bits,
                "down_codec": self.down_codec, "down_bits": self.down_bits, "feedback": self.feedback,
                "shards": [[list(piece) for piece in shard] for shard in self.shards], "policy": self.policy,
                "slices": self.slices}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LocalWork":
        try:
            return cls(int(data["workers"]), str(data["codec"]),
                       None if data["codec_bits"] is None else int(data["codec_bits"]),
                       str(data["down_codec"]), None if data["down_bits"] is None else int(data["down_bits"]),
                       str(data["feedback"]),
                       tuple(tuple((int(layer), int(n)) for layer, n in shard) for shard in data["shards"]),
                       str(data.get("policy", "")), int(data.get("slices", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CostModelError(f"malformed local_work record: {exc}") from None


def fit_linear(elements: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` >= 0 of ``seconds = a + b * elements``, least squares on relative errors
    (each point weighted by 1 / seconds, so that small sizes count as much as large ones);
    where the best line has a < 0 (or b < 0), the best line with that coefficient 0."""
    xs = [float(x) for x in elements]
    ys = [float(y) for y in seconds]
    if len(xs) != len(ys) or len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("fit_linear needs at least two different element counts")
    if any(y <= 0 or not math.isfinite(y) for y in ys):
        raise ValueError("fit_linear needs positive, finite times")
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    sy = sum(w * y for w, y in zip(ws, ys))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys))
    det = sw * sxx - sx * sx
    a = (sxx * sy - sx * sxy) / det
    b = (sw * sxy - sx * sy) / det
    if a < 0:
        a, b = 0.0, sxy / sxx
    if b < 0:
        a, b = sy / sw, 0.0
    return a, b
