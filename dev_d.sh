mkdir -p /tmp/o
b=./build/apps/bench/chunkloss-bench
GEMMS=measured REPEATS=10 bash apps/bench/run_ce_gpu.sh /tmp/o/measured $b > /tmp/o/measured.log 2>&1
REPEATS=10 bash apps/bench/run_ce_gpu.sh /tmp/o/default $b > /tmp/o/default.log 2>&1
grep -h -E '^\| ce' /tmp/o/measured/summary.md | sed 's/^/measured /'
grep -h -E '^\| ce' /tmp/o/default/summary.md | sed 's/^/default /'
grep -h "error vs float64" /tmp/o/*/exact*.txt
tar czf $OUT/r.tgz -C /tmp o
