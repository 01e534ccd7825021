#!/usr/bin/env bash
# GPU checks of c88125e (a valid rank names the first rejecting rank and its message): the suites
# with memcheck.
set -u
R=$OUT/r
mkdir -p $R
timeout 360 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
cd $OUT && tar czf r.tgz r && rm -rf r
