#include "indexcache/plan.h"

#include <cstdio>
#include <sstream>

namespace indexcache {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw PlanError(msg); }

// The pattern spelled by `indexer_types` ("full" -> F, "shared" -> S).
std::string pattern_from_indexer_types(const std::vector<std::string>& types) {
  std::string out;
  out.reserve(types.size());
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] == "full") {
      out.push_back('F');
    } else if (types[i] == "shared") {
      out.push_back('S');
    } else {
      fail("indexer_types[" + std::to_string(i) + "] is \"" + types[i] +
           "\"; expected \"full\" or \"shared\"");
    }
  }
  return out;
}

void check_pattern(const std::string& pattern, const char* what, int num_hidden_layers) {
  if (pattern.empty()) {
    fail(std::string(what) + " is empty; give one 'F' or 'S' per layer, or leave it unset");
  }
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c != 'F' && c != 'S') {
      char shown[8];
      if (c >= 32 && c < 127) {
        std::snprintf(shown, sizeof shown, "%c", c);
      } else {
        std::snprintf(shown, sizeof shown, "\\x%02x", static_cast<unsigned char>(c));
      }
      fail(std::string(what) + " has '" + shown + "' at position " + std::to_string(i) +
           "; only 'F' (full) and 'S' (shared) are allowed");
    }
  }
  if (pattern[0] == 'S') {
    fail(std::string(what) + " starts with 'S' at layer 0, but a shared layer needs an "
         "earlier full layer to reuse; layer 0 must be 'F'");
  }
  if (static_cast<int>(pattern.size()) > num_hidden_layers) {
    fail(std::string(what) + " has " + std::to_string(pattern.size()) + " entries but the model has " +
         std::to_string(num_hidden_layers) + " hidden layers");
  }
}

bool pattern_skips(const std::string& pattern, int layer) {
  return layer < static_cast<int>(pattern.size()) && pattern[layer] == 'S';
}

}  // namespace

LayerPlan build_layer_plan(const PlanOptions& o) {
  if (o.num_hidden_layers < 1) {
    fail("num_hidden_layers must be >= 1, got " + std::to_string(o.num_hidden_layers));
  }
  if (o.num_nextn_predict_layers < 0) {
    fail("num_nextn_predict_layers must be >= 0, got " + std::to_string(o.num_nextn_predict_layers));
  }
  if (o.index_topk_freq < 1) {
    fail("index_topk_freq must be >= 1, got " + std::to_string(o.index_topk_freq));
  }
  if (o.index_skip_topk_offset < 1) {
    fail("index_skip_topk_offset must be >= 1, got " + std::to_string(o.index_skip_topk_offset));
  }

  LayerPlan plan;
  plan.num_hidden_layers = o.num_hidden_layers;
  plan.num_nextn_predict_layers = o.num_nextn_predict_layers;
  plan.enabled = o.use_index_cache;

  std::optional<std::string> pattern;
  if (o.index_topk_pattern) {
    check_pattern(*o.index_topk_pattern, "index_topk_pattern", o.num_hidden_layers);
    pattern = *o.index_topk_pattern;
    plan.rule = "pattern";
  }
  if (o.indexer_types) {
    const std::string from_types = pattern_from_indexer_types(*o.indexer_types);
    check_pattern(from_types, "indexer_types", o.num_hidden_layers);
    if (pattern) {
      for (int l = 0; l < o.num_hidden_layers; ++l) {
        if (pattern_skips(*pattern, l) != pattern_skips(from_types, l)) {
          fail("index_topk_pattern and indexer_types disagree at layer " + std::to_string(l) +
               ": pattern says '" + (pattern_skips(*pattern, l) ? "S" : "F") +
               "', indexer_types says \"" + (pattern_skips(from_types, l) ? "shared" : "full") + "\"");
        }
      }
    } else {
      pattern = from_types;
      plan.rule = "indexer_types";
    }
  }
  if (pattern && o.index_topk_freq > 1) {
    plan.warnings.push_back("both index_topk_freq=" + std::to_string(o.index_topk_freq) +
                            " and a per-layer pattern are set; the pattern wins");
  }
  if (!pattern) plan.rule = "freq";

  if (!o.use_index_cache) {
    if (pattern || o.index_topk_freq > 1) {
      plan.warnings.push_back(
          "use_index_cache is false, so index_topk_freq / index_topk_pattern / indexer_types "
          "have no effect and every layer runs its own indexer; set \"use_index_cache\": true");
    }
    plan.rule = "off";
  }

  const int total = o.num_hidden_layers + o.num_nextn_predict_layers;
  plan.skip_topk.assign(total, false);
  plan.source_layer.assign(total, 0);
  plan.pattern.assign(o.num_hidden_layers, 'F');
  int last_full = 0;
  for (int l = 0; l < total; ++l) {
    bool skip = false;
    // MTP layers (l >= num_hidden_layers) always build an indexer: a draft step that
    // started with skip_topk would read a buffer no layer wrote.
    if (o.use_index_cache && l < o.num_hidden_layers) {
      if (pattern) {
        skip = pattern_skips(*pattern, l);
      } else {
        const int shifted = l - o.index_skip_topk_offset + 1;
        skip = (shifted > 0 ? shifted : 0) % o.index_topk_freq != 0;
      }
    }
    plan.skip_topk[l] = skip;
    if (!skip) last_full = l;
    plan.source_layer[l] = last_full;
    if (l < o.num_hidden_layers) {
      plan.pattern[l] = skip ? 'S' : 'F';
      (skip ? plan.num_shared : plan.num_full) += 1;
    }
  }
  return plan;
}

std::string describe(const LayerPlan& plan, const PlanOptions& o) {
  std::ostringstream s;
  s << plan.num_full << " F / " << plan.num_shared << " S over " << plan.num_hidden_layers
    << " layers";
  if (plan.num_nextn_predict_layers > 0) {
    s << " (+" << plan.num_nextn_predict_layers << " MTP, always F)";
  }
  if (plan.rule == "freq") {
    s << "; freq " << o.index_topk_freq << ", offset " << o.index_skip_topk_offset;
  } else if (plan.rule == "off") {
    s << "; IndexCache off";
  } else {
    s << "; from " << plan.rule;
  }
  return s.str();
}

}  // namespace indexcache
