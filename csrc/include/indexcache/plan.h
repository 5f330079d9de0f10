// Layer plan for IndexCache (DESIGN.md §2): which DSA layers run their own top-k
// indexer (F) and which reuse the indices of the nearest earlier F layer (S).
// Plain C++17, no torch: unit-tested by ctest and bound to Python via pybind11.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace indexcache {

// Raised for every malformed setting; the Python binding maps it to ValueError.
class PlanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct PlanOptions {
  int num_hidden_layers = 0;         // main decoder layers (61 for DeepSeek-V3.2)
  int num_nextn_predict_layers = 0;  // MTP layers appended after the main ones
  bool use_index_cache = false;      // master switch; false = every layer F
  int index_topk_freq = 1;           // one F layer in `freq` past the offset
  std::optional<std::string> index_topk_pattern;  // 'F'/'S' per main layer; wins over freq
  int index_skip_topk_offset = 2;    // layers below the offset are always F
  std::optional<std::vector<std::string>> indexer_types;  // "full"/"shared" per layer
};

struct LayerPlan {
  std::vector<bool> skip_topk;    // [num_hidden_layers + num_nextn_predict_layers]
  std::string pattern;            // [num_hidden_layers] of 'F'/'S'
  std::vector<int> source_layer;  // [same as skip_topk]: the F layer whose indices are used
  int num_full = 0;               // over main layers
  int num_shared = 0;             // over main layers
  int num_hidden_layers = 0;
  int num_nextn_predict_layers = 0;
  bool enabled = false;              // use_index_cache in force
  std::string rule;                  // "off", "freq", "pattern" or "indexer_types"
  std::vector<std::string> warnings; // non-fatal findings, to be shown once by the caller
};

// Validates `opts` (throws PlanError naming the bad value and its position) and builds
// the plan. Validation runs even when use_index_cache is false: a malformed setting is
// an error whether or not it would take effect.
LayerPlan build_layer_plan(const PlanOptions& opts);

// Human-readable summary, e.g. "16 F / 45 S (freq 4, offset 2)".
std::string describe(const LayerPlan& plan, const PlanOptions& opts);

}  // namespace indexcache
