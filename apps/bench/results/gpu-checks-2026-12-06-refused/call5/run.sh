#!/usr/bin/env bash
# Final GPU checks of d2f6ea7: the suites with memcheck (the refused-call case included), then the
# issue's table (default GEMMs).
set -u
R=$OUT/r
mkdir -p $R
timeout 400 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
REPEATS=10 GEMMS=default CASES=table timeout 150 bash apps/bench/run_ce_gpu.sh $R/table build/apps/bench/chunkloss-bench > $R/table.log 2>&1; echo "rc=$?" >> $R/table.log
cd $OUT && tar czf r.tgz r && rm -rf r
