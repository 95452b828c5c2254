"""Error feedback: GRACE order, the residual (EF-signSGD) and accumulate (MCGQ Alg. 4) modes."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest

from mpigrad.codecs import CodecError, get_codec
from mpigrad.feedback import ErrorFeedback, FeedbackError


def step(memory: ErrorFeedback, codec, key, g: np.ndarray) -> np.ndarray:
    p = memory.compensate(key, g)
    decoded = codec.decode(codec.encode(p))
    memory.update(key, p, decoded)
    return decoded


def test_residual_mode_is_ef_signsgd():
    rng = np.random.default_rng(0)
    codec = get_codec({"id": "sign"})
    memory = ErrorFeedback("residual")
    g = rng.standard_normal(50).astype(np.float32)
    decoded = step(memory, codec, "w", g)
    np.testing.assert_array_equal(memory.error("w"), g - decoded)            # e = p - C(p), e_0 = 0
    g2 = rng.standard_normal(50).astype(np.float32)
    p = memory.compensate("w", g2)
    np.testing.assert_array_equal(p, g2 + (g - decoded))
    decoded2 = codec.decode(codec.encode(p))
    np.testing.assert_allclose(decoded2, np.mean(np.abs(p)) * np.where(p < 0, -1, 1), rtol=1e-6)
    memory.update("w", p, decoded2)
    np.testing.assert_array_equal(memory.error("w"), p - decoded2)


def test_ef_with_sign_recovers_the_sum_of_gradients():
    """sum(decoded) = sum(g) - e_T, and e_T stays bounded: plain sign SGD is biased, EF is not."""
    rng = np.random.default_rng(1)
    d, steps = 64, 2000
    mean = (rng.standard_normal(d) * rng.exponential(size=d)).astype(np.float32)
    codec = get_codec({"id": "sign"})
    memory = ErrorFeedback("residual")
    sum_g, sum_ef, sum_plain = np.zeros(d), np.zeros(d), np.zeros(d)
    for _ in range(steps):
        g = (mean + rng.standard_normal(d)).astype(np.float32)
        sum_g += g
        sum_ef += step(memory, codec, 0, g)
        sum_plain += codec.decode(codec.encode(g))
    np.testing.assert_allclose(sum_ef, sum_g - memory.error(0), atol=1e-3)
    relative = np.linalg.norm(sum_ef - sum_g) / np.linalg.norm(sum_g)
    plain = np.linalg.norm(sum_plain - sum_g) / np.linalg.norm(sum_g)
    assert relative < 0.01 < 0.3 < plain
    assert np.linalg.norm(memory.error(0)) < 0.01 * np.linalg.norm(sum_g)


def test_accumulate_mode_is_mcgq_algorithm_4():
    rng = np.random.default_rng(2)
    codec = get_codec({"id": "mcgq", "K": 0.05, "seed": 3})
    memory = ErrorFeedback("accumulate")
    accumulated = np.zeros(400, np.float32)
    for _ in range(60):
        g = rng.standard_normal(400).astype(np.float32)
        accumulated += g                                  # ag <- ag + g
        p = memory.compensate("fc", g)
        np.testing.assert_array_equal(p, accumulated)
        decoded = codec.decode(codec.encode(p))           # MCGQ(ag, K)
        memory.update("fc", p, decoded)
        sent = decoded != 0
        assert 0 < sent.sum() <= 20                        # N = 20 samples
        accumulated[sent] = 0                              # ag[g_int != 0] <- 0
        np.testing.assert_array_equal(memory.error("fc"), accumulated)


def test_accumulation_reaches_consistently_small_gradients():
    """Alg. 4's purpose: small gradients grow in the memory until they are sampled."""
    g = np.where(np.arange(400) % 2 == 0, 1.0, 0.01).astype(np.float32)
    reached = {}
    for mode in ("accumulate", None):
        codec = get_codec({"id": "mcgq", "K": 0.05, "seed": 3})
        memory = ErrorFeedback("accumulate")
        ever_sent = np.zeros(400, bool)
        for _ in range(150):
            p = memory.compensate("fc", g) if mode else g
            decoded = codec.decode(codec.encode(p))
            if mode:
                memory.update("fc", p, decoded)
            ever_sent |= decoded != 0
        assert ever_sent[0::2].all()
        reached[mode] = ever_sent[1::2].mean()
    assert reached["accumulate"] > 0.7 > 0.2 > reached[None]


def test_decay_scales_the_memory():
    memory = ErrorFeedback("residual", decay=0.5)
    g = np.float32([1.0, -2.0, 3.0])
    p = memory.compensate(1, g)
    memory.update(1, p, np.float32([0.0, 0.0, 4.0]))
    np.testing.assert_array_equal(memory.error(1), [1.0, -2.0, -1.0])
    np.testing.assert_array_equal(memory.compensate(1, g), g + 0.5 * np.float32([1.0, -2.0, -1.0]))


def test_buffers_are_reused_and_nothing_gradient_sized_is_allocated():
    n = 1 << 20
    g = np.ones(n, np.float32)
    decoded = np.zeros(n, np.float32)
    decoded[::3] = 1
    for mode in ("residual", "accumulate"):
        memory = ErrorFeedback(mode, decay=0.9)
        first = memory.compensate("layer", g)
        memory.update("layer", first, decoded)
        tracemalloc.start()
        for _ in range(3):
            p = memory.compensate("layer", g)
            memory.update("layer", p, decoded)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert p is first
        assert peak < n // 8, f"{mode}: {peak} bytes allocated per step"


def test_failed_encode_leaves_the_memory_intact():
    codec = get_codec({"id": "mcgq", "K": 1.0})
    memory = ErrorFeedback("residual")
    step(memory, codec, "w", np.float32([1.0, 2.0, 3.0]))
    before = memory.error("w").copy()
    p = memory.compensate("w", np.float32([np.nan, 0.0, 0.0]))
    with pytest.raises(CodecError, match="NaN"):
        codec.encode(p)
    np.testing.assert_array_equal(memory.error("w"), before)


def test_state_round_trip():
    rng = np.random.default_rng(4)
    codec = get_codec({"id": "sign"})
    memory = ErrorFeedback("residual", decay=0.75)
    for key, size in (("a", 10), (3, 5)):
        step(memory, codec, key, rng.standard_normal(size).astype(np.float32))
    state = pickle.loads(pickle.dumps(memory.state_dict()))
    assert set(state["memory"]) == {"a", 3}
    restored = ErrorFeedback("residual", decay=0.75)
    restored.load_state_dict(state)
    state["memory"]["a"][:] = 99                           # the restored memory owns its arrays
    g = rng.standard_normal(10).astype(np.float32)
    np.testing.assert_array_equal(restored.compensate("a", g), memory.compensate("a", g))
    np.testing.assert_array_equal(restored.error(3), memory.error(3))
    with pytest.raises(FeedbackError, match="mode='accumulate'"):
        ErrorFeedback("accumulate", decay=0.75).load_state_dict(memory.state_dict())
    with pytest.raises(FeedbackError, match="NaN"):
        restored.load_state_dict({**memory.state_dict(), "memory": {"a": np.float32([np.nan])}})
    restored.reset("a")
    assert "a" not in restored and 3 in restored
    restored.reset()
    assert restored.keys() == []


@pytest.mark.parametrize("options, message", [
    ({"mode": "sum"}, "mode must be one of residual, accumulate"),
    ({"decay": 1.5}, "decay must be a number in \\[0, 1\\]"),
    ({"decay": float("nan")}, "decay"),
    ({"decay": True}, "decay"),
])
def test_bad_settings(options, message):
    with pytest.raises(FeedbackError, match=message):
        ErrorFeedback(**options)


def test_bad_arrays():
    memory = ErrorFeedback()
    with pytest.raises(FeedbackError, match="float32 or float64"):
        memory.compensate("w", np.arange(3))
    with pytest.raises(FeedbackError, match="no memory for 'w'"):
        memory.update("w", np.zeros(3, np.float32), np.zeros(3, np.float32))
    p = memory.compensate("w", np.zeros(3, np.float32))
    with pytest.raises(FeedbackError, match="float32\\[4\\]"):
        memory.compensate("w", np.zeros(4, np.float32))
    with pytest.raises(FeedbackError, match="float64\\[3\\]"):
        memory.compensate("w", np.zeros(3))
    with pytest.raises(FeedbackError, match="decoded has shape"):
        memory.update("w", p, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        memory.error("w")[0] = 1


def test_momentum_correction_keeps_a_heavy_ball_velocity_on_numpy_and_torch():
    """u_1 = g_1, u_t = m u_(t-1) + g_t, in place, on arrays and on tensors alike."""
    import torch

    from mpigrad.feedback import MomentumCorrection

    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]
    expected = grads[0].copy()
    host, device = MomentumCorrection(0.9), MomentumCorrection(0.9)
    for t, g in enumerate(grads):
        if t:
            expected = np.float32(0.9) * expected + g
        u = host.accumulate(g)
        np.testing.assert_array_equal(u, expected)
        np.testing.assert_array_equal(device.accumulate(torch.from_numpy(g)).numpy(), expected)
    assert u is host.velocity and not np.shares_memory(u, grads[0])      # its own buffer, reused


def test_momentum_correction_state_round_trip_and_refusals():
    import torch

    from mpigrad.feedback import MomentumCorrection

    first = MomentumCorrection(0.5)
    assert first.state_dict() == {"momentum": 0.5, "velocity": None}
    first.accumulate(np.ones(4, np.float32))
    first.accumulate(np.ones(4, np.float32))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    again = MomentumCorrection(0.5)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.accumulate(np.zeros(4, np.float32)), np.full(4, 0.75, np.float32))
    on_torch = MomentumCorrection(0.5)
    on_torch.load_state_dict(state, like=torch.zeros(4))
    assert isinstance(on_torch.velocity, torch.Tensor) and on_torch.velocity.tolist() == [1.5] * 4
    with pytest.raises(FeedbackError, match="state is for momentum=0.5; this run has 0.9"):
        MomentumCorrection(0.9).load_state_dict(state)
    with pytest.raises(FeedbackError, match="holds 4 values, the model has 5"):
        MomentumCorrection(0.5).load_state_dict(state, like=torch.zeros(5))
    with pytest.raises(FeedbackError, match="NaN or infinity"):
        MomentumCorrection(0.5).load_state_dict({"momentum": 0.5, "velocity": np.full(4, np.nan, np.float32)})
    with pytest.raises(FeedbackError, match="the gradient is ndarray\\[5\\], the velocity ndarray\\[4\\]"):
        first.accumulate(np.ones(5, np.float32))
    for bad in (0, 1.0, -0.5, True, "0.9"):
        with pytest.raises(FeedbackError, match="momentum correction must be a number in \\(0, 1\\)"):
            MomentumCorrection(bad)
