// Exact top-k selection on the CPU: radix select over order-preserving float keys, and a
// running selector that folds tiles of scores into a bounded candidate set.
// Order: value descending, position ascending on ties (reference.topk_indices).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace indexcache {
namespace cpu {

// Larger float -> larger key. As in torch.sort, every NaN (either sign, any payload) sorts
// above +inf and all NaNs are equal, and -0 equals +0, so ties among them go to the lower
// position (x86 makes negative NaNs, e.g. inf - inf, and ReLU-weighted sums make -0).
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The scalar tail of a vectorised floor filter: appends the keys of x[i:n) that are >= floor, with
// their positions, at keys[w:) / pos[w:); returns the new count.
inline int64_t keep_at_least(const float* x, int64_t i, int64_t n, uint32_t floor, uint32_t* keys, int32_t* pos,
                             int64_t w) {
  for (; i < n; ++i) {
    const uint32_t kk = order_key(x[i]);
    if (kk >= floor) {
      keys[w] = kk;
      pos[w++] = static_cast<int32_t>(i);
    }
  }
  return w;
}

// The radix levels every selector here uses: 11, 11 and 10 bits of the 32-bit key.
inline constexpr int kRadixShift[3] = {21, 10, 0};
inline constexpr uint32_t kRadixBins[3] = {2048, 2048, 1024};

// The bin that holds the need-th largest key of a histogram (counting from the top); lowers
// `need` by the keys in the bins above it.
inline uint32_t pick_bin(const uint32_t* hist, uint32_t bins, int64_t& need) {
  int64_t above = 0;
  uint32_t b = bins - 1;
  for (;; --b) {
    if (above + hist[b] >= static_cast<uint64_t>(need)) break;
    above += hist[b];
  }
  need -= above;
  return b;
}

struct Threshold {
  uint32_t key;     // the k-th largest key
  int64_t take_eq;  // how many elements equal to `key` belong to the top k (lowest positions first)
};

// Threshold of the k largest among n keys (1 <= k < n), from key(i) for i in [0, n).
// Three histogram levels of 11, 11 and 10 bits; only the first reads all n keys.
template <typename KeyAt>
Threshold select_threshold(int64_t n, int64_t k, KeyAt key_at, std::vector<uint32_t>& scratch) {
  uint32_t hist[2048];
  uint32_t prefix = 0;  // the bits fixed so far
  uint32_t prefix_mask = 0;
  int64_t need = k;
  scratch.clear();
  for (int level = 0; level < 3; ++level) {
    const uint32_t bins = kRadixBins[level];
    const int shift = kRadixShift[level];
    std::memset(hist, 0, sizeof(uint32_t) * bins);
    if (level == 0) {
      for (int64_t i = 0; i < n; ++i) ++hist[key_at(i) >> shift];
    } else {
      for (uint32_t kk : scratch) ++hist[(kk >> shift) & (bins - 1)];
    }
    const uint32_t b = pick_bin(hist, bins, need);
    prefix |= b << shift;
    prefix_mask |= (bins - 1) << shift;
    if (level == 2) break;
    // Keep only the keys in the chosen bin for the next level.
    if (level == 0) {
      scratch.reserve(hist[b]);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t kk = key_at(i);
        if ((kk & prefix_mask) == prefix) scratch.push_back(kk);
      }
    } else {
      size_t w = 0;
      for (uint32_t kk : scratch)
        if ((kk & prefix_mask) == prefix) scratch[w++] = kk;
      scratch.resize(w);
    }
  }
  return Threshold{prefix, need};
}

// Writes the selected positions (ascending) of the k largest among `vals[0:n)`, given
// their threshold; `emit(i)` is called once per selected i in increasing order.
template <typename KeyAt, typename Emit>
void emit_selected(int64_t n, const Threshold& t, KeyAt key_at, Emit emit) {
  int64_t eq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t kk = key_at(i);
    if (kk > t.key || (kk == t.key && eq++ < t.take_eq)) emit(i);
  }
}

// A bounded candidate set for one row: keys arrive in increasing position order; once
// it has held k, only keys strictly above the current k-th largest can matter.
class RunningTopk {
 public:
  void reset(int64_t k) {
    k_ = k;
    cap_ = 4 * k < 1024 ? 1024 : 4 * k;
    keys_.clear();
    pos_.clear();
    keys_.reserve(cap_);
    pos_.reserve(cap_);
    full_ = false;
    thr_ = 0;
  }
  // Smallest key that can still enter (keys must be > this when full).
  bool full() const { return full_; }
  uint32_t threshold() const { return thr_; }
  void push(uint32_t key, int32_t pos) {
    if (full_ && key <= thr_) return;
    keys_.push_back(key);
    pos_.push_back(pos);
    if (static_cast<int64_t>(keys_.size()) >= cap_) compact();
  }
  // Append another selector's candidates, all at higher positions than ours.
  void absorb(const RunningTopk& other) {
    for (size_t i = 0; i < other.keys_.size(); ++i) push(other.keys_[i], other.pos_[i]);
  }
  // Positions of the final top k, ascending, into out[0:k'); returns k'.
  int64_t finish(int32_t* out, int32_t base) {
    if (static_cast<int64_t>(keys_.size()) > k_) compact();
    for (size_t i = 0; i < pos_.size(); ++i) out[i] = pos_[i] - base;
    return static_cast<int64_t>(pos_.size());
  }

 private:
  void compact() {
    const int64_t n = static_cast<int64_t>(keys_.size());
    const Threshold t = select_threshold(n, k_, [&](int64_t i) { return keys_[i]; }, scratch_);
    size_t w = 0;
    emit_selected(n, t, [&](int64_t i) { return keys_[i]; }, [&](int64_t i) {
      keys_[w] = keys_[i];
      pos_[w] = pos_[i];
      ++w;
    });
    keys_.resize(w);
    pos_.resize(w);
    full_ = true;
    thr_ = t.key;
  }

  int64_t k_ = 0;
  int64_t cap_ = 0;
  bool full_ = false;
  uint32_t thr_ = 0;
  std::vector<uint32_t> keys_;
  std::vector<int32_t> pos_;
  std::vector<uint32_t> scratch_;
};

}  // namespace cpu
}  // namespace indexcache
