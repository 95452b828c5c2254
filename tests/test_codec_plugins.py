"""A codec of the user's own, named ``package.module:Class``: checked when it is built (the
class, its wire id in the plugins' range, the codec contract on a small vector and on bad
frames), refused in one line, and trained under a real mpiexec (examples/plugins/topk.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, SMALL_RUN, run_mpi

from mpigrad.codecs import Codec, CodecError, available, codec_class, get_codec, read_header, register_codec
from mpigrad.codecs.base import HEADER_SIZE, PLUGIN_WIRE_IDS, _write_header
from mpigrad.codecs.contract import check_contract
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.plan.checks import broadcast_codec, check_options
from mpigrad.trace import load

EXAMPLES = REPO / "examples" / "plugins"

BROKEN = textwrap.dedent('''
    import numpy as np
    from mpigrad.codecs import Codec, read_header
    from topk import TopK

    class Abstract(Codec):
        codec_id = "abstract"
        wire_id = 201

    class NoBound(TopK):
        codec_id = "nobound"
        wire_id = 202
        error_bound = Codec.error_bound

    class LowWire(TopK):
        codec_id = "lowwire"
        wire_id = 6

    class NoWire(TopK):
        codec_id = "nowire"

    class TakesSign(TopK):
        codec_id = "sign"
        wire_id = 203

    class SameWire(TopK):
        codec_id = "samewire"

    SameWire.wire_id = 200  # topk's

    class OwnDecode(TopK):
        codec_id = "owndecode"
        wire_id = 204

        def decode(self, buf, out=None, *, accumulate=False):
            return np.zeros(read_header(buf).n, np.float32)

    class Raises(TopK):
        codec_id = "raises"
        wire_id = 205

        def __init__(self, *, ratio=0.5, checksum=False):
            raise RuntimeError("no GPU here")

    class Sloppy(TopK):
        """Claims to be exact, drops values."""
        codec_id = "sloppy"
        wire_id = 206

        def error_bound(self, x):
            return 0.0

    class Liar(TopK):
        """max_payload_size too small for what it writes."""
        codec_id = "liar"
        wire_id = 207

        def max_payload_size(self, n):
            return 4 * self.kept(n)

    class Lenient(TopK):
        """Reads what it needs and never checks the payload length."""
        codec_id = "lenient"
        wire_id = 208

        def _check_payload(self, header, payload):
            pass

        def _decode_payload(self, header, payload, out):
            k = header.param_a
            out[:] = 0.0
            out[payload[:4 * k].view("<u4")] = payload[4 * k:8 * k].view("<f4")

    class Crashes(TopK):
        """An IndexError on a corrupted index, not a CodecError."""
        codec_id = "crashes"
        wire_id = 209

        def _decode_payload(self, header, payload, out):
            k = header.param_a
            out[:] = 0.0
            np.put(out, payload[:4 * k].view("<u4").astype(np.int64), payload[4 * k:].view("<f4"), mode="raise")

    class Unjsonable(TopK):
        codec_id = "unjsonable"
        wire_id = 210

        def _config(self):
            return {"ratio": np.float32(self.ratio)}

    class NanFriendly(TopK):
        """Encodes NaN as if it were a value."""
        codec_id = "nanfriendly"
        wire_id = 212

        def _encode_payload(self, x, payload):
            return super()._encode_payload(np.nan_to_num(x), payload)

    class Fragile(TopK):
        """Meets the contract on its small vectors, fails on a big one."""
        codec_id = "fragile"
        wire_id = 211

        def _encode_payload(self, x, payload):
            if x.size > 5000:
                raise MemoryError("out of scratch")
            return super()._encode_payload(x, payload)

        def _decode_payload(self, header, payload, out):
            if header.n > 5000:
                raise KeyError("n")
            super()._decode_payload(header, payload, out)

    not_a_class = 3
''')


@pytest.fixture()
def plugins(tmp_path, monkeypatch):
    (tmp_path / "broken_codecs.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return tmp_path


def vector(n=5000, seed=3):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_the_example_codec_is_built_checked_and_round_trips(plugins):
    codec = get_codec({"id": "topk:TopK", "ratio": 0.1})
    assert codec.get_config() == {"id": "topk", "ratio": 0.1}
    assert get_codec(codec.get_config()) == codec and codec_class("topk") is codec_class("topk:TopK")
    assert "topk" not in available()  # plugins stay out of the registry (and --help)
    x = vector()
    buf = codec.encode(x)
    header = read_header(buf)
    assert header.wire_id == 200 and header.param_a == 500 and buf.size == HEADER_SIZE + 8 * 500
    assert buf.size <= codec.max_encoded_size(x.size)
    y = codec.decode(buf)
    kept = np.flatnonzero(y)
    assert kept.size == 500 and np.array_equal(y[kept], x[kept])
    assert np.abs(x[kept]).min() >= np.abs(np.delete(x, kept)).max()
    assert np.abs(y - x).max() <= codec.error_bound(x)
    check_contract(codec)
    out = np.ones_like(x)
    codec.decode(buf, out, accumulate=True)
    assert np.array_equal(out, np.float32(1) + y)


def test_plugin_wire_ids_never_meet_mpigrads_and_decoders_refuse_other_ids(plugins):
    assert min(PLUGIN_WIRE_IDS) == 128 and max(PLUGIN_WIRE_IDS) == 255
    assert all(codec_class(name).wire_id < 128 for name in available())
    topk, uniform = get_codec({"id": "topk:TopK"}), get_codec({"id": "uniform"})
    x = vector()
    with pytest.raises(CodecError, match="buffer was encoded by codec 'topk', not 'uniform'"):
        uniform.decode(topk.encode(x).copy())
    with pytest.raises(CodecError, match="buffer was encoded by codec 'uniform', not 'topk'"):
        topk.decode(uniform.encode(x).copy())
    stray = topk.encode(x).copy()
    _write_header(stray, read_header(stray)._replace(wire_id=250), with_crc=False)
    with pytest.raises(CodecError, match="unknown wire id 250"):
        topk.decode(stray)

    class Squatter(Codec):
        codec_id, wire_id = "squatter", 200

    with pytest.raises(ValueError, match=r"wire id 200 is not in 1\.\.127"):
        register_codec(Squatter)


def test_a_corrupted_frame_is_rejected(plugins):
    codec = get_codec({"id": "topk:TopK", "ratio": 0.1})
    buf = codec.encode(vector()).copy()
    swapped = buf.copy()  # the first two indices swapped: out of order
    swapped[HEADER_SIZE:HEADER_SIZE + 8] = np.concatenate([buf[HEADER_SIZE + 4:HEADER_SIZE + 8],
                                                           buf[HEADER_SIZE:HEADER_SIZE + 4]])
    with pytest.raises(CodecError, match="indices out of range or out of order"):
        codec.decode(swapped)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(buf[:-1])
    nan = buf.copy()
    nan[-4:] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(CodecError, match="a value is NaN"):
        codec.decode(nan)
    checked = get_codec({"id": "topk:TopK", "ratio": 0.1, "checksum": True})
    flipped = checked.encode(vector()).copy()
    flipped[-1] ^= 1  # still a valid frame but for its CRC
    with pytest.raises(CodecError, match="payload CRC mismatch"):
        checked.decode(flipped)
    out = np.full(5000, 2.0, np.float32)
    with pytest.raises(CodecError):
        codec.decode(swapped, out, accumulate=True)
    assert (out == 2.0).all()


@pytest.mark.parametrize("spec, message", [
    ("broken_codecs:Abstract", "codec broken_codecs:Abstract does not implement _config, _decode_payload, "
                               "_encode_payload, max_payload_size"),
    ("broken_codecs:NoBound", "codec broken_codecs:NoBound must declare error_bound(x)"),
    ("broken_codecs:LowWire", "codec broken_codecs:LowWire must set wire_id to a number of its own in 128..255, "
                              "the plugins' range (1..127 are mpigrad's codecs), got 6"),
    ("broken_codecs:NoWire", "must set wire_id to a number of its own in 128..255"),
    ("broken_codecs:TakesSign", "codec broken_codecs:TakesSign: codec_id 'sign' is taken by mpigrad.codecs.sign.Sign"),
    ("broken_codecs:SameWire", "codec broken_codecs:SameWire: wire_id 200 is taken by topk.TopK"),
    ("broken_codecs:OwnDecode", "codec broken_codecs:OwnDecode overrides decode: the header and its checks live "
                                "there; implement _encode_payload and _decode_payload instead"),
    ("broken_codecs:Raises", "factory broken_codecs:Raises failed: RuntimeError: no GPU here"),
    ("broken_codecs:Sloppy", "codec broken_codecs:Sloppy: decode(encode(x)) is off by"),
    ("broken_codecs:Liar", "codec broken_codecs:Liar: encode of 1 finite float32 value(s) raised ValueError"),
    ("broken_codecs:Lenient", "codec broken_codecs:Lenient: decode of a frame one payload byte short raised "
                              "ValueError"),
    ("broken_codecs:Crashes", "codec broken_codecs:Crashes: decode of a frame with payload byte 0 flipped raised "
                              "IndexError"),
    ("broken_codecs:NanFriendly", "codec broken_codecs:NanFriendly: encode of a vector holding nan did not raise "
                                  "CodecError"),
    ("broken_codecs:Unjsonable", "codec broken_codecs:Unjsonable: get_config() is not JSON-able"),
    ("broken_codecs:not_a_class", "broken_codecs:not_a_class is a int, not a callable"),
    ("collections:OrderedDict", "codec collections:OrderedDict is the class OrderedDict, not a subclass of "
                                "mpigrad.codecs.Codec"),
    ("broken_codecs:Nope", "module 'broken_codecs' has no attribute 'Nope'"),
    ("no_such_module:Codec", "cannot import 'no_such_module'"),
])
def test_broken_plugins_are_refused_in_one_line(plugins, spec, message):
    get_codec({"id": "topk:TopK"})  # loaded first: SameWire's wire id is taken
    with pytest.raises(CodecError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as error:
        get_codec({"id": spec})
    assert "\n" not in str(error.value)


def test_a_plugin_failing_in_a_run_is_one_codec_error_naming_it(plugins):
    """What rank 0 reports as a bad frame, with the iteration; a built-in's errors are untouched."""
    fragile = get_codec({"id": "broken_codecs:Fragile"})
    with pytest.raises(CodecError, match=r"^codec broken_codecs:Fragile: encode raised MemoryError: out of scratch$"):
        fragile.encode(vector(6000))
    buf = get_codec({"id": "topk"}).encode(vector(6000)).copy()
    _write_header(buf, read_header(buf)._replace(wire_id=211), with_crc=False)
    with pytest.raises(CodecError, match=r"^codec broken_codecs:Fragile: decode raised KeyError: 'n'$"):
        fragile.decode(buf, np.zeros(6000, np.float32), accumulate=True)


def test_unknown_options_and_bad_values_of_a_plugin_are_one_line(plugins):
    with pytest.raises(CodecError, match=r"codec 'topk:TopK': unknown option\(s\) ratoi; valid: ratio, checksum$"):
        get_codec({"id": "topk:TopK", "ratoi": 0.1})
    with pytest.raises(CodecError, match=r"factory topk:TopK: topk: ratio must be a number in \(0, 1\], got 2"):
        get_codec({"id": "topk:TopK", "ratio": 2})


def test_a_plugin_broadcast_codec_is_spelled_with_its_bits_last(plugins):
    def config(**options):
        return RunConfig.from_sources(None, {"codec": "topk:TopK", "policy": "fixed", **options})

    assert config(broadcast_codec="topk:TopK").broadcast_codec_config() == ({"id": "topk:TopK"}, None)
    assert config(broadcast_codec="topk:TopK:8").broadcast_codec_config() == ({"id": "topk:TopK"}, 8)
    assert config(broadcast_codec="uniform:8").broadcast_codec_config() == ({"id": "uniform"}, 8)
    assert broadcast_codec(config(broadcast_codec="topk:TopK"))[0] == get_codec({"id": "topk"})
    with pytest.raises(UsageError, match="--broadcast-codec topk:TopK:8: codec 'topk' has no 'bits' option"):
        broadcast_codec(config(broadcast_codec="topk:TopK:8"))
    with pytest.raises(UsageError, match="expected CODEC:BITS with an integer BITS"):
        config(broadcast_codec="uniform:x").broadcast_codec_config()
    check_options(config(broadcast_codec="topk:TopK"))
    with pytest.raises(UsageError, match="policy 'mqgrad' chooses bits, but codec 'topk:TopK' has no bits option"):
        check_options(config(policy="mqgrad"))


@pytest.mark.parametrize("argv, message", [
    (["--codec", "broken_codecs:Abstract"], "codec broken_codecs:Abstract does not implement _config, "
                                            "_decode_payload, _encode_payload, max_payload_size"),
    (["--codec", "broken_codecs:Lenient"], "codec broken_codecs:Lenient: decode of a frame one payload byte "
                                           "short raised ValueError: "),
    (["--codec", "topk:TopK", "--broadcast-codec", "broken_codecs:Raises:4"],
     "--broadcast-codec broken_codecs:Raises:4: factory broken_codecs:Raises failed: RuntimeError: no GPU here"),
])
def test_cli_refuses_a_broken_plugin_before_mpi_starts(plugins, argv, message):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(plugins)]))
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", *argv, "--policy", "fixed",
                             "--trace", str(plugins / "x.h5")], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpigrad train: error: {message}"), result.stderr
    assert not (plugins / "x.h5").exists()


@pytest.mark.mpi
def test_the_example_codec_trains_under_mpiexec_and_a_failing_one_fails_the_run(tmp_path, mpi_env, plugins):
    env = dict(mpi_env, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(plugins), mpi_env.get("PYTHONPATH", "")]))
    trace = tmp_path / "topk.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", "40", "--codec", "topk:TopK",
                         "--codec-opt", "ratio=0.1", "--error-feedback", "residual", "--policy", "fixed",
                         "--lr", "0.05"],
                     env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and tr.config["codec"] == "topk:TopK" and tr.config["codec_opts"] == {"ratio": 0.1}
    assert tr.label == "Fix [TopK]"  # no width: top-k has none (the config's bits are its unused default)
    progress = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert progress and not any(" bits " in line for line in progress), result.stdout  # no meaningless "bits 0"
    loss = tr.steps["loss"].to_numpy()
    assert loss[-10:].mean() < loss[:5].mean() - 0.03, loss  # measured: 2.65 -> 2.59
    assert tr.eval["test_loss"].is_monotonic_decreasing and tr.eval["test_accuracy"].iloc[-1] > 0.3, tr.eval
    up = tr.steps["bytes_up"].to_numpy()
    assert (up == up[0]).all()  # top-k frames have one size whatever the values

    failed = tmp_path / "fragile.h5"  # its quantized layers hold more than 5000 values
    result = run_mpi(3, ["train", "--trace", str(failed), *SMALL_RUN, "--iterations", "5", "--codec",
                         "broken_codecs:Fragile", "--policy", "fixed"], env, cwd=tmp_path)
    assert result.returncode != 0
    assert "codec broken_codecs:Fragile: encode raised MemoryError: out of scratch" in result.stderr, result.stderr
    assert load(failed).status == "failed"
