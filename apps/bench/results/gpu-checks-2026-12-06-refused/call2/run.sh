#!/usr/bin/env bash
# The parallel group cases under racecheck and synccheck, then the table (default GEMMs).
set -u
R=$OUT/r
mkdir -p $R
p=build/tests/gpu/chunkloss_test_parallel_gpu
timeout 150 python3 tests/gpu/racecheck.py compute-sanitizer --tool racecheck --racecheck-memcpy-async no $p -tc='*in-process group*' > $R/racecheck_parallel.txt 2>&1; echo "rc=$?" >> $R/racecheck_parallel.txt
timeout 100 compute-sanitizer --error-exitcode 9 --tool synccheck --kernel-name kns=chunkloss $p -tc='*in-process group*' > $R/synccheck_parallel.txt 2>&1; echo "rc=$?" >> $R/synccheck_parallel.txt
REPEATS=10 GEMMS=default CASES=table timeout 200 bash apps/bench/run_ce_gpu.sh $R/table build/apps/bench/chunkloss-bench > $R/table.log 2>&1; echo "rc=$?" >> $R/table.log
cd $OUT && tar czf r.tgz r && rm -rf r
