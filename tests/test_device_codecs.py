"""The device codecs (mpigrad.codecs.device) against their host twins.

In CI the CUDA kernels run in Numba's simulator (conftest sets NUMBA_ENABLE_CUDASIM=1);
with MPIGRAD_TEST_GPU=1 on a GPU machine the same tests run the compiled kernels, and the
``cuda`` tests below (torch CUDA tensors, fused multiply-adds) run too. Sizes are small
(the simulator runs every thread in Python) but cross every boundary the kernels have:
a full block of 4096 codes, a tail, several buckets, a bucket straddling blocks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mpigrad.codecs import CodecError, get_codec
from mpigrad.codecs.device import DEVICE_CODECS, DeviceUnavailable, device_codec, load_cuda

# The simulator runs the kernels' uint64 hashes and casts as NumPy scalars, which warn (and
# float ones, on the scratch scales that a refused input leaves unwritten).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in:RuntimeWarning")]

cuda = load_cuda()

SIZES = (1, 37, 4200)  # 4200: a full block of 4096 codes and a tail
#: Past the first full block (a block's bytes at ``pos + k * bits * GROUPS``, k > 0): a few configs.
BLOCKS = 8300
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
# Bit-identical: scales from max |g| (QSGD's max norm; TernGrad without its clip).
QSGD_MAX = {"id": "qsgd", "bits": 4, "seed": 5}  # buckets of 512
QSGD_LEVELS = {"id": "qsgd", "levels": 5, "bucket_size": 1000}  # s below the 4-bit codes' 7
TERNGRAD_MAX = {"id": "terngrad", "clip": 0, "bucket_size": 700, "seed": 2}
# Within float noise: scales from float64 sums (TernGrad's 2.5 sigma clip, QSGD's l2 norm).
TERNGRAD = {"id": "terngrad", "seed": 9}
TERNGRAD_BUCKETS = {"id": "terngrad", "bucket_size": 500}
QSGD_L2 = {"id": "qsgd", "bits": 3, "norm": "l2", "bucket_size": 2000}
SCALED_CONFIGS = [QSGD_MAX, QSGD_LEVELS, TERNGRAD_MAX, TERNGRAD, TERNGRAD_BUCKETS, QSGD_L2]


def gradient(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)
    x[::97] = 0.0  # exact zeros and repeated values: ties at the rounding points
    return x


def config_id(config) -> str:
    return "-".join(str(v) for v in config.values())


def device_frame(codec, x: np.ndarray) -> np.ndarray:
    dev = device_codec(codec)
    out = cuda.device_array(dev.max_encoded_size(x.size), np.uint8)
    n = dev.encode(cuda.to_device(x), out)
    return out.copy_to_host()[:n]


def device_decode(codec, frame: np.ndarray, start: np.ndarray, accumulate: bool) -> np.ndarray:
    out = cuda.to_device(start)
    device_codec(codec).decode(frame, out, accumulate=accumulate)
    return out.copy_to_host()


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("n", SIZES)
def test_device_frames_are_the_host_frames_byte_for_byte(config, n):
    x = gradient(n, n)
    host, dev_codec = get_codec(config), get_codec(config)
    for _ in range(2):  # stochastic codecs: the second call draws from the next counter
        assert np.array_equal(device_frame(dev_codec, x), host.encode(x))
    assert dev_codec.state_dict() == host.state_dict()


@pytest.mark.parametrize("config", [CONFIGS[4], CONFIGS[6], SIGN_CONFIGS[1]], ids=config_id)
def test_device_frames_past_the_first_block_are_the_host_frames(config):
    x = gradient(BLOCKS, 5)
    ours = device_frame(get_codec(config), x)
    theirs = get_codec(config).encode(x)
    if config["id"] == "sign":  # its scales within float noise (below); its codes the host's
        ours, theirs = ours[40 + 4 * -(-BLOCKS // 300):], theirs[40 + 4 * -(-BLOCKS // 300):]
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("config", CONFIGS + SIGN_CONFIGS + SCALED_CONFIGS, ids=config_id)
@pytest.mark.parametrize("accumulate", [False, True])
def test_device_decode_of_a_host_frame_is_the_host_decode(config, accumulate):
    codec = get_codec(config)
    x = gradient(BLOCKS, 1)
    frame = codec.encode(x)
    start = gradient(BLOCKS, 2)
    want = start.copy()
    codec.decode(frame, want, accumulate=accumulate)
    assert np.array_equal(device_decode(codec, frame, start, accumulate), want)


@pytest.mark.parametrize("config", SIGN_CONFIGS, ids=config_id)
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


@pytest.mark.parametrize("config, n", [
    (QSGD_MAX, 1), (QSGD_MAX, 37), (QSGD_MAX, BLOCKS),
    (QSGD_LEVELS, 37), (QSGD_LEVELS, 5000), (TERNGRAD_MAX, 1), (TERNGRAD_MAX, 4096),
], ids=lambda v: str(v) if isinstance(v, int) else config_id(v))
def test_device_qsgd_and_unclipped_terngrad_frames_are_the_host_frames(config, n):
    """Scales from max |g| (an integer max of bit patterns) and the host's draws: the same
    frames byte for byte, over two calls (two streams), and the same call counter."""
    x = gradient(n, 20 + n)
    host, dev_codec = get_codec(config), get_codec(config)
    for _ in range(2):
        assert np.array_equal(device_frame(dev_codec, x), host.encode(x))
    assert dev_codec.state_dict() == host.state_dict() == {"calls": 2}


@pytest.mark.parametrize("config, n", [(TERNGRAD, 37), (TERNGRAD, 4096), (TERNGRAD_BUCKETS, 2000),
                                       (QSGD_L2, 1), (QSGD_L2, 4200)],
                         ids=lambda v: str(v) if isinstance(v, int) else config_id(v))
def test_device_clipped_terngrad_and_l2_qsgd_agree_within_float_noise(config, n):
    """Scales from float64 sums taken in another order: the same header and codes (the
    same draws against the same scales), each scale within a few float32 ulps of the
    host's, over two calls; the frame decodes on the host."""
    x = gradient(n, 30 + n)
    x[:n // 3] += np.float32(0.01)  # a mean for the variance to subtract
    host, dev_codec = get_codec(config), get_codec(config)
    nb = -(-n // (config.get("bucket_size") or n))
    head = 40 + 4 * nb
    for _ in range(2):
        ours, theirs = device_frame(dev_codec, x), host.encode(x)
        assert ours.size == theirs.size
        assert np.array_equal(ours[:40], theirs[:40]) and np.array_equal(ours[head:], theirs[head:])
        ours_scales, their_scales = ours[40:head].view(np.float32), theirs[40:head].view(np.float32)
        assert np.all(np.abs(ours_scales.view(np.int32) - their_scales.view(np.int32)) <= 4)  # ulps
        np.testing.assert_allclose(host.decode(ours), host.decode(theirs), rtol=5e-7)
    if config["id"] == "terngrad":  # the clip is on: some scale is below max |g|
        assert np.any(their_scales < np.abs(x).max())
    assert dev_codec.state_dict() == host.state_dict() == {"calls": 2}


@pytest.mark.parametrize("config", CONFIGS + SIGN_CONFIGS + [QSGD_MAX, TERNGRAD, QSGD_L2], ids=config_id)
def test_device_encode_refuses_what_the_host_refuses(config):
    x = gradient(5000, 3)
    x[4500] = np.nan
    codec, ours = get_codec(config), get_codec(config)
    with pytest.raises(CodecError) as host:
        codec.encode(x)
    with pytest.raises(CodecError) as dev:
        device_frame(ours, x)
    assert str(dev.value) == str(host.value)
    assert ours.state_dict() == codec.state_dict()  # a refused input draws no stream


def test_device_fp16_refuses_values_beyond_its_range():
    x = np.array([1.0, 70000.0], np.float32)
    with pytest.raises(CodecError, match="exceeds the format's range"):
        device_frame(get_codec({"id": "fp16"}), x)


def test_device_uniform_refuses_a_span_beyond_float32():
    x = np.array([-3e38, 3e38, 0.0], np.float32)
    with pytest.raises(CodecError, match="exceeds the float32 range"):
        device_frame(get_codec({"id": "uniform", "bits": 4}), x)


def corrupt_scale(frame: np.ndarray) -> None:
    frame[40:44] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # the first scale


def corrupt_terngrad_code(frame: np.ndarray) -> None:
    frame[-3] |= 0x30  # a code 3 (in the tail's bit stream)


def corrupt_qsgd_level(frame: np.ndarray) -> None:
    frame[-3] |= 0x70  # level 7 > s = 5 (4-bit codes, level in the low three bits)


@pytest.mark.parametrize("config, corrupt", [
    ({"id": "uniform", "bits": 4, "bucket_size": 100}, corrupt_scale),
    ({"id": "sign", "bucket_size": 100}, corrupt_scale),
    ({"id": "terngrad", "bucket_size": 100}, corrupt_scale),
    ({"id": "qsgd", "bits": 4, "bucket_size": 100}, corrupt_scale),
    ({"id": "terngrad", "bucket_size": 100}, corrupt_terngrad_code),
    ({"id": "qsgd", "levels": 5, "bucket_size": 100}, corrupt_qsgd_level),
], ids=lambda v: v.__name__ if callable(v) else config_id(v))
@pytest.mark.parametrize("accumulate", [False, True])
def test_device_decode_refuses_a_corrupt_payload_before_writing(config, corrupt, accumulate):
    """Refused in the host's words, and ``out`` untouched (the host's decode may have
    written it before it refuses a code; the device checks every code first)."""
    codec = get_codec(config)
    frame = codec.encode(gradient(300, 4)).copy()
    corrupt(frame)
    start = gradient(300, 5)
    with pytest.raises(CodecError) as host:
        codec.decode(frame, start.copy(), accumulate=accumulate)
    out = cuda.to_device(start)
    with pytest.raises(CodecError) as dev:
        device_codec(codec).decode(frame, out, accumulate=accumulate)
    assert "corrupted payload" in str(dev.value) and str(dev.value) == str(host.value)
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
    with pytest.raises(CodecError, match="has no GPU kernels .*fp16, fp32, qsgd, sign, terngrad, uniform"):
        device_codec(get_codec({"id": "mcgq"}))
    with pytest.raises(CodecError) as exc:
        device_codec(get_codec({"id": "qsgd", "bits": 4, "coding": "elias"}))
    assert str(exc.value) == ("qsgd: coding='elias' (variable-length) has no GPU kernels (coding='fixed' has); "
                              "it runs on the host")
    elias = get_codec({"id": "qsgd", "bits": 4, "coding": "elias"}).encode(gradient(50, 1))
    with pytest.raises(CodecError, match="^qsgd: an Elias-coded frame has no GPU decoder; it decodes on the host$"):
        device_codec(get_codec({"id": "qsgd", "bits": 4})).decode(elias, cuda.to_device(np.zeros(50, np.float32)))
    with pytest.raises(CodecError, match="checksum=True"):
        device_codec(get_codec({"id": "uniform", "checksum": True}))
    dev = device_codec(get_codec({"id": "fp32"}))
    with pytest.raises(CodecError, match="must be a CUDA array"):
        dev.encode(np.zeros(3, np.float32), cuda.device_array(100, np.uint8))
    with pytest.raises(CodecError, match="holds 50 bytes, encode may need 52"):
        dev.encode(cuda.to_device(np.zeros(3, np.float32)), cuda.device_array(50, np.uint8))
    assert set(DEVICE_CODECS) == {"fp32", "fp16", "uniform", "sign", "terngrad", "qsgd"}


def test_empty_input_gives_the_host_frame():
    for config in CONFIGS[:4] + SIGN_CONFIGS[:1] + [QSGD_L2, TERNGRAD]:
        codec, ours = get_codec(config), get_codec(config)
        assert np.array_equal(device_frame(ours, np.zeros(0, np.float32)), codec.encode(np.zeros(0, np.float32)))
        assert ours.state_dict() == codec.state_dict()


def test_a_missing_numba_cuda_is_one_line_naming_the_extra(monkeypatch):
    import numba

    monkeypatch.delattr(numba, "cuda")
    monkeypatch.setitem(sys.modules, "numba.cuda", None)  # what a failed import leaves
    with pytest.raises(DeviceUnavailable) as exc:
        load_cuda()
    assert 'pip install -e ".[cuda]"' in str(exc.value) and "\n" not in str(exc.value)


def test_numba_without_numba_cuda_is_refused_not_taken_for_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba_cuda" else real(name, *a))
    with pytest.raises(DeviceUnavailable, match=r'need numba-cuda, which is not installed: pip install -e "\.\[cuda\]"'):
        load_cuda()


def test_a_codec_with_a_payload_crc_stays_on_the_host():
    from mpigrad.codecs.device import host_only

    assert host_only(get_codec({"id": "uniform", "checksum": True})) == (
        "uniform: checksum=True needs the payload on the host for its CRC; it runs on the host")
    assert host_only(get_codec({"id": "uniform"})) is None


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


@pytest.mark.slow
def test_the_gpus_geometry_runs_in_the_simulator_with_the_hosts_frames():
    """MPIGRAD_DEVICE_THREADS=256: the GPU's 256-thread blocks and 8192-element chunks in the
    simulator (whose default is 32 and 1024), so that a bucket of several GPU chunks runs in
    CI, per codec and by table: the frames and the decoded sums are the host codec's, byte
    for byte."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    env = dict(os.environ, MPIGRAD_DEVICE_THREADS="256", NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, str(REPO / "tests" / "device_geometry.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0] == {"threads": 256, "chunk": 8192}
    assert len(lines) == 7 and all(line["frame"] and line["decoded"] for line in lines[1:]), lines
    assert lines[-1]["config"] == "table" and not any(lines[-1]["status"])   # a frame of the uniform, QSGD and TernGrad cases


def test_a_bad_thread_count_is_refused_in_one_line_before_mpi_starts():
    import subprocess
    import sys

    env = dict(os.environ, MPIGRAD_DEVICE_THREADS="100", NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--iterations", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mpigrad train: error: MPIGRAD_DEVICE_THREADS='100': threads per block must be a power of two from 32 "
        "to 1024"]
    done = subprocess.run([sys.executable, "-c", "import mpigrad.codecs.device.kernels"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "threads per block must be" in done.stderr.strip().splitlines()[-1]


def launch_types(args) -> list:
    """The numba types of a launch's arguments as the runtime passes them (device arrays
    C-contiguous), in a form tests/device_ptx.py reads."""
    specs = []
    for a in args:
        if hasattr(a, "dtype") and getattr(a, "ndim", 0) >= 1:
            specs.append(["array", str(a.dtype), a.ndim])
        elif isinstance(a, (bool, np.bool_)):
            specs.append("boolean")
        elif isinstance(a, (int, float)):
            specs.append("int64" if isinstance(a, int) else "float64")
        else:
            specs.append(str(np.asarray(a).dtype))
    return specs


@pytest.mark.slow  # a subprocess compiling 44 kernels, about 20 s: not in the quick tier
@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(f"nvidia.{lib}") for lib in ("cuda_nvcc", "cuda_nvrtc")),
                    reason="needs the nvidia-cuda-nvcc-cu12 and nvidia-cuda-nvrtc-cu12 wheels (NVVM): pip install "
                           "nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12")
def test_every_device_kernel_compiles_to_ptx_for_ampere_and_hopper_without_float32_fma(tmp_path, monkeypatch):
    """Every kernel each device codec launches (recorded under the simulator with the
    argument types the runtime passes) compiles to PTX for sm_80 and sm_90 with numba-cuda's
    NVVM, no GPU needed; and none contains a float32 fused multiply-add, which would round
    once where the host's float32 rounds twice and break the promised bytes."""
    import json
    import subprocess

    from mpigrad.codecs.device import codecs as device_codecs
    from mpigrad.runtime.exchange.warmup import warm_up_device

    launches = set()
    launch = device_codecs.launch_kernel

    def recording(kernel, grid, stream, *args):
        launches.add(json.dumps([kernel.py_func.__name__, launch_types(args)]))
        return launch(kernel, grid, stream, *args)

    monkeypatch.setattr(device_codecs, "launch_kernel", recording)
    import torch

    codecs = [get_codec(c) for c in CONFIGS + SIGN_CONFIGS + SCALED_CONFIGS]
    warm_up_device(codecs, torch.device("cpu"))   # the runtime's: the table kernels
    from mpigrad.codecs.device import host_only
    from mpigrad.runtime.exchange.device import device_view

    for codec in codecs:                            # the twins' own, per piece
        if not host_only(codec):
            twin = device_codec(codec)
            x, out = torch.linspace(-1.0, 1.0, 37), torch.zeros(37)
            frame = torch.empty(twin.max_encoded_size(37), dtype=torch.uint8)
            host = frame[:twin.encode(device_view(cuda, x), device_view(cuda, frame))].numpy()
            twin.decode(host, device_view(cuda, out))
            twin.decode(host, device_view(cuda, out), accumulate=True)
    names = {json.loads(item)[0] for item in launches}
    from mpigrad.codecs.device import kernels
    every = {name for name, value in vars(kernels).items() if type(value).__name__ == "FakeCUDAKernel"
             and not value._device}  # the global kernels (the simulator's stand-ins)
    assert names == every and len(every) == 22, every - names
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([json.loads(item) for item in sorted(launches)]))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("device_ptx.py")), str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.splitlines()[-1])
    assert len(compiled) == 2 * len(launches)
    assert all(entry["bytes"] > 0 for entry in compiled.values())
    fused = {key: entry["fma_f32"] for key, entry in compiled.items() if entry["fma_f32"]}
    assert not fused, fused
