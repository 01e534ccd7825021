#!/usr/bin/env bash
# GPU checks of ffdbdea: the suites with memcheck; racecheck and synccheck of the parallel
# suite's in-process group cases (the conditional vocabulary all-reduce, check_counts' recount).
set -u
R=$OUT/r
mkdir -p $R
timeout 420 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
p=build/tests/gpu/chunkloss_test_parallel_gpu
ce=build/tests/gpu/chunkloss_test_gpu
timeout 200 compute-sanitizer --error-exitcode 9 --tool racecheck --kernel-name kns=chunkloss $p -tc='*in-process group*' > $R/racecheck_parallel.txt 2>&1; echo "rc=$?" >> $R/racecheck_parallel.txt
timeout 150 compute-sanitizer --error-exitcode 9 --tool synccheck --kernel-name kns=chunkloss $p -tc='*in-process group*' > $R/synccheck_parallel.txt 2>&1; echo "rc=$?" >> $R/synccheck_parallel.txt
timeout 120 compute-sanitizer --error-exitcode 9 --tool memcheck $ce -tc='gpu: out-of-range*,gpu: with check_finite*,gpu: compute_entropy*' > $R/memcheck_new.txt 2>&1; echo "rc=$?" >> $R/memcheck_new.txt
cd $OUT && tar czf r.tgz r && rm -rf r
