#!/usr/bin/env bash
# GPU checks of 9171188: the suites with memcheck, then racecheck/synccheck of the parallel suite's
# in-process group cases (the changed begin() and its new kernel).
set -u
R=$OUT/r
mkdir -p $R
timeout 420 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
p=build/tests/gpu/chunkloss_test_parallel_gpu
timeout 150 compute-sanitizer --error-exitcode 9 --tool racecheck --kernel-name kns=chunkloss $p -tc='*in-process group*' > $R/racecheck_parallel.txt 2>&1; echo "rc=$?" >> $R/racecheck_parallel.txt
timeout 120 compute-sanitizer --error-exitcode 9 --tool synccheck --kernel-name kns=chunkloss $p -tc='*in-process group*' > $R/synccheck_parallel.txt 2>&1; echo "rc=$?" >> $R/synccheck_parallel.txt
timeout 120 compute-sanitizer --error-exitcode 9 --tool memcheck build/tests/gpu/chunkloss_test_gpu -tc='gpu: with check_finite*' > $R/memcheck_precheck.txt 2>&1; echo "rc=$?" >> $R/memcheck_precheck.txt
cd $OUT && tar czf r.tgz r && rm -rf r
