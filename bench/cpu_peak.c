// One core's peak rate of the two instructions the CPU kernels' inner loops are built on: a 512-bit
// fp32 FMA (`vfmadd231ps zmm`, 32 flops) and a 512-bit bf16 pair dot product (`vdpbf16ps zmm`, 64
// flops), 12 independent accumulators each so latency does not bound them. It settles what
// "the machine's rate" is beside torch's matmul: whether vdpbf16ps runs at the FMA's instruction rate
// (then bf16 products are 2x fp32's flops) and how far torch's one-thread GEMMs sit from the peaks.
//
//   gcc -O2 bench/cpu_peak.c -o /tmp/cpu_peak && taskset -c 0 /tmp/cpu_peak 10
//
// Prints the best and median of N rounds (the two instructions alternate within each round) and one
// JSON line. AVX-512 BF16 CPUs only (the program checks and says so otherwise).
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { kAcc = 12, kMaxRounds = 64 };
static const long kIters = 20000000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) static double time_fma(__m512* acc) {
  const __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1.0f);
  const double t0 = now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
    __asm__ volatile("" ::"v"(acc[0]), "v"(acc[6]), "v"(acc[11]));
  }
  return (now() - t0) / ((double)kIters * kAcc);
}

__attribute__((target("avx512f,avx512bf16"))) static double time_dpbf16(__m512* acc) {
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x2f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
  const double t0 = now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    __asm__ volatile("" ::"v"(acc[0]), "v"(acc[6]), "v"(acc[11]));
  }
  return (now() - t0) / ((double)kIters * kAcc);
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

__attribute__((target("avx512f"))) int main(int argc, char** argv) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) {
    fprintf(stderr, "cpu_peak: this CPU has no AVX-512 BF16 (vdpbf16ps); nothing to measure\n");
    return 2;
  }
  const int rounds = argc > 1 ? atoi(argv[1]) : 10;
  if (rounds < 1 || rounds > kMaxRounds) {
    fprintf(stderr, "cpu_peak: rounds must be in [1, %d], got %s\n", kMaxRounds, argv[1]);
    return 2;
  }
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_setzero_ps();
  double fma[kMaxRounds], dp[kMaxRounds];
  for (int r = 0; r < rounds; ++r) {
    fma[r] = time_fma(acc);
    dp[r] = time_dpbf16(acc);
  }
  qsort(fma, rounds, sizeof(double), cmp);
  qsort(dp, rounds, sizeof(double), cmp);
  const double fb = fma[0], db = dp[0], fm = fma[rounds / 2], dm = dp[rounds / 2];
  printf("| instruction | ns/insn best | median | GFLOP/s best | median |\n|---|---:|---:|---:|---:|\n");
  printf("| vfmadd231ps zmm | %.3f | %.3f | %.1f | %.1f |\n", fb * 1e9, fm * 1e9, 32e-9 / fb, 32e-9 / fm);
  printf("| vdpbf16ps zmm | %.3f | %.3f | %.1f | %.1f |\n", db * 1e9, dm * 1e9, 64e-9 / db, 64e-9 / dm);
  printf("vdpbf16ps / fma instruction time, best: %.2f; bf16 / fp32 flop rate, best: %.2f\n", db / fb,
         (64 / db) / (32 / fb));
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += _mm512_reduce_add_ps(acc[i]);
  printf("{\"rounds\": %d, \"fma_ns_best\": %.4f, \"fma_ns_median\": %.4f, \"dpbf16_ns_best\": %.4f, "
         "\"dpbf16_ns_median\": %.4f, \"fp32_gflops_best\": %.1f, \"bf16_gflops_best\": %.1f, \"checksum\": %g}\n",
         rounds, fb * 1e9, fm * 1e9, db * 1e9, dm * 1e9, 32e-9 / fb, 64e-9 / db, s);
  return 0;
}
