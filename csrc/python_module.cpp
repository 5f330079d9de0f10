// The pybind11 half of indexcache._C: the layer-plan builder, the CPU path controls and the
// build information. The op schemas are csrc/torch_bindings.cpp.
#include <torch/extension.h>

#include "indexcache/plan.h"
#include "cpu/isa.h"

#ifndef INDEXCACHE_CUDA_ARCHS
#define INDEXCACHE_CUDA_ARCHS ""
#endif
#ifndef INDEXCACHE_NVCC
#define INDEXCACHE_NVCC ""
#endif

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

const std::pair<const char*, indexcache::DType> kDtypeNames[] = {
    {"fp32", indexcache::DType::kFloat32}, {"bf16", indexcache::DType::kBFloat16}, {"fp8", indexcache::DType::kFp8E4M3}};

// ("sparse_mla", "fp32") -> the dispatch key; a ValueError naming the choices otherwise.
std::pair<indexcache::CpuOp, indexcache::DType> cpu_op_key(const std::string& op, const std::string& dtype) {
  std::string ops;
  for (indexcache::CpuOp o : indexcache::kCpuOps) {
    ops += std::string(ops.empty() ? "" : ", ") + indexcache::cpu_op_name(o);
    if (op != indexcache::cpu_op_name(o)) continue;
    for (const auto& [name, dt] : kDtypeNames)
      if (dtype == name && indexcache::cpu_op_takes(o, dt)) return {o, dt};
    throw py::value_error("CPU op '" + op + "' takes no dtype '" + dtype + "' (see _cpu_dispatch())");
  }
  throw py::value_error("unknown CPU op '" + op + "': choose one of " + ops);
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

  mod.def(
      "_set_cpu_isa",
      [](const std::string& name) {
        try {
          indexcache::request_cpu_path(indexcache::cpu_path_from_name(name));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      "Choose the CPU kernels' code path: 'auto' (blas where AMX tiles are present, else AVX-512 BF16 "
      "where present, else avx2 where AVX2 + FMA are, else portable), 'portable', 'avx2', 'avx512bf16' or "
      "'blas' (oneDNN brgemm: the AMX tiles where present). A path this CPU cannot run is a ValueError "
      "that says why (_cpu_paths()).");
  mod.def(
      "_cpu_isa",
      [](const std::string& op, const std::string& dtype) {
        if (op.empty()) return std::string(indexcache::cpu_path_name(indexcache::cpu_path()));
        const auto [o, dt] = cpu_op_key(op, dtype.empty() ? (op == "topk" ? "fp32" : "bf16") : dtype);
        return std::string(indexcache::cpu_path_name(indexcache::cpu_op_path(o, dt)));
      },
      py::arg("op") = "", py::arg("dtype") = "",
      "The CPU path requested ('auto' resolved to this CPU's first choice); with op (indexer, topk, "
      "sparse_mla, block_topk, block_sparse_attention, quantize, delta_rule, rows_matmul, norm_rope, kpool_pool) and dtype (fp32, bf16, fp8; default bf16, "
      "fp32 for topk) "
      "the path that op takes for inputs of that dtype, whatever a call's heads or rows: where the "
      "requested path has no kernel of its own for them, the next of blas, avx512bf16, avx2, portable "
      "that this CPU runs and has one.");
  mod.def(
      "_cpu_dispatch",
      []() {
        py::dict d;
        for (indexcache::CpuOp o : indexcache::kCpuOps)
          for (const auto& [name, dt] : kDtypeNames)
            if (indexcache::cpu_op_takes(o, dt))
              d[py::str(std::string(indexcache::cpu_op_name(o)) + "/" + name)] =
                  indexcache::cpu_path_name(indexcache::cpu_op_path(o, dt));
        return d;
      },
      "{'op/dtype': path} for every op and input dtype under the current request (_set_cpu_isa).");
  mod.def(
      "_cpu_kernels",
      []() {
        py::dict d;
        for (indexcache::CpuPath p : indexcache::kCpuPaths) {
          py::list l;
          for (indexcache::CpuOp o : indexcache::kCpuOps)
            for (const auto& [name, dt] : kDtypeNames)
              if (indexcache::cpu_path_has_kernel(p, o, dt)) l.append(std::string(indexcache::cpu_op_name(o)) + "/" + name);
          d[indexcache::cpu_path_name(p)] = l;
        }
        return d;
      },
      "{path: ['op/dtype', ...]}: the (op, dtype) pairs each path has its own kernel for (on a CPU that runs it).");
  mod.def(
      "_cpu_paths",
      []() {
        py::dict d;
        for (indexcache::CpuPath p : indexcache::kCpuPaths)
          d[indexcache::cpu_path_name(p)] = indexcache::cpu_path_unavailable(p);
        return d;
      },
      "Every CPU path by name: '' where this CPU runs it, else the reason it cannot.");
  mod.def("_cpu_features", []() {
    const indexcache::CpuFeatures& f = indexcache::cpu_features();
    py::dict d;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512"] = f.avx512;
    d["avx512bf16"] = f.avx512bf16;
    d["amx_bf16"] = f.amx_bf16;
    d["brgemm_bf16"] = f.brgemm_bf16;
    d["brgemm_tiles"] = f.brgemm_tiles;
    return d;
  });

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
    d["cpu_avx512bf16"] = indexcache::cpu_features().avx512bf16;
    return d;
  });
}
