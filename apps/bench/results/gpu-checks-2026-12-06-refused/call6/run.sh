#!/usr/bin/env bash
# Final GPU checks of d2f6ea7: racecheck and synccheck (tests/gpu/run_gpu_checks.sh races).
set -u
R=$OUT/r
mkdir -p $R
SECONDS=0
timeout 570 bash tests/gpu/run_gpu_checks.sh build $R/checks races > $R/races.log 2>&1
echo "races rc=$? after ${SECONDS}s" >> $R/races.log
cd $OUT && tar czf r.tgz r && rm -rf r
