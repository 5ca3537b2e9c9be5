// pybind11 bindings of megatier._C. Each op dispatches on the device of its
// main tensor: CPU kernels always, CUDA kernels when built with CUDA.
// The Python face (megatier/ops) validates arguments first; the checks here
// (TORCH_CHECK -> RuntimeError) are the last line that keeps bad input from
// crashing the process.
#include <torch/extension.h>

#include "ops.h"
#include "team.h"

#include <pybind11/stl.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using namespace megatier;

namespace {

#ifdef MEGATIER_WITH_CUDA
constexpr bool kWithCuda = true;
#define MEGATIER_DISPATCH(t, name, ...) \
  return (t).is_cuda() ? name##_cuda(__VA_ARGS__) : name##_cpu(__VA_ARGS__)
#else
constexpr bool kWithCuda = false;
#define MEGATIER_DISPATCH(t, name, ...)                                                                       \
  do {                                                                                                        \
    TORCH_CHECK(!(t).is_cuda(), #name ": got a CUDA tensor but megatier._C was built without CUDA; rebuild " \
                                "with a CUDA build of torch and MEGATIER_CUDA=1, or use CPU tensors");        \
    return name##_cpu(__VA_ARGS__);                                                                           \
  } while (0)
#endif

void check_defined(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined (pass a tensor)");
}

std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, int64_t block_size,
                                                 std::optional<at::Tensor> codes_out,
                                                 std::optional<at::Tensor> scales_out) {
  check_defined(x, "quantize_int8", "x");
  if (codes_out.has_value()) check_same_device(x, *codes_out, "quantize_int8", "x", "codes out");
  if (scales_out.has_value()) check_same_device(x, *scales_out, "quantize_int8", "x", "scales out");
  MEGATIER_DISPATCH(x, quantize_int8, x, block_size, codes_out, scales_out);
}

at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales, int64_t block_size,
                           std::optional<at::Tensor> out) {
  check_defined(codes, "dequantize_int8", "codes");
  check_same_device(codes, scales, "dequantize_int8", "codes", "scales");
  MEGATIER_DISPATCH(codes, dequantize_int8, codes, scales, block_size, out);
}

std::tuple<at::Tensor, at::Tensor> sparsify_topk(const at::Tensor& x, double ratio, int64_t sample_size,
                                                 int64_t seed) {
  check_defined(x, "sparsify_topk", "x");
  MEGATIER_DISPATCH(x, sparsify_topk, x, ratio, sample_size, seed);
}

at::Tensor densify(const at::Tensor& values, const at::Tensor& indices, int64_t n,
                   const std::optional<at::Tensor>& chunk_counts, int64_t chunk_size, std::optional<at::Tensor> out) {
  check_defined(values, "densify", "values");
  check_same_device(values, indices, "densify", "values", "indices");
  std::optional<at::Tensor> counts = chunk_counts;
  if (counts.has_value() && counts->defined() && counts->device() != at::kCPU) counts = counts->to(at::kCPU);
  MEGATIER_DISPATCH(values, densify, values, indices, n, counts, chunk_size, out);
}

void decompress_into(at::Tensor out, const GradSpec& pieces) {
  check_defined(out, "decompress_segments", "out");
#ifdef MEGATIER_WITH_CUDA
  if (out.is_cuda()) return decompress_into_cuda(out, pieces);
#else
  TORCH_CHECK(!out.is_cuda(), "decompress_segments: got a CUDA tensor but megatier._C was built without CUDA");
#endif
  decompress_into_cpu(out, pieces);
}

void adamw_step(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, const at::Tensor& grad,
                double step_size, double bc2_sqrt, double beta1, double beta2, double eps, double keep, bool decay,
                const at::Tensor& decay_segments) {
  check_defined(param, "adamw_step", "param");
  MEGATIER_DISPATCH(param, adamw_step, param, exp_avg, exp_avg_sq, grad, step_size, bc2_sqrt, beta1, beta2, eps,
                    keep, decay, decay_segments);
}

void adamw_replay(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, const std::vector<GradSpec>& grads,
                  const std::vector<double>& step_sizes, const std::vector<double>& bc2_sqrts,
                  const std::vector<double>& keeps, const std::vector<bool>& skipped, double beta1, double beta2,
                  double eps, bool decay, const at::Tensor& decay_segments) {
  check_defined(param, "adamw_replay", "param");
  MEGATIER_DISPATCH(param, adamw_replay, param, exp_avg, exp_avg_sq, grads, step_sizes, bc2_sqrts, keeps, skipped,
                    beta1, beta2, eps, decay, decay_segments);
}

py::dict build_info() {
  py::dict d;
  d["cuda"] = kWithCuda;
#ifdef _OPENMP
  d["openmp"] = true;
  d["max_threads"] = omp_get_max_threads();
#else
  d["openmp"] = false;
  d["max_threads"] = 1;
#endif
  d["max_topk_chunk"] = kMaxTopkChunk;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MegaTier native ops (use them through megatier.ops, which validates arguments).";
  using namespace pybind11::literals;
  auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("quantize_int8", &quantize_int8, "Blockwise INT8: (codes int8[n], scales fp32[ceil(n/block)])", "x"_a,
        "block_size"_a, "codes_out"_a = py::none(), "scales_out"_a = py::none(), nogil);
  m.def("dequantize_int8", &dequantize_int8, "codes * scale per block -> fp32[n]", "codes"_a, "scales"_a,
        "block_size"_a, "out"_a = py::none(), nogil);
  m.def("sparsify_topk", &sparsify_topk,
        "Sampled-threshold top-k of one chunk (<= 2^31-1 elements): (values fp16, indices int32 ascending)", "x"_a,
        "ratio"_a, "sample_size"_a, "seed"_a, nogil);
  m.def("densify", &densify, "Scatter top-k values (chunk-local indices) into a dense fp32[n]", "values"_a,
        "indices"_a, "n"_a, "chunk_counts"_a = py::none(), "chunk_size"_a = kMaxTopkChunk, "out"_a = py::none(),
        nogil);
  m.def("compress_segments", &compress_segments_cpu,
        "Compress a flat fp32 shard segment by segment: [int8 codes, int8 scales, topk values, topk indices, "
        "topk chunk counts, bf16 values, fp32 values]",
        "flat"_a, "offsets"_a, "numels"_a, "codecs"_a, "ratio"_a, "block_size"_a, "sample_size"_a, "seed"_a,
        "chunk_size"_a, "feedback"_a = false, "addend"_a = py::none(), nogil);
  m.def("decompress_into", &decompress_into, "Decode a piece list into a dense fp32 tensor", "out"_a, "pieces"_a,
        nogil);
  m.def("adamw_step", &adamw_step, "One in-place AdamW step over a flat fp32 shard", "param"_a, "exp_avg"_a,
        "exp_avg_sq"_a, "grad"_a, "step_size"_a, "bc2_sqrt"_a, "beta1"_a, "beta2"_a, "eps"_a, "keep"_a, "decay"_a,
        "decay_segments"_a, nogil);
  m.def("adamw_replay", &adamw_replay, "N in-place AdamW steps in one pass over memory", "param"_a, "exp_avg"_a,
        "exp_avg_sq"_a, "grads"_a, "step_sizes"_a, "bc2_sqrts"_a, "keeps"_a, "skipped"_a, "beta1"_a, "beta2"_a,
        "eps"_a, "decay"_a, "decay_segments"_a, nogil);
  m.def("build_info", &build_info, "How this extension was built");
  m.def("run_with_team_parked", &run_with_team_parked,
        "fn() on the calling thread while the other threads of its OpenMP team sleep (not spin); returns its "
        "result", "fn"_a);
  m.def(
      "set_thread_num_threads",
      [](int n) {
        TORCH_CHECK(n >= 1, "set_thread_num_threads: n must be >= 1, got ", n);
#ifdef _OPENMP
        // OpenMP's nthreads-var is per thread: this sizes the teams that parallel regions started by the
        // calling thread (ours and ATen's) get, and leaves every other thread's setting alone.
        omp_set_num_threads(n);
        return true;
#else
        return false;
#endif
      },
      "Size of the OpenMP teams the calling thread starts; False when built without OpenMP", "n"_a);

  m.attr("PIECE_FP32") = (int64_t)kPieceFp32;
  m.attr("PIECE_BF16") = (int64_t)kPieceBf16;
  m.attr("PIECE_INT8") = (int64_t)kPieceInt8;
  m.attr("PIECE_TOPK") = (int64_t)kPieceTopk;
  m.attr("PIECE_ZERO") = (int64_t)kPieceZero;
  m.attr("MAX_TOPK_CHUNK") = kMaxTopkChunk;
  m.attr("WITH_CUDA") = kWithCuda;
}
