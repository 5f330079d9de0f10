// The emulated device every emulator library hands its launchers (included once per library,
// its anonymous namespace giving each library its own state): the SM count and shared
// memory limit a test sets, the device error word, scratch allocations filled with garbage as
// fresh device memory would be, and C++ exceptions turned into an error string for ctypes.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

int g_sms = 132;
int g_smem_optin = 227 * 1024;
std::string g_error;
int32_t g_err_word = 0;  // the device error word (DeviceEnv::err)

struct Scratch {
  std::vector<std::unique_ptr<unsigned char[]>> bufs;
};

// Scratch is filled with garbage, as fresh device memory would be.
indexcache::cuda::DeviceEnv env(Scratch& s) {
  indexcache::cuda::DeviceEnv e;
  e.sms = g_sms;
  e.smem_optin = g_smem_optin;
  e.stream = nullptr;
  e.err = &g_err_word;
  e.alloc = [&s](int64_t bytes) -> void* {
    s.bufs.emplace_back(new unsigned char[bytes + 256]);
    unsigned char* p = s.bufs.back().get();
    std::mt19937 rng(static_cast<unsigned>(bytes));
    for (int64_t i = 0; i < bytes + 256; ++i) p[i] = static_cast<unsigned char>(rng());
    return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 255) & ~uintptr_t{255});
  };
  return e;
}

template <class F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return 1;
  }
}

}  // namespace
