#!/usr/bin/env bash
# The main job: set up, build the two apps (CPU only), SFT a small decoder on the bundled addition
# data, preference-tune it (DPO by default, or the loss given: dpo|orpo|simpo|cpo|kto, or online
# GRPO: grpo), then print
# the before/after table of chunkloss-eval on the held-out files. Outputs go to runs/ (or
# $CHUNKLOSS_RUNS): checkpoints, metrics.jsonl and training.svg per stage, eval-LOSS.json.
set -euo pipefail
cd "$(dirname "$0")/.."
loss="${1:-dpo}"
case "$loss" in
  dpo | orpo | simpo | cpo | kto | grpo) ;;
  *) echo "usage: apps/run_main_job.sh [dpo|orpo|simpo|cpo|kto|grpo]" >&2; exit 2 ;;
esac
runs="${CHUNKLOSS_RUNS:-runs}"

bash .ci/setup
cmake -S . -B build-cpu -G Ninja -DCHUNKLOSS_WITH_CUDA=OFF -DCHUNKLOSS_BUILD_TESTS=OFF >/dev/null
cmake --build build-cpu -j2 --target chunkloss_train chunkloss_eval
train=build-cpu/apps/train/chunkloss-train
evaluate=build-cpu/apps/eval/chunkloss-eval

rm -rf "$runs/sft" "$runs/$loss"
"$train" --config apps/configs/sft.ini --save "$runs/sft"
"$train" --config "apps/configs/$loss.ini" --init "$runs/sft" --save "$runs/$loss"
echo
"$evaluate" --model "$runs/sft" --name "sft (before)" --model "$runs/$loss" --name "$loss (after)" \
  --reference "$runs/sft" --json "$runs/eval-$loss.json"
