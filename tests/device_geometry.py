"""Run by tests/test_device_codecs.py in a subprocess with MPIGRAD_DEVICE_THREADS=256 (the
GPU's block, and its 8192-element chunks) under Numba's CUDA simulator: each device codec
encodes a gradient whose buckets span several chunks, and decodes and adds it, and so does a
frame of the uniform, QSGD and TernGrad cases by table (mpigrad.codecs.device.table); prints one JSON line
per case saying whether the frame and the decoded values are the host codec's."""

from __future__ import annotations

import json
import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mpigrad.codecs import HEADER_SIZE, get_codec  # noqa: E402
from mpigrad.codecs.base import header_bytes  # noqa: E402
from mpigrad.codecs.device.table import FrameTable, TableKernels  # noqa: E402
from mpigrad.codecs.device import device_codec, kernels  # noqa: E402
from mpigrad.runtime.exchange.device import device_view, load_cuda  # noqa: E402

CASES = [({"id": "uniform", "bits": 3}, 16385),                                   # one bucket of 3 chunks
         ({"id": "uniform", "bits": 2, "bucket_size": 16384, "rounding": "stochastic", "seed": 3}, 24577),
         ({"id": "qsgd", "bits": 3, "bucket_size": 16384, "norm": "max"}, 16385),
         ({"id": "terngrad", "clip": 0, "bucket_size": 16384}, 16385),
         ({"id": "fp16"}, 16385)]


def main() -> None:
    cuda = load_cuda()
    print(json.dumps({"threads": kernels.THREADS, "chunk": kernels.CHUNK}), flush=True)
    for config, n in CASES:
        x = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(np.float32)
        host = get_codec(config)
        want = host.encode(x).copy()
        decoded = np.ones(n, np.float32)
        host.decode(want, decoded, accumulate=True)
        twin = device_codec(get_codec(config))
        frame = torch.zeros(host.max_encoded_size(n), dtype=torch.uint8)
        size = twin.encode(device_view(cuda, torch.from_numpy(x)), device_view(cuda, frame))
        got = frame[:size].numpy().copy()
        out = torch.ones(n)
        twin.decode(got, device_view(cuda, out), accumulate=True)
        print(json.dumps({"config": config, "n": n, "frame": bool(np.array_equal(got, want)),
                          "decoded": bool(np.array_equal(out.numpy(), decoded))}), flush=True)
    table_case(cuda, CASES[:4])


def table_case(cuda, cases) -> None:
    """The cases' pieces as one frame, by table: encoded, then decoded and added."""
    sizes = [n for _, n in cases]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    x = (np.random.default_rng(7).standard_normal(int(offsets[-1])) * 0.01).astype(np.float32)
    hosts = [get_codec(config) for config, _ in cases]
    pieces = [host.encode(x[offsets[i]:offsets[i + 1]]).copy() for i, host in enumerate(hosts)]
    decoded = np.ones(x.size, np.float32)
    for i, (host, piece) in enumerate(zip(hosts, pieces)):
        host.decode(piece, decoded[offsets[i]:offsets[i + 1]], accumulate=True)
    twins = [device_codec(get_codec(config)) for config, _ in cases]
    encode, decode, pos, headers = FrameTable(encode=True), FrameTable(encode=False), 0, []
    for i, twin in enumerate(twins):
        header = encode.add_encode(twin, int(offsets[i]), sizes[i], pos + HEADER_SIZE)
        decode.add_decode(twin, header, int(offsets[i]), pos + HEADER_SIZE)
        headers.append((pos, header))
        pos += HEADER_SIZE + header.payload_len
    status = cuda.to_device(np.zeros(kernels.STATUS_SLOTS, np.int32))
    frame = torch.zeros(pos, dtype=torch.uint8)
    launch = TableKernels(cuda, cuda.default_stream)
    launch.encode(encode, cuda.to_device(encode.array()), device_view(cuda, torch.from_numpy(x)),
                  device_view(cuda, frame), status)
    got = frame.numpy().copy()
    for start, header in headers:
        got[start:start + HEADER_SIZE] = header_bytes(header)
    out = torch.ones(x.size)
    launch.decode(decode, cuda.to_device(decode.array()), device_view(cuda, torch.from_numpy(got)),
                  device_view(cuda, out), True, status)
    print(json.dumps({"config": "table", "n": int(x.size), "frame": bool(np.array_equal(got, np.concatenate(pieces))),
                      "decoded": bool(np.array_equal(out.numpy(), decoded)), "status": status.copy_to_host().tolist()}),
          flush=True)


if __name__ == "__main__":
    main()
