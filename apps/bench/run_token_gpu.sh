#!/usr/bin/env bash
# A token objective's cost on one GPU: the mean cross-entropy through LinearCrossEntropy and the
# same loss written as a token objective on TokenLoss (--token-objective nll), at the shapes of
# issue 3's table (bf16, 1 in 7 rows ignored) and an SFT batch with prompts and skipped rows:
# every shape through LinearCrossEntropy, then every shape as the token objective, each case
# against its own floor, timed in the same process as its calls. TokenLoss runs the objective on
# the host between each chunk's statistics and its gradient (the host waits for the stream at
# every chunk), so the difference is that round trip.
# Each case also checks the loss and gradients against the naive materialised computation.
#
#   apps/bench/run_token_gpu.sh OUT_DIR [path/to/chunkloss-bench]   (env: REPEATS, default 10)
set -u
# shellcheck source=apps/bench/gpu_cases.sh
source "$(dirname "$0")/gpu_cases.sh"
parse_case_args "$@"
repeats=${REPEATS:-10}
describe_machine
ce=(--loss ce --device cuda --dtype bf16 --repeats "$repeats")
for obj in none nll; do
  tok=(--token-objective "$obj")
  run "ce-$obj-8192x4096x128256-1g" "${ce[@]}" "${tok[@]}" --rows 8192 --hidden 4096 \
    --vocab 128256 --budget-mib 1024
  run "ce-$obj-16384x2304x256000-1g" "${ce[@]}" "${tok[@]}" --rows 16384 --hidden 2304 \
    --vocab 256000 --budget-mib 1024
  run "ce-$obj-16384x4096x128256-256m" "${ce[@]}" "${tok[@]}" --rows 16384 --hidden 4096 \
    --vocab 128256 --budget-mib 256
  run "ce-$obj-prompts-16384x4096x128256-1g-skip" "${ce[@]}" "${tok[@]}" --rows 16384 \
    --hidden 4096 --vocab 128256 --budget-mib 1024 --ce-seq-len 2048 --prompt-frac 0.3 \
    --skip-ignored-rows
done
summarize "chunkloss-bench: LinearCrossEntropy and the token objective nll"
[ "$failed" = 0 ]
