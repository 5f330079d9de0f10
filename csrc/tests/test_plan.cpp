// Unit tests of the layer-plan builder (DESIGN.md §2). No torch, no framework:
// each CHECK counts, and the run ends with "N passed, N failed".
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "indexcache/plan.h"

using indexcache::build_layer_plan;
using indexcache::LayerPlan;
using indexcache::PlanError;
using indexcache::PlanOptions;

static int g_passed = 0;
static int g_failed = 0;

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (cond) {                                                         \
      ++g_passed;                                                       \
    } else {                                                            \
      ++g_failed;                                                       \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);      \
    }                                                                   \
  } while (0)

static std::vector<int> full_layers(const LayerPlan& p) {
  std::vector<int> out;
  for (size_t l = 0; l < p.skip_topk.size(); ++l)
    if (!p.skip_topk[l]) out.push_back(static_cast<int>(l));
  return out;
}

// Expects build_layer_plan to throw PlanError whose message contains `needle`.
static void expect_error(const PlanOptions& o, const std::string& needle) {
  try {
    build_layer_plan(o);
    ++g_failed;
    std::printf("FAIL: expected an error containing \"%s\"\n", needle.c_str());
  } catch (const PlanError& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) {
      ++g_passed;
    } else {
      ++g_failed;
      std::printf("FAIL: error \"%s\" lacks \"%s\"\n", e.what(), needle.c_str());
    }
  }
}

static PlanOptions opts(int layers, int mtp = 0) {
  PlanOptions o;
  o.num_hidden_layers = layers;
  o.num_nextn_predict_layers = mtp;
  o.use_index_cache = true;
  return o;
}

static void test_deepseek_v32_freq4() {
  PlanOptions o = opts(61, 1);
  o.index_topk_freq = 4;
  const LayerPlan p = build_layer_plan(o);
  std::vector<int> expected = {0, 1};
  for (int l = 5; l <= 57; l += 4) expected.push_back(l);
  expected.push_back(61);  // the MTP layer
  CHECK(full_layers(p) == expected);
  CHECK(p.num_full == 16);
  CHECK(p.num_shared == 45);
  CHECK(p.pattern.size() == 61);
  CHECK(p.skip_topk.size() == 62);
  CHECK(p.source_layer[2] == 1 && p.source_layer[4] == 1 && p.source_layer[5] == 5);
  CHECK(p.source_layer[60] == 57 && p.source_layer[61] == 61);
  CHECK(p.warnings.empty());
}

static void test_glm5_freq4_offset3() {
  PlanOptions o = opts(78);
  o.index_topk_freq = 4;
  o.index_skip_topk_offset = 3;
  const LayerPlan p = build_layer_plan(o);
  std::vector<int> expected = {0, 1, 2};
  for (int l = 6; l < 78; l += 4) expected.push_back(l);
  CHECK(full_layers(p) == expected);
  CHECK(p.num_full == 21);
}

static void test_gate_off() {
  PlanOptions o = opts(10, 2);
  o.use_index_cache = false;
  o.index_topk_freq = 4;
  const LayerPlan p = build_layer_plan(o);
  CHECK(p.num_full == 10 && p.num_shared == 0);
  CHECK(!p.enabled);
  CHECK(p.rule == "off");
  CHECK(p.warnings.size() == 1);
  PlanOptions plain = opts(10);
  plain.use_index_cache = false;
  CHECK(build_layer_plan(plain).warnings.empty());
}

static void test_freq1_is_all_full() {
  const LayerPlan p = build_layer_plan(opts(7, 1));
  CHECK(p.num_full == 7 && p.pattern == "FFFFFFF");
  for (int l = 0; l < 8; ++l) CHECK(p.source_layer[l] == l);
}

static void test_pattern() {
  PlanOptions o = opts(8, 1);
  o.index_topk_pattern = "FSSFS";  // shorter than the layers: the rest are F
  o.index_topk_freq = 4;           // loses to the pattern, with a warning
  const LayerPlan p = build_layer_plan(o);
  CHECK(p.pattern == "FSSFSFFF");
  CHECK(p.rule == "pattern");
  CHECK(p.skip_topk[8] == false);
  CHECK((p.source_layer == std::vector<int>{0, 0, 0, 3, 3, 5, 6, 7, 8}));
  CHECK(p.warnings.size() == 1 && p.warnings[0].find("pattern wins") != std::string::npos);
}

static void test_indexer_types() {
  PlanOptions o = opts(4);
  o.indexer_types = std::vector<std::string>{"full", "shared", "full", "shared"};
  const LayerPlan p = build_layer_plan(o);
  CHECK(p.pattern == "FSFS");
  CHECK(p.rule == "indexer_types");
  o.index_topk_pattern = "FSFS";  // agreeing: fine
  CHECK(build_layer_plan(o).pattern == "FSFS");
  o.index_topk_pattern = "FSF";  // layer 3 is past its end, so F, but indexer_types says shared
  expect_error(o, "disagree at layer 3");
}

static void test_errors() {
  PlanOptions o = opts(8);
  o.index_topk_freq = 0;
  expect_error(o, "index_topk_freq must be >= 1, got 0");
  o = opts(8);
  o.index_skip_topk_offset = 0;
  expect_error(o, "index_skip_topk_offset must be >= 1, got 0");
  o = opts(8);
  o.index_topk_pattern = "FSXF";
  expect_error(o, "'X' at position 2");
  o.index_topk_pattern = "SFFF";
  expect_error(o, "starts with 'S'");
  o.index_topk_pattern = "FFFFFFFFF";
  expect_error(o, "9 entries but the model has 8");
  o.index_topk_pattern = "";
  expect_error(o, "is empty");
  o = opts(8);
  o.indexer_types = std::vector<std::string>{"shared", "full"};
  expect_error(o, "starts with 'S'");
  o.indexer_types = std::vector<std::string>{"full", "sparse"};
  expect_error(o, "indexer_types[1] is \"sparse\"");
  o = opts(0);
  expect_error(o, "num_hidden_layers must be >= 1");
  o = opts(4, -1);
  expect_error(o, "num_nextn_predict_layers must be >= 0");
  // Validation runs even with the switch off.
  o = opts(8);
  o.use_index_cache = false;
  o.index_topk_pattern = "SF";
  expect_error(o, "starts with 'S'");
}

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"deepseek_v32_freq4", test_deepseek_v32_freq4},
      {"glm5_freq4_offset3", test_glm5_freq4_offset3},
      {"gate_off", test_gate_off},
      {"freq1_is_all_full", test_freq1_is_all_full},
      {"pattern", test_pattern},
      {"indexer_types", test_indexer_types},
      {"errors", test_errors},
  };
  for (const auto& [name, fn] : tests) {
    const int before = g_failed;
    try {
      fn();
    } catch (const std::exception& e) {
      ++g_failed;
      std::printf("FAIL %s: unexpected exception: %s\n", name, e.what());
    }
    std::printf("%s %s\n", g_failed == before ? "ok  " : "FAIL", name);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
