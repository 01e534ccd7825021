set -u
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/machine.txt
[ "${ANY:-0}" = 1 ] || nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 3; }
P=build/probe/lt_enum
$P r3-dW-beta1 N T 2304 256000 1024 2304 512000 2304 bf16 1 60 > $OUT/r3-dw-beta1.txt 2>&1
$P r3-dW-beta0 N T 2304 256000 1024 2304 512000 2304 bf16 0 30 > $OUT/r3-dw-beta0.txt 2>&1
$P r3-logits-f32 T N 256000 1024 2304 2304 2304 256000 f32 0 45 > $OUT/r3-logits.txt 2>&1
$P r1-dW-beta1 N T 4096 128256 2048 4096 256512 4096 bf16 1 50 > $OUT/r1-dw-beta1.txt 2>&1
$P r1-logits-f32 T N 128256 2048 4096 4096 4096 128256 f32 0 30 > $OUT/r1-logits.txt 2>&1
for f in $OUT/*.txt; do echo "### $f"; grep -v "^  id\|^h[0-9]" $f | tail -16; done
