#!/usr/bin/env bash
# One-call GPU check of fp4jax.kernels (< 8 minutes on one H200):
#   1. python packages: the device image already has jax[cuda13] 0.11.x, flax,
#      optax, chex, pytest, hypothesis, numpy (see the device KINDS.md); what it
#      lacks travels as wheels in .whl/ and is installed here;
#   2. the kernel tests, compiled on the GPU (interpret=None -> Triton), against
#      the XLA reference on the same GPU;
#   3. the benchmark (8192x8192 bf16 quantize vs copy bandwidth; fwd+bwd of the
#      M,K,N = 16384,4096,14336 linear, mxfp4-dh16 vs bf16).
# Outputs under $OUT: performance.md (the table), gpu_tests.log, bench.log, env.txt.
#
# Before the call, on the dev machine, in the repo root (.whl/ is git-ignored;
# ml_collections is the one import missing from the image, pure Python):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl ml_collections==1.1.0
# The device call:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-/tmp/fp4jax_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
REPO=$(pwd)

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The package as pip would lay it out (kernels/ -> fp4jax/kernels), outside the checkout.
SRC=/tmp/fp4jax_src
rm -rf "$SRC" && mkdir -p "$SRC"
cp -r "$REPO/fp4jax" "$REPO/tests" "$REPO/pyproject.toml" "$SRC/"
rm -rf "$SRC/fp4jax/kernels" && cp -r "$REPO/kernels" "$SRC/fp4jax/kernels"
cd "$SRC" || exit 1

export JAX_PLATFORMS=cuda
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib; d = jax.devices()[0]; \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, d.device_kind, \
'compute capability', getattr(d, 'compute_capability', None))"
} 2>&1 | tee "$OUT/env.txt"
python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" \
  || { echo "no GPU backend: see $OUT/env.txt"; exit 1; }

timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=10 \
  tests/test_kernels.py tests/test_backends.py 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?

timeout 240 python3 -m fp4jax.bench kernels --out "$OUT/performance.md" 2>&1 \
  | tee "$OUT/bench.log"
bench_rc=$?

echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc" | tee -a "$OUT/env.txt"
exit $(( tests_rc || bench_rc ))
