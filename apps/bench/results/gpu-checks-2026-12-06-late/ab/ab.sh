#!/usr/bin/env bash
# A/B on one GPU: the bench at 03febc6 (old, the H200 table's code) and at HEAD (new), alternating.
set -u
d=$OUT/ab; mkdir -p $d
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $d/machine.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 500 > $d/trace.csv 2>&1 &
tr=$!
cases=("--rows 8192 --hidden 4096 --vocab 128256 --budget-mib 1024"
       "--rows 16384 --hidden 4096 --vocab 128256 --budget-mib 1024"
       "--rows 16384 --hidden 2304 --vocab 256000 --budget-mib 1024"
       "--rows 16384 --hidden 4096 --vocab 128256 --budget-mib 256")
for round in 1 2; do
  for i in 0 1 2 3; do
    for v in old new; do
      b=build/apps/bench/chunkloss-bench; [ $v = old ] && b=.scratch/old-bench
      echo "== round $round case $i $v" >> $d/log.txt
      timeout 60 $b --loss ce --device cuda --dtype bf16 --repeats 10 --gemm-selection default --no-naive ${cases[$i]} > $d/r$round-c$i-$v.txt 2>&1
      echo "rc $?" >> $d/log.txt
      grep '^| ce' $d/r$round-c$i-$v.txt | tail -1 >> $d/log.txt
    done
  done
done
kill $tr
cat $d/log.txt
cd $OUT && tar czf ab.tgz ab
