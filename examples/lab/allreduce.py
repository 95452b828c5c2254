"""A torch.distributed peer for ``mpigrad lab --launch each``: one all-reduce over gloo, timed.

    mpigrad lab --nodes 2 --rate 10MB/s --launch each -- python examples/lab/allreduce.py

The lab starts this once in every node with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME set (docs/lab.rst, "Other peers"), which is all
``init_process_group("gloo")`` reads. Each node prints the reduced value and how long the
all-reduce of MEGABYTES (default 5) took on the lab's links. A ring all-reduce over N nodes
moves 2 (N - 1) / N times the tensor each way per node: with 2 nodes at 10 MB/s, about half a
second for 5 MB (0.54 s measured, docs/lab.rst).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
dist.init_process_group("gloo")
x = torch.full((int(megabytes * 1e6) // 4,), float(dist.get_rank() + 1))
dist.all_reduce(x)  # the first one also sets up the connections: not timed
began = time.perf_counter()
dist.all_reduce(x)
seconds = time.perf_counter() - began
line = (f"node {os.environ.get('MPIGRAD_LAB_NODE', dist.get_rank())}: all_reduce of {megabytes:g} MB "
        f"in {seconds:.2f} s (value {x[0].item():g})\n")
os.write(1, line.encode())  # one write: the nodes share the lab's stdout
dist.destroy_process_group()
