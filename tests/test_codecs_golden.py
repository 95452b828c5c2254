"""Golden fixtures that freeze the wire format of the Numba codecs.

Each tests/data/golden/NAME.npz holds an input, a codec config, the RNG call count, the
encoded bytes and the decoded values. A change to any codec's bytes fails here; if the
change is intended, bump FORMAT_VERSION or the codec's layout notes and regenerate with

    python tests/test_codecs_golden.py --regenerate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mpigrad.codecs import get_codec
from mpigrad.codecs.reference import twin_of

GOLDEN = Path(__file__).parent / "data" / "golden"

FIXTURES = {
    "uniform_b1": {"id": "uniform", "bits": 1},
    "uniform_b3_bucket": {"id": "uniform", "bits": 3, "bucket_size": 1000},
    "uniform_b8_stochastic": {"id": "uniform", "bits": 8, "rounding": "stochastic", "seed": 7},
    "qsgd_b4": {"id": "qsgd", "bits": 4, "seed": 11},
    "qsgd_levels5_l2": {"id": "qsgd", "levels": 5, "norm": "l2", "bucket_size": None, "seed": 3},
    "qsgd_elias": {"id": "qsgd", "bits": 3, "coding": "elias", "bucket_size": 256, "seed": 5},
    "qsgd_elias_sqrt_n": {"id": "qsgd", "levels": 64, "coding": "elias", "norm": "l2",
                          "bucket_size": None, "seed": 2},
    "terngrad": {"id": "terngrad", "seed": 13},
    "sign_bucket": {"id": "sign", "bucket_size": 512, "checksum": True},
}
CALLS = 2  # encode as the third call of the codec's RNG stream


def golden_input() -> np.ndarray:
    """4133 values (one packing block and a tail), made from integers only: reproducible."""
    i = np.arange(4096 + 37, dtype=np.int64)
    values = ((i * 2654435761) % 2001 - 1000).astype(np.float32) / np.float32(1000.0)
    values[::17] = 0
    return values * np.float32(1e-3)


def make(config: dict) -> dict[str, np.ndarray]:
    x = golden_input()
    codec = get_codec(config)
    codec.load_state_dict({"calls": CALLS})
    encoded = codec.encode(x).copy()
    return {"config": np.array(json.dumps(config)), "calls": np.array(CALLS), "x": x,
            "encoded": encoded, "decoded": codec.decode(encoded)}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_wire_format_is_frozen(name):
    stored = np.load(GOLDEN / f"{name}.npz")
    config = json.loads(str(stored["config"]))
    assert config == FIXTURES[name]
    for build in (lambda: get_codec(config), lambda: twin_of(get_codec(config))):
        codec = build()
        codec.load_state_dict({"calls": int(stored["calls"])})
        encoded = codec.encode(stored["x"])
        assert np.array_equal(encoded, stored["encoded"]), f"{name}: encoded bytes changed"
        decoded = codec.decode(stored["encoded"])
        assert np.array_equal(decoded.view(np.int32), stored["decoded"].view(np.int32))


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_codecs_golden.py --regenerate")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, config in FIXTURES.items():
        np.savez_compressed(GOLDEN / f"{name}.npz", **make(config))
        print(f"wrote {GOLDEN / name}.npz")
