#!/bin/sh
# The 8B config's train step on 8 GPUs per recipe and backend, compiled without the GPUs
# (docs/sharding.md, "Will it fit?"): one JSON report per arm beside this script.
# Usage: sh results/gpu_compile/fit/run.sh TARGET [EXTRA --config.KEY=VALUE ...]
set -u
target=$1; shift
case $target in
  h100|h200) arms="bf16:xla fp8:xla fp8:pallas fp8:mosaic fp8:native mxfp4-dh16:xla mxfp4-dh16:pallas mxfp4-dh16:mosaic mxfp4-dh16:native" ;;
  *) arms="bf16:xla fp8:xla fp8:pallas fp8:native mxfp4-dh16:xla mxfp4-dh16:pallas mxfp4-dh16:native" ;;
esac
tag=$(echo "$*" | tr -d ' ' | sed 's/--config\.//g; s/[^a-z0-9=.]/_/g')
for arm in $arms; do
  recipe=${arm%%:*}; backend=${arm#*:}
  out=results/gpu_compile/fit/${target}_${recipe}_${backend}${tag:+_$tag}.json
  python -m fp4jax.bench gpu_fit --target "$target" --devices 8 --config configs/llama3_8b_c4.py \
      --config.quant.name="$recipe" --config.quant.backend="$backend" "$@" --out "$out" \
      2>&1 | grep -v -i warn | tail -1
done
