#!/usr/bin/env bash
# The preference-loss cases of issue 4 on one GPU (bf16, H=4096, V=128256, the first 1/4 of each
# sequence's targets ignored as prompt), each as its own chunkloss-bench call writing OUT/NAME.json,
# OUT/NAME.txt (details and table) and OUT/NAME.err; OUT/summary.md gathers the tables. A failing
# case is reported and the rest still run. About 2-3 minutes of GPU time at REPEATS=5.
#
#   apps/bench/run_preference_gpu.sh OUT_DIR [path/to/chunkloss-bench]
#   (env: REPEATS, default 5)
set -u
# shellcheck source=apps/bench/gpu_cases.sh
source "$(dirname "$0")/gpu_cases.sh"
parse_case_args "$@"
repeats=${REPEATS:-5}
shape=(--device cuda --hidden 4096 --vocab 128256 --prompt-frac 0.25 --repeats "$repeats")
bf16=("${shape[@]}" --dtype bf16)

describe_machine

# A small smoke case first: fails fast if the binary or the device is unusable.
run smoke --loss dpo --pairs 1 --seq-len 256 --device cuda --hidden 1024 --vocab 32768 \
  --dtype bf16 --budget-mib 256 --repeats 1 --exact

# The issue's table. 1.5 GiB = 1536 MiB, 3.9 GiB = 3993.6 MiB.
run dpo-2x1024-1.5g --loss dpo --pairs 2 --seq-len 1024 --budget-mib 1536 "${bf16[@]}"
run dpo-4x2048-3.9g --loss dpo --pairs 4 --seq-len 2048 --budget-mib 3993.6 "${bf16[@]}"
run dpo-2x1024-1g --loss dpo --pairs 2 --seq-len 1024 --budget-mib 1024 "${bf16[@]}"
run dpo-4x2048-1g --loss dpo --pairs 4 --seq-len 2048 --budget-mib 1024 "${bf16[@]}"
run dpo-1x16384-1g --loss dpo --pairs 1 --seq-len 16384 --budget-mib 1024 "${bf16[@]}"
run orpo-4x2048-3.9g --loss orpo --pairs 4 --seq-len 2048 --budget-mib 3993.6 "${bf16[@]}"
run simpo-4x2048-3.9g --loss simpo --pairs 4 --seq-len 2048 --budget-mib 3993.6 "${bf16[@]}"
run kto-4x2048-3.9g --loss kto --pairs 4 --seq-len 2048 --budget-mib 3993.6 "${bf16[@]}"
run cpo-4x2048-3.9g --loss cpo --pairs 4 --seq-len 2048 --budget-mib 3993.6 "${bf16[@]}"

# Why the regime: both regimes forced on the table's first two shapes (no naive run).
run dpo-2x1024-1.5g-regimes --loss dpo --pairs 2 --seq-len 1024 --budget-mib 1536 \
  --regime resident,recompute --no-naive "${bf16[@]}"
run dpo-4x2048-3.9g-regimes --loss dpo --pairs 4 --seq-len 2048 --budget-mib 3993.6 \
  --regime resident,recompute --no-naive "${bf16[@]}"
# The 1 GiB rows where one pair does not fit: recompute against deferred (the first pair at 3
# GEMMs per token, the others recomputed).
run dpo-4x2048-1g-regimes --loss dpo --pairs 4 --seq-len 2048 --budget-mib 1024 \
  --regime recompute,deferred --no-naive "${bf16[@]}"
run dpo-1x16384-1g-regimes --loss dpo --pairs 1 --seq-len 16384 --budget-mib 1024 \
  --regime recompute,deferred --no-naive "${bf16[@]}"
# The 1 GiB rows with the opt-in bf16 logits chunk (one 4x2048 pair's bf16 logits fit 1 GiB, so
# that case can stay resident; the naive check shows the error it costs).
run dpo-4x2048-1g-bf16logits --loss dpo --pairs 4 --seq-len 2048 --budget-mib 1024 \
  --logits-dtype bf16 "${bf16[@]}"
run dpo-1x16384-1g-bf16logits --loss dpo --pairs 1 --seq-len 16384 --budget-mib 1024 \
  --logits-dtype bf16 "${bf16[@]}"
# DPO with precomputed reference log-probs (3-GEMM floor).
run dpo-logps-4x2048-3.9g --loss dpo --reference logps --pairs 4 --seq-len 2048 \
  --budget-mib 3993.6 --no-naive "${bf16[@]}"

# Exactness against float64 on the same input values (targets: bf16 <= 2.0e-3, fp32 <= 1e-5),
# in every regime.
run exact-dpo-bf16-2x1024 --loss dpo --pairs 2 --seq-len 1024 --budget-mib 1536 \
  --regime resident,recompute,deferred --exact "${bf16[@]}"
run exact-dpo-f32-2x1024 --loss dpo --pairs 2 --seq-len 1024 --budget-mib 1536 \
  --regime resident,recompute,deferred --exact "${shape[@]}" --dtype f32
# The long pair: its bf16 dW is accumulated over 32 chunks in the caller's buffer.
run exact-dpo-bf16-1x16384-1g --loss dpo --pairs 1 --seq-len 16384 --budget-mib 1024 --exact \
  --no-naive --device cuda --hidden 4096 --vocab 128256 --prompt-frac 0.25 --dtype bf16 \
  --repeats 1
run exact-kto-bf16-2x1024 --loss kto --pairs 2 --seq-len 1024 --budget-mib 1536 --exact \
  "${bf16[@]}"
run exact-orpo-bf16-2x1024 --loss orpo --pairs 2 --seq-len 1024 --budget-mib 1536 --exact \
  "${bf16[@]}"

summarize "chunkloss-bench preference cases"
[ "$failed" = 0 ]
