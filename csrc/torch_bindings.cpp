// Every op schema of the library (one TORCH_LIBRARY block), plus the pybind11 module
// for the layer plan and build information. Kernels register in csrc/cpu and csrc/cuda.
#include <torch/extension.h>
#include <torch/library.h>

#include "indexcache/plan.h"

#ifndef INDEXCACHE_CUDA_ARCHS
#define INDEXCACHE_CUDA_ARCHS ""
#endif
#ifndef INDEXCACHE_NVCC
#define INDEXCACHE_NVCC ""
#endif

TORCH_LIBRARY(indexcache, m) {
  // Shared top-k buffer (DESIGN.md §3): rows [:num_rows] := -1.
  m.def("fill_topk_buffer_(Tensor(a!) buf, int num_rows) -> ()");
}

namespace py = pybind11;

namespace {

indexcache::LayerPlan build_plan(int num_hidden_layers, int num_nextn_predict_layers,
                                 bool use_index_cache, int index_topk_freq,
                                 std::optional<std::string> index_topk_pattern,
                                 int index_skip_topk_offset,
                                 std::optional<std::vector<std::string>> indexer_types) {
  indexcache::PlanOptions o;
  o.num_hidden_layers = num_hidden_layers;
  o.num_nextn_predict_layers = num_nextn_predict_layers;
  o.use_index_cache = use_index_cache;
  o.index_topk_freq = index_topk_freq;
  o.index_topk_pattern = std::move(index_topk_pattern);
  o.index_skip_topk_offset = index_skip_topk_offset;
  o.indexer_types = std::move(indexer_types);
  return indexcache::build_layer_plan(o);
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "indexcache native module: layer plan builder and build information";
  py::register_exception<indexcache::PlanError>(mod, "PlanError", PyExc_ValueError);

  py::class_<indexcache::LayerPlan>(mod, "LayerPlan")
      .def_property_readonly("skip_topk", [](const indexcache::LayerPlan& p) {
        return std::vector<bool>(p.skip_topk.begin(), p.skip_topk.end());
      })
      .def_readonly("pattern", &indexcache::LayerPlan::pattern)
      .def_readonly("source_layer", &indexcache::LayerPlan::source_layer)
      .def_readonly("num_full", &indexcache::LayerPlan::num_full)
      .def_readonly("num_shared", &indexcache::LayerPlan::num_shared)
      .def_readonly("num_hidden_layers", &indexcache::LayerPlan::num_hidden_layers)
      .def_readonly("num_nextn_predict_layers", &indexcache::LayerPlan::num_nextn_predict_layers)
      .def_readonly("enabled", &indexcache::LayerPlan::enabled)
      .def_readonly("rule", &indexcache::LayerPlan::rule)
      .def_readonly("warnings", &indexcache::LayerPlan::warnings)
      .def("__repr__", [](const indexcache::LayerPlan& p) {
        return "LayerPlan(pattern='" + p.pattern + "', num_full=" + std::to_string(p.num_full) +
               ", num_shared=" + std::to_string(p.num_shared) +
               ", mtp=" + std::to_string(p.num_nextn_predict_layers) + ", rule='" + p.rule + "')";
      });

  mod.def("_build_layer_plan", &build_plan, py::arg("num_hidden_layers"),
          py::arg("num_nextn_predict_layers"), py::arg("use_index_cache"),
          py::arg("index_topk_freq"), py::arg("index_topk_pattern"),
          py::arg("index_skip_topk_offset"), py::arg("indexer_types"));

  mod.def("_build_info", []() {
    py::dict d;
    d["built_with_torch"] = INDEXCACHE_BUILD_TORCH;
#ifdef INDEXCACHE_WITH_CUDA
    d["cuda_kernels"] = true;
#else
    d["cuda_kernels"] = false;
#endif
    d["cuda_archs"] = std::string(INDEXCACHE_CUDA_ARCHS);
    d["cxx_compiler"] = INDEXCACHE_CXX_COMPILER;
    d["nvcc"] = std::string(INDEXCACHE_NVCC);
    d["cpu_avx512bf16"] = cpu_has_avx512bf16();
    return d;
  });
}
