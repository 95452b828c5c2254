"""Option validation, bucket layout and kernel-status errors shared by the Numba codecs."""

from __future__ import annotations

from typing import Any

from .. import options
from .base import CodecError, non_finite_error
from .kernels import common

_STATUS_MESSAGES = {
    common.ERR_RANGE: "a value range or scale exceeds the float32 range; refusing to encode",
    common.ERR_BAD_SCALE: "corrupted payload (a scale is negative, non-finite or out of order)",
    common.ERR_OVERRUN: "corrupted payload (a code runs past the end of the stream)",
    common.ERR_BAD_CODE: "corrupted payload (a code the format cannot contain)",
    common.ERR_COUNT: "corrupted payload (decoded element count differs from the header)",
    common.ERR_TRAILING: "corrupted payload (the stream does not end after the last element)",
}


def check_int(codec_id: str, name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an int in [low, high] (bools and floats rejected), else CodecError."""
    return options.check_int(name, value, low, high, error=CodecError, prefix=f"{codec_id}: ")


def check_choice(codec_id: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise CodecError(f"{codec_id}: {name} must be one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")
    return value


def check_bucket_size(codec_id: str, bucket_size: Any) -> int | None:
    """None (one bucket per tensor) or a bucket length in 1..2**32-1."""
    if bucket_size is None:
        return None
    return check_int(codec_id, "bucket_size", bucket_size, 1, 2**32 - 1)


def bucket_layout(param_a: int, n: int) -> tuple[int, int]:
    """(bucket length, bucket count) for a header bucket field (0: one bucket of n)."""
    if param_a == 0:
        return max(n, 1), (1 if n else 0)
    return param_a, -(-n // param_a)


def raise_status(codec_id: str, status: int, messages: dict[int, str] | None = None) -> None:
    """Raise the CodecError that a kernel's status code stands for (nothing for OK);
    ``messages`` gives a codec's own wording of its statuses."""
    if status == common.OK:
        return
    if status == common.ERR_NONFINITE:
        raise non_finite_error(codec_id)
    message = (messages or _STATUS_MESSAGES).get(status, f"kernel status {status}")
    raise CodecError(f"{codec_id}: {message}")


def expect_payload(codec_id: str, header_payload_len: int, expected: int, what: str) -> None:
    if header_payload_len != expected:
        raise CodecError(f"{codec_id}: payload of {header_payload_len} bytes, but {what} "
                         f"take {expected}")
