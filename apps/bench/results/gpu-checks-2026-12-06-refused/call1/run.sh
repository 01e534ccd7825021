#!/usr/bin/env bash
# GPU checks of b427430 (refused calls add nothing): the suites with memcheck; memcheck, racecheck
# and synccheck of the new cross-entropy case and the parallel suite's in-process group cases.
set -u
R=$OUT/r
mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>/dev/null
timeout 330 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
p=build/tests/gpu/chunkloss_test_parallel_gpu
ce=build/tests/gpu/chunkloss_test_gpu
new='gpu: a call with bad values*'
timeout 90 compute-sanitizer --error-exitcode 9 --tool memcheck $ce -tc="$new" > $R/memcheck_new.txt 2>&1; echo "rc=$?" >> $R/memcheck_new.txt
timeout 60 compute-sanitizer --error-exitcode 9 --tool synccheck --kernel-name kns=chunkloss $ce -tc="$new" > $R/synccheck_new.txt 2>&1; echo "rc=$?" >> $R/synccheck_new.txt
timeout 90 python3 tests/gpu/racecheck.py compute-sanitizer --tool racecheck --racecheck-memcpy-async no $ce -tc="$new" > $R/racecheck_new.txt 2>&1; echo "rc=$?" >> $R/racecheck_new.txt
cd $OUT && tar czf r.tgz r && rm -rf r
