"""The replica's flat buffers: torch parameters and gradients are views, the codecs read them in place."""

import numpy as np
import pytest
import torch

from mpigrad.codecs import get_codec
from mpigrad.models import build_model
from mpigrad.config import RunConfig
from mpigrad.runtime.exchange.build import build_compressor, build_shards
from mpigrad.runtime.exchange.replica import Replica

DIGITS = (1, 8, 8)


def make(name, **options):
    model = build_model(name, input_shape=DIGITS, num_classes=10, seed=0, **options)
    return Replica(model, min_quantize_size=2000, device=torch.device("cpu"))


def storage_offset_in(flat: torch.Tensor, t: torch.Tensor) -> int:
    """Element offset of ``t`` inside ``flat``'s memory (asserts it lies inside)."""
    start = (t.data_ptr() - flat.data_ptr()) // 4
    assert 0 <= start and start + t.numel() <= flat.numel()
    return start


@pytest.mark.parametrize("name, options", [("resnet20", {}), ("paper-cnn", {"fc_sizes": (64, 48)})])
def test_parameters_and_gradients_stay_views_of_the_flat_buffers_through_training(name, options):
    replica = make(name, **options)
    model = replica.model
    offsets = {s.name: s.offset for s in replica.layout.quantized}
    grad_ptrs = {}
    x, y = torch.randn(8, *DIGITS), torch.arange(8) % 10
    for _ in range(3):  # what a worker does each iteration
        replica.flat_grad.zero_()
        model.loss(model(x), y, 5e-4).backward()
        host = replica.gradient_to_host()
        assert np.shares_memory(host, replica.flat_grad.numpy())  # the codecs read torch's memory
        replica.apply_update(host, 0.01)
        for pname, p in model.named_parameters():
            at = storage_offset_in(replica.flat, p)
            assert storage_offset_in(replica.flat_grad, p.grad) == at, pname
            if pname in offsets:
                assert at == offsets[pname]
            grad_ptrs.setdefault(pname, p.grad.data_ptr())
            assert p.grad.data_ptr() == grad_ptrs[pname], f"{pname}: autograd replaced the gradient view"
    assert replica.flat_grad.abs().sum() > 0


def test_compressor_works_on_the_flat_arrays_without_gradient_sized_allocations():
    replica = make("resnet20")
    codec = get_codec({"id": "uniform", "bits": 4})
    config = RunConfig(model="resnet20", min_quantize_size=2000)
    (shard,) = build_shards(config, replica.layout, codec, 1)
    compressor = build_compressor(config, replica.layout, codec, stream=1, servers=1)
    bits = [4] * len(replica.layout.quantized)
    replica.flat_grad.normal_()
    grad = replica.gradient_to_host()
    frame = compressor.encode(grad, bits, shard)
    reused = compressor.encode(grad, bits, shard)
    assert np.shares_memory(frame, reused)  # one frame buffer, reused every iteration
    update = replica.update_host
    before = update.ctypes.data
    compressor.decode(frame, shard, update)
    assert update.ctypes.data == before and np.shares_memory(update, replica.flat_grad.numpy())


def test_state_dict_carries_parameters_and_batchnorm_buffers():
    a, b = make("resnet20"), make("resnet20")
    with torch.no_grad():
        a.flat.add_(1.0)
        for buf in a.model.buffers():
            buf.add_(3)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.flat, b.flat) and b.checksum() == a.checksum()
    for (name, x), y in zip(a.model.named_buffers(), b.model.buffers()):
        assert torch.equal(x, y), name
    # Buffers are not part of the parameter checksum.
    with torch.no_grad():
        next(b.model.buffers()).add_(1.0)
    assert b.checksum() == a.checksum()


def test_state_of_another_architecture_is_refused():
    batch, group = make("resnet20"), make("resnet20", norm="group")
    with pytest.raises(ValueError, match="other model buffers"):
        group.load_state_dict(batch.state_dict())
    with pytest.raises(ValueError, match="parameters"):
        make("resnet20", width=8).load_state_dict(batch.state_dict())


def float32_tolerance() -> dict[str, float]:
    """How far a CUDA float32 result may be from the CPU's under torch's TF32 settings now:
    TF32 keeps 10 of float32's 23 mantissa bits in convolutions and matmuls (relative error
    ~5e-4 per product, growing through a backward pass: up to 1.6e-2 seen on an H100's
    ResNet-20 gradients), plain float32 differs only in summation order."""
    if torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32:
        return {"rtol": 5e-2, "atol": 2e-2}
    return {"rtol": 1e-3, "atol": 1e-4}


def test_the_tolerance_follows_the_tf32_setting():
    from mpigrad.runtime.plan.gpu import apply_tf32

    saved = apply_tf32("default")
    try:
        apply_tf32("off")
        assert float32_tolerance() == {"rtol": 1e-3, "atol": 1e-4}
        apply_tf32("on")
        assert float32_tolerance()["rtol"] == 5e-2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_conv"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("tf32", ["default", "off"])
def test_cuda_replica_trains_in_device_buffers_and_stages_through_pinned_host_memory(tf32):
    from mpigrad.runtime.plan.gpu import apply_tf32

    saved = apply_tf32(tf32)
    try:
        _cuda_replica_matches_the_cpu_one(float32_tolerance())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_conv"]


def _cuda_replica_matches_the_cpu_one(tolerance: dict[str, float]) -> None:
    model = build_model("resnet20", input_shape=DIGITS, num_classes=10, seed=0)
    cpu = Replica(build_model("resnet20", input_shape=DIGITS, num_classes=10, seed=0), 2000, torch.device("cpu"))
    gpu = Replica(model, 2000, torch.device("cuda"))
    assert gpu.flat.is_cuda and gpu.flat_grad.is_cuda and torch.equal(gpu.flat.cpu(), cpu.flat)
    x, y = torch.randn(8, *DIGITS), torch.arange(8) % 10
    for replica, device in ((cpu, "cpu"), (gpu, "cuda")):
        replica.flat_grad.zero_()
        replica.model.loss(replica.model(x.to(device)), y.to(device), 5e-4).backward()
        for p in replica.model.parameters():
            storage_offset_in(replica.flat_grad, p.grad)
    first = gpu.layout.quantized[0]  # a pipelined bucket's copy: its pieces only
    gpu.grad_host[:] = 0
    part = gpu.gradient_to_host([first])
    assert np.array_equal(part[first.offset:first.offset + first.size],
                          gpu.flat_grad[first.offset:first.offset + first.size].cpu().numpy())
    assert not part[first.offset + first.size:].any()
    host = gpu.gradient_to_host()
    assert not np.shares_memory(host, cpu.grad_host) and gpu._host_grad.is_pinned()
    np.testing.assert_allclose(host, cpu.gradient_to_host(), **tolerance)
    gpu.apply_update(host, 0.1)
    cpu.apply_update(cpu.gradient_to_host(), 0.1)
    torch.testing.assert_close(gpu.flat.cpu(), cpu.flat, **tolerance)
    assert gpu.checksum() == gpu.checksum()
