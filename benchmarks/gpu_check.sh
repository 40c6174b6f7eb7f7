#!/usr/bin/env bash
# The one-call GPU check of fp4jax: < 9 minutes on one H200.
#
# Stages, in order, each under `timeout` (its own box, capped by what is left
# of GPU_CHECK_BUDGET_S, default 500 s); a stage that fails or runs out of
# time does not stop the others:
#   compile     python -m fp4jax.bench gpu_compile --target device --what linear,kernels:
#               the linear layer of every recipe and backend and every Pallas kernel,
#               compiled on this GPU as the deviceless report compiled them for the
#               same card (results/gpu_compile/h200-jax<this jax>.json where it
#               exists, else h200.json), and the differences
#               between the two (GEMM kinds, operand types, SASS instructions): does
#               compiling without the device predict it? Runs first
#   env         nvidia-smi, python, jax/jaxlib, devices, compute capability,
#               which of pyproject.toml's dependencies are missing
#   native      backend=native, (16384,4096,14336): mxfp8 / mxfp4 / nvfp4, each on
#               its own route and forced through scaled_matmul and scaled_dot;
#               per variant the GEMM kinds of its optimized HLO (cuDNN
#               block-scaled custom call, scaled-dot for Triton, or plain dot)
#               and TFLOP/s. Runs second, so a short call still shows it. On an
#               H200 (compute capability 9.0: no FP4 units) it says so and
#               measures the emulation
#   tests       tests/test_kernels.py, test_backends.py and test_dot.py's
#               backend tests, the kernels compiled by Triton (Pallas
#               interprets only off GPUs: fp4jax.kernels.target),
#               each against the `xla` path on the same GPU bit for bit
#   crosscheck  the quantizers and four recipes' fwd+bwd on the GPU (xla and
#               pallas) against XLA:CPU in the same machine, per input class
#               (subnormal, NaN, Inf, ties, ...)
#   quantize    fused quantize (row, col, +-H16) vs copy, 8192x8192 bf16
#   linear      fwd+bwd of one layer, (16384,4096,14336) and (16384,4096,4096),
#               bf16 / fp8 / mxfp4 / mxfp4-dh16 x xla / pallas; the forward
#               GEMM alone; optimized HLO of each variant and its kernel count
#   train_*     configs/ablation_gpu.py (125M shape), TRAIN_STEPS steps each:
#               bf16, mxfp4-dh16 on xla, mxfp4-dh16 on pallas; one process
#               each (peak memory is per process): tokens/s, MFU, peak GiB
#   ablation_short  optional, not in the default stages (it needs the whole
#               call): configs/ablation_gpu_short.py, fp8 / mxfp4 / mxfp4-dh16
#               at the 125M shape for 300 steps; checkpoints in /tmp, each
#               finished run's records in $OUT/ablation_gpu_short. Run it as
#               GPU_CHECK_STAGES="env ablation_short" GPU_CHECK_BUDGET_S=540
# Results: $OUT/summary.md (stages, goals, tables), $OUT/summary.json,
# $OUT/gpu_check.log (everything printed), $OUT/results.tar.gz (each stage's
# JSON/markdown/log, pytest.xml, hlo/*.txt). GPU_CHECK_STAGES="env linear"
# runs only those stages (a rerun after a fix).
#
# Wheels: the device image (python 3.12, jax 0.11 with CUDA 13, flax, optax,
# orbax, chex, absl-py, matplotlib, pytest, pytest-xdist, hypothesis,
# tokenizers, sentencepiece) lacks grain (+ array_record, portpicker),
# ml_collections and tensorboardX. benchmarks/gpu_wheels.sh downloads them
# into .whl/ (git-ignored, about 9 MB, cp312 and cp313):
#   array_record 0.8.6 (3.8 MB per python), grain 0.2.18 (0.6 MB per python),
#   ml_collections 1.1.0 (77 kB), tensorboardx 2.6.5 (88 kB), portpicker 1.6.0 (17 kB),
#   nvidia-cuda-nvdisasm 13.5.37 (5 MB: the compile stage reads the kernels' SASS)
# Here they are installed with pip --no-index (never the network), only the
# ones whose distribution is not installed already, matching this python.
#
# On the GPU machine, from the repository root with .whl/ beside it, under a
# 570 s limit (500 s of stages + start-up): bash benchmarks/gpu_check.sh
# CPU dry run (tiny sizes, CPU backend, every stage; a few minutes on 2 cores):
#   DRY_RUN=1 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh   (run from the repository root)
set -uo pipefail
DRY_RUN=${DRY_RUN:-0}
PY=${PYTHON:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$(pwd)/$PY  # the stages run in other folders
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "gpu_check: PYTHON=$PY cannot run or cannot import jax (give an interpreter with jax installed)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/fp4jax_gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/fp4jax_gpu_check_work}
BUDGET_S=${GPU_CHECK_BUDGET_S:-500}
STAGES=${GPU_CHECK_STAGES:-"compile env native tests crosscheck quantize linear train"}
TRAIN_STEPS=${TRAIN_STEPS:-20}
# Blocks scanned: on an H200 (2026-12-04) compiling mxfp4-dh16's 12 unscanned blocks
# outlasted the stage's 100 s box. TRAIN_FLAGS= (empty) trains them unscanned.
TRAIN_FLAGS=${TRAIN_FLAGS---scan_layers}
REPO=$(pwd)
export PYTHONUNBUFFERED=1
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$SECONDS

if [[ $DRY_RUN == 1 ]]; then
  export JAX_PLATFORMS=cpu
  TINY=--tiny
  TESTS=("tests/test_kernels.py::test_e2m1_codes_and_values_match_the_casts"
         "tests/test_kernels.py::test_interpret_none_runs_as_interpret_true_here"
         "tests/test_dot.py::test_backend_names")
else
  export JAX_PLATFORMS=cuda
  TINY=
  # The kernels' and backends' tests whole, of test_dot the backends' agreement
  # (the whole file did not fit the box on an H200 after Triton compiled the kernels').
  TESTS=(tests/test_kernels.py tests/test_backends.py
         "tests/test_dot.py::test_pallas_backend_matches_xla"
         "tests/test_dot.py::test_per_tensor_operands_on_pallas_are_xlas"
         "tests/test_dot.py::test_backend_names")
fi

# --- wheels: the missing dependencies, from .whl/ only ---
tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels=()
for w in .whl/*-py3-none-any.whl .whl/*-py2.py3-none-any.whl .whl/*-"$tag"-"$tag"-*.whl; do
  [[ -e $w ]] && wheels+=("$w")
done
if (( ${#wheels[@]} )); then
  # Only distributions not installed already (a carried copy would shadow the image's).
  mapfile -t missing < <($PY - "${wheels[@]}" <<'EOF'
import importlib.metadata, os, sys
for path in sys.argv[1:]:
  name = os.path.basename(path).split("-")[0]
  try:
    importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    print(path)
EOF
)
  echo "wheels for $tag: ${wheels[*]}"
  echo "to install (not installed yet): ${missing[*]:-none}"
  if (( ${#missing[@]} )); then
    if [[ $DRY_RUN == 1 ]]; then
      echo "dry run: not installing"
    else
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${missing[@]}" || echo "wheel install FAILED"
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
  fi
else
  echo "no wheels in .whl/ (run benchmarks/gpu_wheels.sh before the call)"
fi

# The package and its tests outside the checkout.
SRC=/tmp/fp4jax_src
rm -rf "$SRC" && mkdir -p "$SRC"
cp -r "$REPO/fp4jax" "$REPO/tests" "$REPO/configs" "$REPO/results" "$REPO/pyproject.toml" "$SRC/"
cd "$SRC" || exit 1
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}

pack() { tar -czf "$OUT/results.tar.gz" -C "$WORK" . ; }

# stage NAME BOX CMD...: CMD under timeout (BOX seconds, capped by the budget left).
stage() {
  local name=$1 box=$2 left t rc
  shift 2
  [[ $DRY_RUN == 1 ]] && box=$(( box * 3 ))  # interpreted Pallas on a shared CPU
  left=$(( BUDGET_S - (SECONDS - T0) ))
  (( box > left )) && box=$left
  if (( box < 15 )); then
    printf '%s\tnot run\t0\tbudget spent\n' "$name" >> "$WORK/stages.tsv"
    echo "=== $name: not run (budget spent)"
    return
  fi
  echo "=== $name (time box ${box} s, $(( SECONDS - T0 )) s elapsed)"
  t=$SECONDS
  timeout -k 10 "$box" "$@" 2>&1 | tee "$WORK/$name.log"
  rc=${PIPESTATUS[0]}
  (( rc == 124 || rc == 137 )) && rc="$rc (timed out)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t ))" "$box" >> "$WORK/stages.tsv"
  pack
}

for s in $STAGES; do
  case $s in
    env)
      stage env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_cap --format=csv 2>&1 || true; nvidia-smi 2>&1 | head -20 || true; $PY -m fp4jax.bench gpu_check env --work $WORK $TINY" ;;
    tests)
      # -v: each test's outcome is printed as it ends, so a stage cut by its box still
      # names the tests that failed (the summary and pytest.xml come only at the end).
      stage tests 150 $PY -m pytest -v --tb=short -p no:cacheprovider --durations=15 \
        --junitxml="$WORK/pytest.xml" "${TESTS[@]}" ;;
    quantize|linear|native)
      stage "$s" $([[ $s == quantize ]] && echo 75 || echo 150) \
        $PY -m fp4jax.bench gpu_check "$s" --work "$WORK" $TINY ;;
    train)
      for run in bf16:xla mxfp4-dh16:xla mxfp4-dh16:pallas; do
        stage "train_${run%%:*}_${run##*:}" 100 $PY -m fp4jax.bench train_speed --config configs/ablation_gpu.py \
          --recipe "${run%%:*}" --backend "${run##*:}" --steps "$TRAIN_STEPS" $TINY $TRAIN_FLAGS \
          --out "$WORK/train_${run%%:*}_${run##*:}.json"
      done ;;
    ablation_short)
      if [[ $DRY_RUN == 1 ]]; then
        short=(--config.model.name=tiny --config.steps=4 --config.warmup_steps=1 --config.batch_size=4
               --config.seq_len=64 --config.eval_every=2 --config.eval_batches=1 --config.eval_batch_size=4
               --config.checkpoint_every=4 --config.diagnostics.every=2 --config.diagnostics.window=2
               --config.diagnostics.ref_batch_size=4)
      else short=(); fi
      rm -rf /tmp/fp4jax_ablation_short
      stage ablation_short 480 $PY -m fp4jax.experiments.ablation --config=configs/ablation_gpu_short.py \
        --workdir=/tmp/fp4jax_ablation_short --results="$OUT/ablation_gpu_short" ${short[@]+"${short[@]}"} ;;
    compile)
      # The dry run has no GPU: it compiles for the H200 description (needs the CUDA plugin).
      # Against the deviceless report made with this jax where there is one
      # (results/gpu_compile/h200-jax<version>.json), so that only the device differs.
      if [[ $DRY_RUN == 1 ]]; then target=h200; else target=device; fi
      jaxv=$($PY -c "import jax; print(jax.__version__)")
      against="$SRC/results/gpu_compile/h200-jax$jaxv.json"
      [[ -e $against ]] || against="$SRC/results/gpu_compile/h200.json"
      stage compile 150 $PY -m fp4jax.bench gpu_compile --target "$target" --what linear,kernels \
        --against "$against" --out "$WORK/compile.json" ;;
    crosscheck)
      if [[ $DRY_RUN == 1 ]]; then sizes=(--rows 2 --n 64 --linear 64,64,32); else sizes=(); fi
      stage crosscheck 90 bash -c "JAX_PLATFORMS=cpu $PY -m fp4jax.bench crosscheck --save $WORK/crosscheck_cpu.npz ${sizes[*]} && $PY -m fp4jax.bench crosscheck --against $WORK/crosscheck_cpu.npz --out $WORK/crosscheck ${sizes[*]}" ;;
    *) echo "unknown stage $s (allowed: compile env native tests crosscheck quantize linear train ablation_short)" ;;
  esac
done

$PY -m fp4jax.bench gpu_summary --work "$WORK" --out "$OUT"
pack
echo "gpu_check: $(( SECONDS - T0 )) s; results in $OUT (summary.md, summary.json, gpu_check.log, results.tar.gz)"
