// Work bounds below which a CPU op runs on the calling thread instead of opening an OpenMP
// region (at::parallel_for). At a decode step's sizes a region costs more than it saves once
// another process holds a core: the region's second thread waits for a scheduler slice, 7-30 ms
// per region measured on a 2-core Xeon with both cores busy, against 0.15 ms for the whole of a
// 16-head sparse_mla call on one thread (docs/profiling.md, seventh round). The splits themselves
// depend on the shape only, so running a call inline changes no value.
//
// Each bound can be overridden for measurement by an environment variable (a decimal count of
// multiply-adds, read once per process); anything else is an error naming the variable.
// Torch-free.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace indexcache {
namespace cpu {

// The bound `env` names, or `fallback` when it is unset or empty; -1 when it is not a
// non-negative decimal integer (the caller reports it).
inline int64_t serial_work_bound(const char* env, int64_t fallback) {
  const char* v = std::getenv(env);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < 0) return -1;
  return static_cast<int64_t>(n);
}

}  // namespace cpu
}  // namespace indexcache
