"""The device path behind the runtime's interfaces (issue 61 items 3 and 8): the host and device
compressors driven through :class:`~mpigrad.runtime.exchange.frames.FrameCompressor` alone give
the same frames, values and state; the warm-up asks only the device codecs' public names; the
counters are the runtime's (mpigrad/counters.py); device.py split into device_*.py modules, each
within the runtime's sizes, with the names other modules import from device.py still there."""

from __future__ import annotations

import ast
import os
import pathlib

import numpy as np
import pytest
import torch

import mpigrad.codecs.device as device_codecs
from mpigrad.codecs import get_codec
from mpigrad.feedback import ErrorFeedback
from mpigrad.runtime.exchange import device as device_module
from mpigrad.runtime.exchange.compressor import GradientCompressor
from mpigrad.runtime.exchange.frames import FrameCompressor, PendingFrames
from mpigrad.runtime.plan.layout import Layout, Segment, pieces_of, plan_shards

REPO = pathlib.Path(__file__).resolve().parents[1]
EXCHANGE = REPO / "mpigrad" / "runtime" / "exchange"
DEVICE = torch.device("cuda" if os.environ.get("MPIGRAD_TEST_GPU") == "1" else "cpu")
SMALL = Layout((Segment("conv", 0, 300), Segment("fc", 300, 200)), Segment("small layers", 500, 40), 540)


def _pair(config, feedback=None):
    pieces = pieces_of(SMALL, 0)
    shards = plan_shards(SMALL, 2, lambda p: p.size, 0)
    seeds = {p.index: 7 + p.index for p in pieces if p.quantized}

    def make():
        return GradientCompressor(pieces, get_codec(config), seeds, ErrorFeedback(feedback) if feedback else None)

    return make(), device_module.DeviceGradientCompressor(make(), DEVICE), shards


def _values(compressor: FrameCompressor, array: np.ndarray):
    """``array`` where ``compressor`` takes its values (``device``: None, host arrays)."""
    return array.copy() if compressor.device is None else torch.from_numpy(array.copy()).to(compressor.device)


def _host(values) -> np.ndarray:
    return values.cpu().numpy() if isinstance(values, torch.Tensor) else values


def _a_role(compressor: FrameCompressor, shards, grads) -> dict:
    """What a role does with a compressor, knowing only the protocol."""
    seen = {"frames": [], "decoded": []}
    for it, g in enumerate(grads):
        bits = [2 + it, 4]
        grad = _values(compressor, g)
        seen["frames"].append(compressor.encode(grad, bits, shards[0]).copy())
        seen["frames"] += [frame.copy() for frame in compressor.encode_shards(grad, bits, shards)]
        pending = compressor.queue_shards(grad, bits, shards)
        assert isinstance(pending, PendingFrames)
        pending.wait()
        assert pending.ready()
        frames = [frame.copy() for frame in pending.frames()]
        seen["frames"] += frames
        out = _values(compressor, np.zeros(SMALL.total, np.float32))
        for shard, frame in zip(shards, frames):
            assert compressor.decode(frame, shard, out) >= 0.0
            compressor.decode(frame, shard, out, accumulate=True)
        seen["decoded"].append(_host(out).copy())
        nothing = compressor.queue_shards(grad, bits, [])
        assert nothing.ready() and nothing.frames() == []
    seen["state"] = compressor.state_dict()
    return seen


@pytest.mark.parametrize("config, feedback", [
    ({"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1}, "residual"),
    ({"id": "fp16"}, None),
])
def test_a_role_cannot_tell_the_host_compressor_from_the_device_one(config, feedback):
    host, device, shards = _pair(config, feedback)
    assert isinstance(host, FrameCompressor) and isinstance(device, FrameCompressor)
    assert host.device is None and host.frame_memory is None
    assert device.device == DEVICE and isinstance(device.frame_memory, device_module.FrameMemory)
    rng = np.random.default_rng(3)
    grads = [(rng.standard_normal(SMALL.total) * 0.01).astype(np.float32) for _ in range(2)]
    ours, theirs = _a_role(device, shards, grads), _a_role(host, shards, grads)
    assert len(ours["frames"]) == len(theirs["frames"])
    assert all(np.array_equal(a, b) for a, b in zip(ours["frames"], theirs["frames"]))
    assert all(np.array_equal(a, b) for a, b in zip(ours["decoded"], theirs["decoded"]))
    assert ours["state"]["calls"] == theirs["state"]["calls"]
    # Each loads the other's state and continues with the same frames.
    fresh_host, fresh_device, _ = _pair(config, feedback)
    fresh_host.load_state_dict(ours["state"])
    fresh_device.load_state_dict(theirs["state"])
    g = _values(fresh_host, grads[0])
    assert np.array_equal(fresh_device.encode(_values(fresh_device, grads[0]), [3, 4], shards[1]),
                          fresh_host.encode(g, [3, 4], shards[1]))


def _imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names) of every import in ``path``, lazy ones included."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


@pytest.mark.quick
def test_the_warm_up_asks_the_device_codecs_public_interface_only():
    for module, names in _imports(EXCHANGE / "warmup.py"):
        if module.startswith("mpigrad.codecs.device"):
            assert module == "mpigrad.codecs.device", f"warmup.py imports {module}, a device codecs' internal"
            assert set(names) <= set(device_codecs.__all__), f"warmup.py imports {names} not in __all__"
            assert not any(name.startswith("_") for name in names)
    assert callable(device_codecs.warm_up_kernels) and "warm_up_kernels" in device_codecs.__all__


@pytest.mark.quick
def test_the_counters_are_the_runtimes_interface_not_the_device_codecs():
    inside = REPO / "mpigrad" / "codecs" / "device"
    assert not (inside / "counters.py").exists()
    for path in (REPO / "mpigrad").rglob("*.py"):
        if inside in path.parents:
            continue
        for module, names in _imports(path):
            assert "mpigrad.codecs.device.counters" not in (module, *(f"{module}.{n}" for n in names)), path


@pytest.mark.quick
def test_the_names_imported_from_device_py_are_still_there_and_are_the_submodules_own():
    from mpigrad.runtime.exchange import device_feedback, device_memory, device_stream, device_tables

    for module in (device_stream, device_memory, device_feedback, device_tables):
        for name in module.__all__:
            assert getattr(module, name) is getattr(device_module, name), (module.__name__, name)
    for name in ("on_device", "check_decodes", "finite", "codec_path", "current_stream", "device_view",
                 "synchronize", "simulated_stream", "simulated", "device_path", "load_cuda", "DeviceStatus",
                 "FrameMemory", "DeviceGradientCompressor", "QueuedFrames", "ENVIRONMENT"):
        assert name in device_module.__all__ and hasattr(device_module, name), name


@pytest.mark.quick
def test_the_device_modules_keep_the_runtimes_sizes_and_say_what_lives_there():
    """Issue 61 item 8 for the device path: no file over 600 lines, no class over 300, no
    function over 80; each module's docstring says what lives there."""
    paths = sorted(EXCHANGE.glob("device*.py"))
    assert {p.name for p in paths} >= {"device.py", "device_stream.py", "device_memory.py",
                                       "device_feedback.py", "device_tables.py"}
    for path in paths:
        text = path.read_text()
        assert len(text.splitlines()) <= 600, path.name
        tree = ast.parse(text)
        assert ast.get_docstring(tree), path.name
        for node in ast.walk(tree):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef):
                assert size <= 300, f"{path.name}: class {node.name} is {size} lines"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert size <= 80, f"{path.name}: {node.name} is {size} lines"
