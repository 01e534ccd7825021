# $1: tree root, $2: output
T=$1
g++ -std=c++20 -O2 -fopenmp -I$T/lib/core/include -I$T/lib/gpu/include -I$T/losses/include -I$T/lib/dist/include -I$T/kernels/include -I/usr/local/cuda/include -I$T/build/lib/core/include -I$T/build/generated 2>/dev/null \
  .scratch/fwd_probe.cpp -o $2 \
  $T/build/losses/libchunkloss_losses.a $T/build/lib/dist/libchunkloss_dist.a $T/build/lib/gpu/libchunkloss_gpu.a $T/build/kernels/libchunkloss_cuda_kernels.a $T/build/lib/core/libchunkloss_core.a \
  -L/usr/local/cuda/lib64 -L/usr/local/cuda/lib -lcublasLt -lcublas -lcudart -lnccl -lpthread
