"""The codec contract, one rule in one place: what every codec's encode and decode must do.

``check_contract(codec)`` runs a codec on two small fixed vectors (1 and 1000 values) and
on frames made bad from its own output. ``get_codec`` runs it once per configuration of a
plugin (``package.module:Class``) before the run starts, so a codec that breaks it costs
no allocation; tests/test_codecs.py holds mpigrad's own codecs to it too. Each breach is
one CodecError line naming the codec and what it did:

- ``encode`` takes a finite float32 vector, writes at most ``max_encoded_size(n)`` bytes,
  and its header carries the codec's wire id and the element count; it refuses NaN and
  infinity with CodecError;
- ``decode`` gives back n finite float32 values, within ``error_bound(x)`` of the input when
  the codec declares one (a plugin must), into ``out=`` and added to it
  (``accumulate=True``) as ``out + decode(buf)`` bit for bit;
- ``get_config()`` is JSON-able and builds an equal codec;
- a frame of another wire id, or whose payload is one byte short or one byte long (header
  rewritten to agree, its CRC valid), is refused with CodecError; a frame with any header
  field or payload byte changed is refused with CodecError or decodes to n float32 values,
  and nothing else comes out (no IndexError, no crash).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from ..plugins import _describe
from .header import HEADER_SIZE, CodecError, PluginFault, _write_header, read_header

#: A ``mpigrad.codecs.Codec``; not imported, since base imports this module (no circle).
Codec = Any

__all__ = ["check_contract", "contract_vectors"]


def contract_vectors() -> list[np.ndarray]:
    """The vectors the contract encodes: one value, and 1000 of mixed sign and magnitude
    with exact zeros among them (reproducible: a fixed seed)."""
    rng = np.random.default_rng(20251124)
    x = rng.standard_normal(1000) * np.where(rng.random(1000) < 0.05, 30.0, 1.0)
    x[rng.random(1000) < 0.05] = 0.0
    return [np.array([0.75], np.float32), x.astype(np.float32)]


def check_contract(codec: Codec, name: str | None = None) -> None:
    """CodecError, one line naming ``name`` (default the codec id), for the first breach
    of the contract by ``codec``; it encodes, so use an instance whose RNG counter does not
    matter (``get_codec`` checks a throwaway one)."""
    name = name or codec.codec_id
    _check_config(codec, name)
    for x in contract_vectors():
        buf = _check_round_trip(codec, name, x)
        _check_bad_frames(codec, name, buf)
        _check_non_finite(codec, name, x)


def _breach(name: str, what: str) -> CodecError:
    return CodecError(f"codec {name}: {what}")


def _call(name: str, what: str, function: Callable[[], Any]) -> Any:
    """``function()``; an exception from the codec's code is one line naming it."""
    try:
        return function()
    except PluginFault as exc:
        raise _breach(name, f"{what} raised {exc.cause}") from None
    except CodecError as exc:
        raise _breach(name, f"{what} raised CodecError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the codec's own code, reported in one line
        raise _breach(name, f"{what} raised {_describe(exc)}") from None


def _check_config(codec: Codec, name: str) -> None:
    config = _call(name, "get_config()", codec.get_config)
    try:
        json.dumps(config)
    except (TypeError, ValueError) as exc:
        raise _breach(name, f"get_config() is not JSON-able: {exc}") from None
    if not isinstance(config, dict) or config.get("id") != codec.codec_id:
        raise _breach(name, f"get_config() must be a dict whose id is {codec.codec_id!r}, got {config!r}")
    params = {key: value for key, value in config.items() if key != "id"}
    rebuilt = _call(name, f"building it from its get_config() {config}", lambda: type(codec)(**params))
    if rebuilt != codec:
        raise _breach(name, f"its get_config() {config} builds a codec of config {rebuilt.get_config()}")


def _check_round_trip(codec: Codec, name: str, x: np.ndarray) -> np.ndarray:
    n = x.size
    buf = _call(name, f"encode of {n} finite float32 value(s)", lambda: codec.encode(x)).copy()
    limit = _call(name, "max_encoded_size", lambda: codec.max_encoded_size(n))
    if buf.size > limit:
        raise _breach(name, f"encode of {n} value(s) wrote {buf.size} bytes, max_encoded_size({n}) says {limit}")
    header = read_header(buf)
    if header.n != n:
        raise _breach(name, f"encode of {n} value(s) wrote a header announcing {header.n}")
    y = _call(name, f"decode of its own encoding of {n} value(s)", lambda: codec.decode(buf))
    if not (isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (n,)):
        raise _breach(name, f"decode gave {getattr(y, 'dtype', type(y).__name__)} of shape "
                            f"{getattr(y, 'shape', '?')} for {n} value(s), not float32 of shape ({n},)")
    if not np.isfinite(y).all():
        raise _breach(name, f"decode of its own encoding of {n} finite value(s) gave NaN or infinity")
    bound = _call(name, "error_bound(x)", lambda: codec.error_bound(x))
    if bound is not None:
        error = np.abs(y.astype(np.float64) - x.astype(np.float64))
        worst = int(np.argmax(error))
        slack = 4 * float(np.spacing(np.float32(np.abs(x).max())))
        if not error[worst] <= float(bound) * (1 + 1e-6) + slack:
            raise _breach(name, f"decode(encode(x)) is off by {error[worst]:.6g} at element {worst} of {n}, "
                                f"beyond its error_bound(x) = {float(bound):.6g}")
    base = np.linspace(-2.0, 2.0, n, dtype=np.float32)
    expect = base + y
    into = np.full(n, np.nan, np.float32)
    _call(name, "decode(buf, out=)", lambda: codec.decode(buf, out=into))
    added = base.copy()
    _call(name, "decode(buf, out, accumulate=True)", lambda: codec.decode(buf, added, accumulate=True))
    if not np.array_equal(into.view(np.int32), y.view(np.int32)):
        raise _breach(name, "decode(buf, out=) differs from decode(buf)")
    if not np.array_equal(added.view(np.int32), expect.view(np.int32)):
        raise _breach(name, "decode(buf, out, accumulate=True) differs from out + decode(buf)")
    return buf


def _check_non_finite(codec: Codec, name: str, x: np.ndarray) -> None:
    """NaN or infinity in the input is a CodecError (a diverged worker's gradient: the
    runtime tells it from a codec's failure by that)."""
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[-1] = bad
        try:
            codec.encode(y)
        except PluginFault as exc:
            raise _breach(name, f"encode of a vector holding {bad} raised {exc.cause}, not CodecError") from None
        except CodecError:
            continue
        raise _breach(name, f"encode of a vector holding {bad} did not raise CodecError")


def _reheadered(buf: np.ndarray, payload: np.ndarray | None = None, **fields) -> np.ndarray:
    """``buf`` with its payload replaced and header fields changed, the header CRC valid."""
    payload = buf[HEADER_SIZE:] if payload is None else payload
    header = read_header(buf)._replace(payload_len=payload.size)._replace(**fields)
    out = np.concatenate([buf[:HEADER_SIZE], payload])
    _write_header(out, header, with_crc=False)
    return out


def _bad_frames(codec: Codec, buf: np.ndarray):
    """(what, frame, must_raise) for the frames the contract decodes."""
    header = read_header(buf)
    payload = buf[HEADER_SIZE:]
    other = 1 if codec.wire_id != 1 else 2
    yield f"a frame of wire id {other}", _reheadered(buf, wire_id=other), True
    if payload.size:
        yield "a frame one payload byte short", _reheadered(buf, payload[:-1]), True
    yield "a frame one payload byte long", _reheadered(buf, np.concatenate([payload, [0]]).astype(np.uint8)), True
    changes = (("bits", header.bits ^ 0x81), ("flags", header.flags ^ 0x80),
               ("param_a", (header.param_a + 3) % 2**32), ("param_b", (header.param_b + 1000) % 2**32),
               ("n", header.n + 1), ("n", max(header.n - 1, 0)))
    for field, value in changes:
        yield f"a frame with header {field} {value}", _reheadered(buf, **{field: value}), False
    for position in sorted({0, payload.size // 3, payload.size // 2, payload.size - 1}):
        if position < payload.size:
            damaged = payload.copy()
            damaged[position] ^= 0xFF
            yield f"a frame with payload byte {position} flipped", _reheadered(buf, damaged), False


def _check_bad_frames(codec: Codec, name: str, buf: np.ndarray) -> None:
    for what, frame, must_raise in _bad_frames(codec, buf):
        try:
            y = codec.decode(frame)
        except PluginFault as exc:
            raise _breach(name, f"decode of {what} raised {exc.cause}, not CodecError") from None
        except CodecError:
            continue
        except Exception as exc:  # noqa: BLE001 - the codec's own code, reported in one line
            raise _breach(name, f"decode of {what} raised {_describe(exc)}, not CodecError") from None
        if must_raise:
            raise _breach(name, f"decode of {what} did not raise CodecError (a decoder checks the "
                                "payload length against the header)")
        n = read_header(frame).n
        if not (isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (n,)):
            raise _breach(name, f"decode of {what} gave neither CodecError nor {n} float32 values")
