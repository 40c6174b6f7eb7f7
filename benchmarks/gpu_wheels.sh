#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels benchmarks/gpu_check.sh installs
# on the GPU machine, which reaches no package index: the project's runtime and
# test dependencies its image lacks, for CPython 3.12 (the image's) and 3.13.
# Run here, in the repository root, before the device call:
#   bash benchmarks/gpu_wheels.sh          # PIP="python3 -m pip" by default
set -euo pipefail
PIP=${PIP:-python3 -m pip}
WHEELS=(grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 ml_collections==1.1.0
        tensorboardX==2.6.5 nvidia-cuda-nvdisasm==13.5.37)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
for py in 3.12 3.13; do
  $PIP download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
done
ls -l .whl
du -sh .whl
