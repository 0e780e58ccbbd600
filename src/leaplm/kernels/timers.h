// Region timers of the layer loop and qlinear (LEAPLM_KERNEL_PROFILE=1). They read no kernel data: a Span times
// its scope into one of the fixed regions below; profile() returns {region: (ms, calls)}.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>

namespace {

// With LEAPLM_KERNEL_PROFILE=1 in the environment when the library loads, the layer loop and qlinear sum the wall
// time of each region over every call (`profile()` reads the sums, `profile_reset()` clears them); otherwise a
// region costs one predictable branch. A linear's region includes its activation quantization, which is also
// counted alone under "quantize"; "rope_cache" includes the per-head q/k norms, "norm" the post norms, and "silu"
// is the MLP's activation, SiLU or GELU-tanh.
enum Region : int { R_NORM, R_QUANT, R_QKV, R_ROPE, R_ATTN, R_O, R_GATE_UP, R_SILU, R_DOWN, R_RESID, R_QLINEAR, R_COUNT };
const char* const REGION_NAMES[R_COUNT] = {"norm", "quantize", "qkv", "rope_cache", "attention", "o", "gate_up",
                                           "silu", "down", "residual", "qlinear"};

struct Profile {
  const bool on = [] {
    const char* v = std::getenv("LEAPLM_KERNEL_PROFILE");
    return v != nullptr && v[0] == '1';
  }();
  std::atomic<int64_t> ns[R_COUNT] = {};
  std::atomic<int64_t> calls[R_COUNT] = {};
};

Profile& profile_state() {
  static Profile p;
  return p;
}

class Span {                     // times its scope into a region when profiling is on
 public:
  explicit Span(Region r) : r_(r), on_(profile_state().on) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~Span() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
    profile_state().ns[r_].fetch_add(ns.count(), std::memory_order_relaxed);
    profile_state().calls[r_].fetch_add(1, std::memory_order_relaxed);
  }

 private:
  Region r_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

// The region timers' sums (LEAPLM_KERNEL_PROFILE=1): {region: (milliseconds, calls)}; empty when profiling is off.
std::map<std::string, std::pair<double, int64_t>> profile() {
  std::map<std::string, std::pair<double, int64_t>> out;
  Profile& p = profile_state();
  if (!p.on) return out;
  for (int r = 0; r < R_COUNT; ++r) out[REGION_NAMES[r]] = {p.ns[r].load() * 1e-6, p.calls[r].load()};
  return out;
}

void profile_reset() {
  Profile& p = profile_state();
  for (int r = 0; r < R_COUNT; ++r) p.ns[r].store(0), p.calls[r].store(0);
}

}  // namespace
