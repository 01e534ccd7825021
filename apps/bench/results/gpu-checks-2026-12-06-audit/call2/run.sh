#!/usr/bin/env bash
# GPU checks of 55f757f: the suites with memcheck; racecheck and synccheck of the changed row
# kernel (entropy on the lean path) and of the parallel suite's in-process group cases.
set -u
R=$OUT/r
mkdir -p $R
timeout 420 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
ce=build/tests/gpu/chunkloss_test_gpu
p=build/tests/gpu/chunkloss_test_parallel_gpu
rc=(timeout 200 compute-sanitizer --error-exitcode 9 --tool racecheck --kernel-name kns=chunkloss)
sc=(timeout 150 compute-sanitizer --error-exitcode 9 --tool synccheck --kernel-name kns=chunkloss)
"${rc[@]}" $ce -tc='gpu: compute_entropy*,gpu: LinearCrossEntropy matches*' > $R/racecheck_entropy.txt 2>&1; echo "rc=$?" >> $R/racecheck_entropy.txt
"${sc[@]}" $ce -tc='gpu: compute_entropy*' > $R/synccheck_entropy.txt 2>&1; echo "rc=$?" >> $R/synccheck_entropy.txt
"${rc[@]}" $p -tc='*in-process group*' > $R/racecheck_parallel.txt 2>&1; echo "rc=$?" >> $R/racecheck_parallel.txt
"${sc[@]}" $p -tc='*in-process group*' > $R/synccheck_parallel.txt 2>&1; echo "rc=$?" >> $R/synccheck_parallel.txt
timeout 120 compute-sanitizer --error-exitcode 9 --tool memcheck $ce -tc='gpu: compute_entropy*,gpu: with check_finite*' > $R/memcheck_new.txt 2>&1; echo "rc=$?" >> $R/memcheck_new.txt
cd $OUT && tar czf r.tgz r && rm -rf r
