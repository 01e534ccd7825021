#!/usr/bin/env bash
# GPU checks of 7096483 (review fixes): the suites with memcheck; memcheck of the widened
# refused-call case.
set -u
R=$OUT/r
mkdir -p $R
timeout 360 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
ce=build/tests/gpu/chunkloss_test_gpu
timeout 150 compute-sanitizer --error-exitcode 9 --tool memcheck $ce -tc='gpu: a call with bad values*' > $R/memcheck_new.txt 2>&1; echo "rc=$?" >> $R/memcheck_new.txt
cd $OUT && tar czf r.tgz r && rm -rf r
