#!/usr/bin/env bash
# Issue 34's table on one GPU node, in one go: DDP fp32 and its fp16 hook, then mpigrad's
# layouts, each a `mpigrad bench peers` run on examples/gpu/resnet18.toml at P = 2 (two
# workers; on a one-GPU node they share it: DDP over gloo, mpigrad with --share-gpu, each
# said in one line). Each run prints its seconds per iteration and its ratio; the traces go
# under OUT (default gpu-table). Extra arguments go to every mpigrad train, e.g. --tf32 off.
#   bash examples/gpu/table.sh [OUT] [train options]
set -euo pipefail
out=${1:-gpu-table}
shift || true
config=examples/gpu/resnet18.toml
layouts=(
    "--servers 1 --codec fp32"
    "--servers colocated --codec fp32"
    "--servers colocated --pipeline --codec fp32"
    "--servers colocated --pipeline --codec uniform --bits 8"
    "--servers colocated --codec uniform --bits 2"
)
mpigrad bench peers --config "$config" --workers 2 --variants fp32,fp16 --no-mpigrad --out "$out/ddp" -- --device cuda "$@"
for layout in "${layouts[@]}"; do
    name=$(echo "$layout" | tr -d '-' | tr ' ' '_')
    # shellcheck disable=SC2086  # the layout is a list of options
    mpigrad bench peers --config "$config" --workers 2 --variants none --out "$out/$name" -- --device cuda $layout "$@"
done
