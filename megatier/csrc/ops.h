// Declarations of MegaTier's native ops. bindings.cpp dispatches on the device
// of the input tensors: *_cpu live in compression.cpp / adamw.cpp, *_cuda in
// cuda/*.cu (compiled only when MEGATIER_WITH_CUDA is defined).
#pragma once

#include "common.h"
#include "pieces.h"

#include <optional>

namespace megatier {

// The ops every device implements, declared once per device suffix: *_cpu (compression.cpp, adamw.cpp) and
// *_cuda (cuda/ops_cuda.cu).
#define MEGATIER_DEVICE_OPS(dev)                                                                                   \
  std::tuple<at::Tensor, at::Tensor> quantize_int8_##dev(const at::Tensor& x, int64_t block_size,                \
                                                         std::optional<at::Tensor> codes_out,                    \
                                                         std::optional<at::Tensor> scales_out);                  \
  at::Tensor dequantize_int8_##dev(const at::Tensor& codes, const at::Tensor& scales, int64_t block_size,         \
                                   std::optional<at::Tensor> out);                                               \
  std::tuple<at::Tensor, at::Tensor> sparsify_topk_##dev(const at::Tensor& x, double ratio, int64_t sample_size, \
                                                         int64_t seed);                                          \
  at::Tensor densify_##dev(const at::Tensor& values, const at::Tensor& indices, int64_t n,                       \
                           const std::optional<at::Tensor>& chunk_counts, int64_t chunk_size,                    \
                           std::optional<at::Tensor> out);                                                       \
  void decompress_into_##dev(at::Tensor& out, const GradSpec& pieces);                                           \
  void adamw_step_##dev(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,  \
                        double step_size, double bc2_sqrt, double beta1, double beta2, double eps, double keep,  \
                        bool decay, const at::Tensor& decay_segments);                                           \
  void adamw_replay_##dev(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,                        \
                          const std::vector<GradSpec>& grads, const std::vector<double>& step_sizes,             \
                          const std::vector<double>& bc2_sqrts, const std::vector<double>& keeps,                \
                          const std::vector<bool>& skipped, double beta1, double beta2, double eps, bool decay,  \
                          const at::Tensor& decay_segments);

MEGATIER_DEVICE_OPS(cpu)
#ifdef MEGATIER_WITH_CUDA
MEGATIER_DEVICE_OPS(cuda)
#endif

// CPU only: one pass over a gradient shard, every segment coded by its codec (compression.cpp).
// With `feedback`, flat is left holding flat - decode(record) (error feedback; bitwise the same as
// decompressing the record and subtracting it), computed while each block is in cache.
// With `addend`, flat first becomes flat + addend (folded into the same passes: one read of flat fewer than
// adding it beforehand) and that sum is what is compressed.
std::vector<at::Tensor> compress_segments_cpu(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                                              const std::vector<int64_t>& numels,
                                              const std::vector<int64_t>& codecs, double ratio, int64_t block_size,
                                              int64_t sample_size, int64_t seed, int64_t chunk_size, bool feedback,
                                              const std::optional<at::Tensor>& addend);

}  // namespace megatier
