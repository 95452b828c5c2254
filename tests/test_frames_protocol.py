"""runtime/exchange/frames.py: the host and device compressors implement one protocol, and the host's
already-encoded frames are a PendingFrames that needs no wait."""

import inspect

import numpy as np
import pytest

from mpigrad.runtime.exchange.compressor import GradientCompressor
from mpigrad.runtime.exchange.device import DeviceGradientCompressor
from mpigrad.runtime.exchange.frames import EncodedFrames, FrameCompressor, PendingFrames

pytestmark = pytest.mark.quick


def _protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("compressor", [GradientCompressor, DeviceGradientCompressor])
def test_both_compressors_implement_every_method_of_the_protocol_with_its_parameters(compressor):
    for name, signature in _protocol_methods(FrameCompressor).items():
        method = getattr(compressor, name, None)
        assert callable(method), f"{compressor.__name__} lacks {name}"
        theirs = inspect.signature(method).parameters
        for parameter in signature.parameters.values():
            assert parameter.name in theirs, f"{compressor.__name__}.{name} lacks {parameter.name}"
            assert theirs[parameter.name].kind == parameter.kind, (compressor.__name__, name, parameter.name)
    assert {"pieces", "device", "frame_memory"} <= set(FrameCompressor.__annotations__)


def test_frames_done_at_the_call_are_pending_frames_that_need_no_wait():
    frames = [np.zeros(3, np.uint8), np.ones(2, np.uint8)]
    done = EncodedFrames(frames)
    assert isinstance(done, PendingFrames) and done.ready()
    done.wait()
    assert done.frames() == frames
