"""The one rule for which layers are quantized, shared by the replica and the launch check."""

import pytest

from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.models import build_model
from mpigrad.runtime.exchange.replica import quantization_rule
from mpigrad.runtime.run.preflight import check_quantizes_something


def _paper_cnn():
    return build_model("paper-cnn", input_shape=(1, 8, 8), num_classes=10, fc_sizes=(256, 256))


def test_default_quantizes_the_papers_fc_weights_and_passes_the_launch_check():
    model = _paper_cnn()
    quantize = quantization_rule(model, None)
    chosen = [name for name, p in model.named_parameters() if quantize(p)]
    assert chosen == [name for name, p in model.named_parameters()
                      if any(p is q for q in model.quantized_parameters())]
    assert len(chosen) == 2
    check_quantizes_something(RunConfig(), model)  # default min_quantize_size (None): no error


def test_a_model_that_names_no_layer_is_refused_by_default():
    model = _paper_cnn()
    model.quantized_parameters = lambda: []
    with pytest.raises(UsageError, match="the model names no layer to quantize"):
        check_quantizes_something(RunConfig(), model)
    check_quantizes_something(RunConfig(codec="fp32"), model)


def test_an_explicit_size_quantizes_every_large_enough_tensor():
    model = _paper_cnn()
    quantize = quantization_rule(model, 1000)
    assert all(quantize(p) == (p.numel() >= 1000) for p in model.parameters())
    with pytest.raises(UsageError, match="--min-quantize-size is 10,000,000"):
        check_quantizes_something(RunConfig(min_quantize_size=10_000_000), model)
