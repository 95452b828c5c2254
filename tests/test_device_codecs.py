"""The device codecs (mpigrad.codecs.device) against their host twins.

In CI the CUDA kernels run in Numba's simulator (conftest sets NUMBA_ENABLE_CUDASIM=1);
with MPIGRAD_TEST_GPU=1 on a GPU machine the same tests run the compiled kernels, and the
``cuda`` tests below (torch CUDA tensors, fused multiply-adds) run too. Sizes are small
(the simulator runs every thread in Python) but cross every boundary the kernels have:
a full block of 4096 codes, a tail, several buckets, a bucket straddling blocks.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mpigrad.codecs import CodecError, get_codec
from mpigrad.codecs.device import DEVICE_CODECS, DeviceUnavailable, device_codec, load_cuda

# The simulator runs the kernels' uint64 hashes and casts as NumPy scalars, which warn.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")]

cuda = load_cuda()

SIZES = (1, 37, 4096, 9000)
CONFIGS = [
    {"id": "fp32"},
    {"id": "fp16"},
    {"id": "uniform", "bits": 1, "bucket_size": 1000},
    {"id": "uniform", "bits": 3},
    {"id": "uniform", "bits": 5, "bucket_size": 512},
    {"id": "uniform", "bits": 8, "bucket_size": 3000},
    {"id": "uniform", "bits": 2, "rounding": "stochastic", "seed": 11, "bucket_size": 700},
    {"id": "uniform", "bits": 7, "rounding": "stochastic", "seed": 3},
]
SIGN_CONFIGS = [{"id": "sign"}, {"id": "sign", "bucket_size": 300}]


def gradient(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)
    x[::97] = 0.0  # exact zeros and repeated values: ties at the rounding points
    return x


def device_frame(codec, x: np.ndarray) -> np.ndarray:
    dev = device_codec(codec)
    out = cuda.device_array(dev.max_encoded_size(x.size), np.uint8)
    n = dev.encode(cuda.to_device(x), out)
    return out.copy_to_host()[:n]


def device_decode(codec, frame: np.ndarray, start: np.ndarray, accumulate: bool) -> np.ndarray:
    out = cuda.to_device(start)
    device_codec(codec).decode(frame, out, accumulate=accumulate)
    return out.copy_to_host()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("n", SIZES)
def test_device_frames_are_the_host_frames_byte_for_byte(config, n):
    x = gradient(n, n)
    host, dev_codec = get_codec(config), get_codec(config)
    for _ in range(2):  # stochastic codecs: the second call draws from the next counter
        assert np.array_equal(device_frame(dev_codec, x), host.encode(x))
    assert dev_codec.state_dict() == host.state_dict()


@pytest.mark.parametrize("config", CONFIGS + SIGN_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("accumulate", [False, True])
def test_device_decode_of_a_host_frame_is_the_host_decode(config, accumulate):
    codec = get_codec(config)
    x = gradient(9000, 1)
    frame = codec.encode(x)
    start = gradient(9000, 2)
    want = start.copy()
    codec.decode(frame, want, accumulate=accumulate)
    assert np.array_equal(device_decode(codec, frame, start, accumulate), want)


@pytest.mark.parametrize("config", SIGN_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("n", SIZES)
def test_device_sign_agrees_within_float_noise(config, n):
    """Same sign bits; each bucket's scale (mean |g|, summed in another order) within a few
    float32 ulps of the host's. The frame decodes on the host."""
    x = gradient(n, 7 + n)
    codec = get_codec(config)
    ours, theirs = device_frame(codec, x), codec.encode(x)
    nb = -(-n // (config.get("bucket_size") or n))
    head = 40 + 4 * nb
    assert np.array_equal(ours[:40], theirs[:40]) and np.array_equal(ours[head:], theirs[head:])
    np.testing.assert_allclose(ours[40:head].view(np.float32), theirs[40:head].view(np.float32), rtol=4e-7)
    np.testing.assert_allclose(codec.decode(ours), codec.decode(theirs), rtol=4e-7)


@pytest.mark.parametrize("config", CONFIGS + SIGN_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_device_encode_refuses_what_the_host_refuses(config):
    x = gradient(5000, 3)
    x[4500] = np.nan
    codec = get_codec(config)
    with pytest.raises(CodecError) as host:
        codec.encode(x)
    with pytest.raises(CodecError) as dev:
        device_frame(get_codec(config), x)
    assert str(dev.value) == str(host.value)


def test_device_fp16_refuses_values_beyond_its_range():
    x = np.array([1.0, 70000.0], np.float32)
    with pytest.raises(CodecError, match="exceeds the format's range"):
        device_frame(get_codec({"id": "fp16"}), x)


def test_device_uniform_refuses_a_span_beyond_float32():
    x = np.array([-3e38, 3e38, 0.0], np.float32)
    with pytest.raises(CodecError, match="exceeds the float32 range"):
        device_frame(get_codec({"id": "uniform", "bits": 4}), x)


@pytest.mark.parametrize("config", [{"id": "uniform", "bits": 4, "bucket_size": 100}, {"id": "sign", "bucket_size": 100}])
def test_device_accumulate_leaves_out_untouched_on_a_corrupt_scale(config):
    codec = get_codec(config)
    frame = codec.encode(gradient(300, 4)).copy()
    frame[40:44] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # the first scale
    start = gradient(300, 5)
    with pytest.raises(CodecError):
        codec.decode(frame, start.copy(), accumulate=True)  # the host refuses it too
    out = cuda.to_device(start)
    with pytest.raises(CodecError, match="corrupted payload"):
        device_codec(codec).decode(frame, out, accumulate=True)
    assert np.array_equal(out.copy_to_host(), start)


def test_device_decode_checks_the_frame_on_the_host_first():
    codec = get_codec({"id": "uniform", "bits": 4})
    frame = codec.encode(gradient(100, 6))
    out = cuda.to_device(np.zeros(100, np.float32))
    with pytest.raises(CodecError, match="truncated or padded"):
        device_codec(codec).decode(frame[:-1], out)
    with pytest.raises(CodecError, match="encoded by codec 'uniform', not 'sign'"):
        device_codec(get_codec({"id": "sign"})).decode(frame, out)
    with pytest.raises(CodecError, match="holds 99 elements"):
        device_codec(codec).decode(frame, cuda.to_device(np.zeros(99, np.float32)))


def test_device_codecs_refuse_what_they_cannot_do():
    with pytest.raises(CodecError, match="has no GPU kernels .*fp16, fp32, sign, uniform"):
        device_codec(get_codec({"id": "qsgd", "bits": 4}))
    with pytest.raises(CodecError, match="checksum=True"):
        device_codec(get_codec({"id": "uniform", "checksum": True}))
    dev = device_codec(get_codec({"id": "fp32"}))
    with pytest.raises(CodecError, match="must be a CUDA array"):
        dev.encode(np.zeros(3, np.float32), cuda.device_array(100, np.uint8))
    with pytest.raises(CodecError, match="holds 50 bytes, encode may need 52"):
        dev.encode(cuda.to_device(np.zeros(3, np.float32)), cuda.device_array(50, np.uint8))
    assert set(DEVICE_CODECS) == {"fp32", "fp16", "uniform", "sign"}


def test_empty_input_gives_the_host_frame():
    for config in CONFIGS[:4]:
        codec = get_codec(config)
        dev = device_codec(codec)
        out = cuda.device_array(dev.max_encoded_size(0), np.uint8)
        n = dev.encode(cuda.to_device(np.zeros(0, np.float32)), out)
        got = out.copy_to_host()[:n]
        assert np.array_equal(got, codec.encode(np.zeros(0, np.float32)))


def test_a_missing_numba_cuda_is_one_line_naming_the_extra(monkeypatch):
    import numba

    monkeypatch.delattr(numba, "cuda")
    monkeypatch.setitem(sys.modules, "numba.cuda", None)  # what a failed import leaves
    with pytest.raises(DeviceUnavailable) as exc:
        load_cuda()
    assert 'pip install -e ".[cuda]"' in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.cuda
def test_device_codecs_take_torch_cuda_tensors_without_a_copy():
    import torch

    x = torch.from_numpy(gradient(1 << 20, 8)).cuda()
    codec = get_codec({"id": "uniform", "bits": 8, "bucket_size": 512})
    dev = device_codec(codec)
    out = torch.empty(dev.max_encoded_size(x.numel()), dtype=torch.uint8, device="cuda")
    n = dev.encode(x, out)
    assert np.array_equal(out[:n].cpu().numpy(), codec.encode(x.cpu().numpy()))
    acc = torch.ones_like(x)
    dev.decode(out[:n].cpu().numpy(), acc, accumulate=True)
    want = np.ones(x.numel(), np.float32)
    codec.decode(out[:n].cpu().numpy(), want, accumulate=True)
    assert np.array_equal(acc.cpu().numpy(), want)
