// Built with -march=x86-64-v3 at configure time and run (CHUNKLOSS_CPU_LEVEL=AUTO): exits 0 when
// this machine runs such code; a machine without AVX2 and FMA fails or faults first.
int main() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("bmi2")
             ? 0
             : 1;
}
