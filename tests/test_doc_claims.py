"""Figures the docs and help state about the code, checked against the code: array sizes of
the job arrays, the defaults in ``train --help``, what a config comment says it quantizes."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO
from mpigrad.cli import main
from mpigrad.config import DEFAULT_LR, RunConfig

DOCS = [REPO / "README.rst", *sorted((REPO / "docs").glob("*.rst")), *sorted((REPO / "examples").rglob("README.md")),
        REPO / "jobscripts" / "README.md"]


def _array_size(script) -> int:
    first, last = re.search(r"^#SBATCH --array=(\d+)-(\d+)", script.read_text(), re.M).groups()
    return int(last) - int(first) + 1


def test_documented_array_task_counts_match_the_scripts():
    claims = [(doc, m) for doc in DOCS
              for m in re.finditer(r"sbatch\b[^\n#]*?(\S+\.sbatch)\b[^\n#]*#\s*(\d+) array tasks", doc.read_text())]
    assert len(claims) >= 2
    for doc, match in claims:
        script, count = REPO / match.group(1), int(match.group(2))
        assert _array_size(script) == count, f"{doc.name}: {match.group(0)!r}, but {script.name} has {_array_size(script)}"


def test_train_help_footer_states_the_default_learning_rates(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    footer = " ".join(capsys.readouterr().out.split("Defaults follow")[1].split())
    default = RunConfig()
    assert f"lr {DEFAULT_LR['cifar10']} on cifar10, {DEFAULT_LR[default.data]} on the default {default.data}" in footer
    assert f"batch {default.batch_size}" in footer and "10MB/s" in footer


def test_the_plugin_config_says_what_it_quantizes():
    """bars.toml's min_quantize_size comment names the tensors quantized and their share."""
    sys.path.insert(0, str(REPO / "examples" / "plugins"))
    try:
        import bars
    finally:
        sys.path.pop(0)
    from mpigrad.config import load_toml
    from mpigrad.runtime.exchange.replica import quantization_rule

    path = REPO / "examples" / "plugins" / "bars.toml"
    config = load_toml(str(path))
    model = bars.make_model(input_shape=(1, config["data_opts"]["size"], config["data_opts"]["size"]),
                            num_classes=len(bars.CLASSES), seed=config["seed"], **config["model_opts"])
    quantize = quantization_rule(model, config["min_quantize_size"])
    params = [p for p in model.parameters() if p.requires_grad]
    quantized = [p for p in params if quantize(p)]
    share = 100 * sum(p.numel() for p in quantized) / sum(p.numel() for p in params)
    line = next(line for line in path.read_text().splitlines() if line.startswith("min_quantize_size"))
    comment = line.partition("#")[2]
    match = re.search(r"quantizes (\d+) tensors?\b.*\(([\d.]+) % of", comment)
    assert match, f"the comment should say what is quantized: {line!r}"
    assert int(match.group(1)) == len(quantized) and float(match.group(2)) == round(share, 1), line
