"""Fuzz the decoders in a subprocess: a segfault fails this test instead of killing pytest."""

from __future__ import annotations

from pathlib import Path

from conftest import fuzz_tally

SCRIPT = Path(__file__).with_name("fuzz_codecs.py")


def test_mutated_buffers_only_raise_codec_error():
    tally = fuzz_tally(SCRIPT, 20240601, 3000)
    # Every kind of mutation ran, and both outcomes occurred: the fuzzer reaches the kernels.
    kinds = {key.split(":")[0] for key in tally}
    assert kinds == {"flip", "bytes", "truncate", "extend", "header", "header+resize", "scales"}
    assert sum(int(v) for k, v in tally.items() if k.endswith(":ok")) > 100
    assert sum(int(v) for k, v in tally.items() if k.endswith(":error")) > 100

