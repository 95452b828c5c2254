"""Fuzz the decoders in a subprocess: a segfault fails this test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("fuzz_codecs.py")


def test_mutated_buffers_only_raise_codec_error():
    result = subprocess.run([sys.executable, str(SCRIPT), "--seed", "20240601", "--mutations", "3000"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"fuzzer exited with {result.returncode} (negative: killed by a signal)\n"
        f"stdout: {result.stdout}\nstderr: {result.stderr[-4000:]}")
    tally = dict(item.split("=") for item in result.stdout.split())
    # Every kind of mutation ran, and both outcomes occurred: the fuzzer reaches the kernels.
    kinds = {key.split(":")[0] for key in tally}
    assert kinds == {"flip", "bytes", "truncate", "extend", "header", "header+resize", "scales"}
    assert sum(int(v) for k, v in tally.items() if k.endswith(":ok")) > 100
    assert sum(int(v) for k, v in tally.items() if k.endswith(":error")) > 100

