#!/usr/bin/env bash
# The cross-entropy cases of issue 3 on one GPU (bf16 inputs and gradients, mean reduction, 1 in
# 7 rows ignored), each as its own chunkloss-bench call (see gpu_cases.sh); OUT/summary.md
# gathers the tables. The floor and the library alternate in each timed round; --chunked-floor
# also times the library's own GEMMs over its chunks, so a ratio splits into the chunking's share
# and the epilogue's; --phases also times the loss with no gradients, dX only and dW only, so each
# gradient's share shows. OUT/gpu-trace.csv samples the clocks, power and throttle reasons while it
# runs. About 2-3 minutes of GPU time at REPEATS=10 on the H200 (before the prompt cases). GEMMS=measured runs every case with
# --gemm-selection measured (the context times cuBLAS's and cuBLASLt's candidates per GEMM shape;
# the floor's GEMMs alike). Then SFT batches with prompts, with and without skip_ignored_rows; the
# opt-in bf16 logits chunk at the same shapes, and exactness with larger logits (--logit-std 8).
#
#   apps/bench/run_ce_gpu.sh OUT_DIR [path/to/chunkloss-bench]
#   (env: REPEATS, default 10; GEMMS, default or measured, default default; CASES, all or table,
#   default all: table stops after the issue's table and the 2 GiB row, about half the time)
set -u
# shellcheck source=apps/bench/gpu_cases.sh
source "$(dirname "$0")/gpu_cases.sh"
parse_case_args "$@"
repeats=${REPEATS:-10}
describe_machine

nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 >"$out/gpu-trace.csv" 2>&1 &
trace=$!
trap 'kill $trace 2>/dev/null' EXIT

sel=(--gemm-selection "${GEMMS:-default}")
ce=(--loss ce --device cuda --dtype bf16 --repeats "$repeats" "${sel[@]}")
run smoke --loss ce --device cuda --dtype bf16 --rows 512 --hidden 256 --vocab 4096 --repeats 1 \
  "${sel[@]}"

# The issue's table, each with the chunked floor.
run ce-8192x4096x128256-1g "${ce[@]}" --rows 8192 --hidden 4096 --vocab 128256 \
  --budget-mib 1024 --chunked-floor --phases
run ce-16384x4096x128256-1g "${ce[@]}" --rows 16384 --hidden 4096 --vocab 128256 \
  --budget-mib 1024 --chunked-floor --phases
run ce-16384x2304x256000-1g "${ce[@]}" --rows 16384 --hidden 2304 --vocab 256000 \
  --budget-mib 1024 --chunked-floor --phases
run ce-16384x4096x128256-256m "${ce[@]}" --rows 16384 --hidden 4096 --vocab 128256 \
  --budget-mib 256 --chunked-floor --phases
# V = 256000 with twice the budget (2048-row chunks), no naive run.
run ce-16384x2304x256000-2g "${ce[@]}" --rows 16384 --hidden 2304 --vocab 256000 \
  --budget-mib 2048 --chunked-floor --no-naive
if [ "${CASES:-all}" = table ]; then
  summarize "chunkloss-bench cross-entropy cases (the table)"
  [ "$failed" = 0 ]
  exit
fi

# SFT batches with prompts: 8 sequences of 2048 rows, the first 30% of each ignored, every row
# computed and with skip_ignored_rows; both also time the floor over the valid rows alone.
for skip in no yes; do
  extra=()
  [[ $skip == yes ]] && extra=(--skip-ignored-rows)
  run "prompts-ce-16384x4096x128256-1g-skip-$skip" "${ce[@]}" --rows 16384 --hidden 4096 \
    --vocab 128256 --budget-mib 1024 --ce-seq-len 2048 --prompt-frac 0.3 "${extra[@]}"
done
# Short completions: 32 sequences of 512 rows, 384-row prompts. With skip_ignored_rows their
# 128-row completions share chunks (about 2000 rows each) and each chunk's one dW GEMM.
run prompts-ce-16384x4096x128256-1g-short-skip-yes "${ce[@]}" --rows 16384 --hidden 4096 \
  --vocab 128256 --budget-mib 1024 --ce-seq-len 512 --prompt-frac 0.75 --skip-ignored-rows

# Exactness against float64 on the same input values (targets: bf16 <= 2.0e-3, fp32 <= 1e-5).
run exact-bf16-4096x4096x128256 "${ce[@]}" --rows 4096 --hidden 4096 --vocab 128256 \
  --budget-mib 1024 --exact
run exact-bf16-4096x4096x128256-fp32dw "${ce[@]}" --rows 4096 --hidden 4096 --vocab 128256 \
  --budget-mib 1024 --exact --fp32-dw-accum --no-naive
run exact-f32-4096x4096x32768 --loss ce --device cuda --dtype f32 --repeats "$repeats" "${sel[@]}" \
  --rows 4096 --hidden 4096 --vocab 32768 --budget-mib 1024 --exact
run exact-f32-4096x4096x128256 --loss ce --device cuda --dtype f32 --repeats 1 "${sel[@]}" \
  --rows 4096 --hidden 4096 --vocab 128256 --budget-mib 1024 --exact --no-naive
# Exactness at the table's own shapes and budgets: a bf16 dW accumulated in its bf16 buffer is
# rounded once per chunk (4 to 32 chunks here), so its error grows with the chunk count.
for shape in 8192x4096x128256-1024 16384x4096x128256-1024 16384x2304x256000-1024 \
  16384x4096x128256-256; do
  IFS=x- read -r n h v b <<<"$shape"
  run "exact-bf16-${n}x${h}x${v}-${b}m" --loss ce --device cuda --dtype bf16 --repeats 1 \
    "${sel[@]}" --rows "$n" --hidden "$h" --vocab "$v" --budget-mib "$b" --exact --no-naive
done

# The opt-in bf16 logits chunk (logits_dtype bf16): the table's shapes, and its exactness.
for shape in 8192x4096x128256-1024 16384x4096x128256-1024 16384x2304x256000-1024 \
  16384x4096x128256-256; do
  IFS=x- read -r n h v b <<<"$shape"
  run "bf16-logits-ce-${n}x${h}x${v}-${b}m" "${ce[@]}" --logits-dtype bf16 --rows "$n" \
    --hidden "$h" --vocab "$v" --budget-mib "$b" --chunked-floor --no-naive
done
run exact-bf16-logits-4096x4096x128256 "${ce[@]}" --logits-dtype bf16 --rows 4096 --hidden 4096 \
  --vocab 128256 --budget-mib 1024 --exact --no-naive
# Exactness with logits of standard deviation 8 (a trained model's confident rows reach such
# logits): the fp32 chunk, and the bf16 chunk, whose rounding of large logits then shows.
for ld in f32 bf16; do
  run "exact-logit-std8-${ld}-logits-4096x4096x128256" "${ce[@]}" --logits-dtype "$ld" \
    --logit-std 8 --rows 4096 --hidden 4096 --vocab 128256 --budget-mib 1024 --exact --no-naive
done

# PyTorch eager at the table's shapes, where this machine's python3 has torch (torch_ce.py).
if python3 -c 'import torch' 2>/dev/null; then
  echo "== torch-eager: apps/bench/torch_ce.py"
  python3 "$(dirname "$0")/torch_ce.py" --shapes 8192x4096x128256 16384x4096x128256 \
    16384x2304x256000 --repeats "$repeats" --json "$out/torch-eager.json" \
    >"$out/torch-eager.txt" 2>&1 || { echo "FAILED: torch-eager"; failed=$((failed + 1)); }
else
  echo "torch-eager: skipped, python3 has no torch here" | tee "$out/torch-eager.txt"
fi

summarize "chunkloss-bench cross-entropy cases"
[ "$failed" = 0 ]
