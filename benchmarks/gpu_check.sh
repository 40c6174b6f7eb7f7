#!/usr/bin/env bash
# The one-call GPU check of fp4jax: at most GPU_CHECK_BUDGET_S (500 s) of stages on one GPU.
#
# The plan (python -m fp4jax.bench gpu_plan: printed first, each stage's time
# box and their sum against the budget) runs the stages in the order a short
# call must answer them; each stage runs under `timeout` in its own box
# (capped by what is left of the budget), and one that fails or runs out of
# time does not stop the others:
#   env         nvidia-smi, python, jax/jaxlib, devices, compute capability,
#               which of pyproject.toml's dependencies are missing
#   crosscheck  the quantizers and four recipes' fwd+bwd on the GPU (xla and
#               pallas) against XLA:CPU in the same machine, per input class
#               (subnormal, NaN, Inf, ties, ...): pallas = xla on the device
#   linear      fwd+bwd of one layer, (16384,4096,14336) and (16384,4096,4096):
#               the bf16 recipe, fp8 / mxfp4 / mxfp4-dh16 on every backend the
#               check runs (all of fp4jax.backends but native, where the
#               installed jax runs them); the forward GEMM alone; optimized HLO
#               of each variant and its kernel count
#   train_R_B   configs/ablation_gpu.py (125M shape, blocks scanned),
#               TRAIN_STEPS steps of recipe R on backend B, one process each
#               (peak memory is per process): bf16, then mxfp4-dh16 and fp8 on
#               every backend (fp8 on pallas is xla's program: not repeated);
#               tokens/s, MFU, peak GiB, the first step's time (its compile)
#   tests       tests/test_kernels.py, tests/test_hopper_gemm.py, then the
#               backends' agreement tests of test_dot.py and test_backends.py,
#               the kernels compiled for the GPU (Pallas interprets only off
#               GPUs: fp4jax.kernels.target)
#   quantize    fused quantize (row, col, +-H16) vs copy, 23296x23296 bf16 (1 GiB)
#   native      (compute capability >= 10 only) backend=native,
#               (16384,4096,14336): mxfp8 / mxfp4 / nvfp4, each on its own route
#               and forced through scaled_matmul and scaled_dot; the GEMM kinds
#               of its optimized HLO and TFLOP/s
#   compile     (compute capability >= 10 only) python -m fp4jax.bench
#               gpu_compile --target device --what linear,kernels: the linear
#               layers and kernels compiled on this GPU, against the deviceless
#               report made with this jax (results/gpu_compile/<card>-jax<this
#               jax>.json where it exists): does compiling without the device
#               predict it?
#   ablation_short  optional, only when named (it needs the whole call):
#               configs/ablation_gpu_short.py, fp8 / mxfp4 / mxfp4-dh16
#               at the 125M shape for 300 steps; checkpoints in /tmp, each
#               finished run's records in $OUT/ablation_gpu_short. Run it as
#               GPU_CHECK_STAGES="env ablation_short" GPU_CHECK_BUDGET_S=540
# Over the budget the plan leaves out train arms from the last (bf16 stays),
# then stages from the last, and says so.
# Results: $OUT/summary.md (stages, goals in the order above, each measured or
# why not, tables), $OUT/summary.json, $OUT/gpu_check.log (everything printed),
# $OUT/results.tar.gz (each stage's JSON/markdown/log, plan.tsv, pytest.xml,
# hlo/*.txt). GPU_CHECK_STAGES="env linear" runs only those stages (a rerun
# after a fix).
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
# The plan alone (seconds, nothing runs; GPU_CHECK_CC=10.0 for a Blackwell GPU's):
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --plan
# CPU dry run (tiny sizes, CPU backend, the plan's stages with boxes and budget
# x 3 for interpreted Pallas; minutes on 2 cores), from the repository root:
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --dry-run   (or DRY_RUN=1)
set -uo pipefail
DRY_RUN=${DRY_RUN:-0}
PLAN_ONLY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --plan) PLAN_ONLY=1 ;;
    *) echo "gpu_check: unknown argument $arg (allowed: --dry-run, --plan)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$(pwd)/$PY  # the stages run in other folders
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "gpu_check: PYTHON=$PY cannot run or cannot import jax (give an interpreter with jax installed)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/fp4jax_gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/fp4jax_gpu_check_work}
BUDGET_S=${GPU_CHECK_BUDGET_S:-500}
STAGES=${GPU_CHECK_STAGES:-"env crosscheck linear train tests quantize native compile"}
TRAIN_STEPS=${TRAIN_STEPS:-20}
# Blocks scanned: on an H200 (2026-12-04) compiling mxfp4-dh16's 12 unscanned blocks
# outlasted the stage's 100 s box. TRAIN_FLAGS= (empty) trains them unscanned.
TRAIN_FLAGS=${TRAIN_FLAGS---scan_layers}
REPO=$(pwd)
export PYTHONUNBUFFERED=1
# The GPU's compute capability decides the plan (the dry run: GPU_CHECK_CC, an H200's 9.0).
if [[ $DRY_RUN == 1 || $PLAN_ONLY == 1 ]]; then
  CC=${GPU_CHECK_CC:-9.0}
else
  CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  [[ $CC =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "gpu_check: nvidia-smi gave no compute capability ($CC): planning for 9.0"; CC=9.0; }
fi
if [[ $PLAN_ONLY == 1 ]]; then
  JAX_PLATFORMS=cpu PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PY" -m fp4jax.bench gpu_plan \
    --cc "$CC" --budget "$BUDGET_S" --stages "$STAGES" > /dev/null
  exit $?
fi
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$SECONDS

if [[ $DRY_RUN == 1 ]]; then
  export JAX_PLATFORMS=cpu
  TINY=--tiny
  SCALE=3  # boxes and budget: interpreted Pallas on a shared CPU
  TESTS=("tests/test_kernels.py::test_e2m1_codes_and_values_match_the_casts"
         "tests/test_kernels.py::test_interpret_none_runs_as_interpret_true_here"
         "tests/test_dot.py::test_backend_names")
else
  export JAX_PLATFORMS=cuda
  TINY=
  SCALE=1
  # test_kernels first (the kernels' fixes), the Hopper GEMM's (they skip on jax < 0.11),
  # then the backends' agreement with xla (test_kernels, test_backends and test_dot's
  # did not fit 150 s on an H200).
  TESTS=(tests/test_kernels.py tests/test_hopper_gemm.py
         "tests/test_dot.py::test_pallas_backend_matches_xla"
         "tests/test_dot.py::test_per_tensor_operands_on_pallas_are_xlas"
         "tests/test_dot.py::test_backend_names"
         tests/test_backends.py)
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

# The plan: "stage<TAB>box" lines in the order to run; its sum against the budget printed.
$PY -m fp4jax.bench gpu_plan --cc "$CC" --budget "$BUDGET_S" --stages "$STAGES" \
  > "$WORK/plan.tsv" 2> "$WORK/plan.txt"
cat "$WORK/plan.txt"
(( $(wc -l < "$WORK/plan.tsv") )) || { echo "gpu_check: empty plan"; exit 2; }
BUDGET_S=$(( BUDGET_S * SCALE ))

# stage NAME BOX CMD...: CMD under timeout (BOX seconds, capped by the budget left).
stage() {
  local name=$1 box=$2 left t rc
  shift 2
  box=$(( box * SCALE ))
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

# fd 3: the stages' commands may read standard input.
while IFS=$'\t' read -r -u 3 s box; do
  case $s in
    env)
      stage env "$box" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_cap --format=csv 2>&1 || true; nvidia-smi 2>&1 | head -20 || true; $PY -m fp4jax.bench gpu_check env --work $WORK $TINY" ;;
    tests)
      # -v: each test's outcome is printed as it ends, so a stage cut by its box still
      # names the tests that failed (the summary and pytest.xml come only at the end).
      stage tests "$box" $PY -m pytest -v --tb=short -p no:cacheprovider --durations=15 \
        --junitxml="$WORK/pytest.xml" "${TESTS[@]}" ;;
    quantize|linear|native)
      stage "$s" "$box" $PY -m fp4jax.bench gpu_check "$s" --work "$WORK" $TINY ;;
    train_*)
      run=${s#train_}  # RECIPE_BACKEND (recipe names have no "_")
      stage "$s" "$box" $PY -m fp4jax.bench train_speed --config configs/ablation_gpu.py \
        --recipe "${run%_*}" --backend "${run##*_}" --steps "$TRAIN_STEPS" $TINY $TRAIN_FLAGS \
        --out "$WORK/$s.json" ;;
    ablation_short)
      if [[ $DRY_RUN == 1 ]]; then
        short=(--config.model.name=tiny --config.steps=4 --config.warmup_steps=1 --config.batch_size=4
               --config.seq_len=64 --config.eval_every=2 --config.eval_batches=1 --config.eval_batch_size=4
               --config.checkpoint_every=4 --config.diagnostics.every=2 --config.diagnostics.window=2
               --config.diagnostics.ref_batch_size=4)
      else short=(); fi
      rm -rf /tmp/fp4jax_ablation_short
      stage ablation_short "$box" $PY -m fp4jax.experiments.ablation --config=configs/ablation_gpu_short.py \
        --workdir=/tmp/fp4jax_ablation_short --results="$OUT/ablation_gpu_short" ${short[@]+"${short[@]}"} ;;
    compile)
      # The dry run has no GPU: it compiles for the H200 description (needs the CUDA plugin).
      # Against the deviceless report made with this jax where there is one
      # (results/gpu_compile/<card>-jax<version>.json), so that only the device differs.
      if [[ $DRY_RUN == 1 ]]; then target=h200; card=h200; else
        target=device; card=$([[ ${CC%%.*} -ge 10 ]] && echo b200 || echo h200); fi
      jaxv=$($PY -c "import jax; print(jax.__version__)")
      against="$SRC/results/gpu_compile/$card-jax$jaxv.json"
      [[ -e $against ]] || against="$SRC/results/gpu_compile/$card.json"
      stage compile "$box" $PY -m fp4jax.bench gpu_compile --target "$target" --what linear,kernels \
        --against "$against" --out "$WORK/compile.json" ;;
    crosscheck)
      if [[ $DRY_RUN == 1 ]]; then sizes=(--rows 2 --n 64 --linear 64,64,32); else sizes=(); fi
      stage crosscheck "$box" bash -c "JAX_PLATFORMS=cpu $PY -m fp4jax.bench crosscheck --save $WORK/crosscheck_cpu.npz ${sizes[*]} && $PY -m fp4jax.bench crosscheck --against $WORK/crosscheck_cpu.npz --out $WORK/crosscheck ${sizes[*]}" ;;
  esac
done 3< "$WORK/plan.tsv"

$PY -m fp4jax.bench gpu_summary --work "$WORK" --out "$OUT"
pack
echo "gpu_check: $(( SECONDS - T0 )) s; results in $OUT (summary.md, summary.json, gpu_check.log, results.tar.gz)"
