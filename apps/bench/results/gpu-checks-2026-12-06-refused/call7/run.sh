#!/usr/bin/env bash
# GPU suites at 123493e (host-side agreement changes since d2f6ea7).
set -u
R=$OUT/r
mkdir -p $R
timeout 400 bash tests/gpu/run_gpu_checks.sh build $R/checks suites > $R/suites.log 2>&1
echo "suites rc=$?" >> $R/suites.log
cd $OUT && tar czf r.tgz r && rm -rf r
