// Shared helpers for MegaTier's native ops (CPU and CUDA host code).
//
// Everything here is header-only and free of OpenMP pragmas so that it can be
// included from both the C++ and the CUDA translation units.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace megatier {

// Largest number of elements a top-k chunk may hold: indices are int32.
constexpr int64_t kMaxTopkChunk = 2147483647LL;  // 2^31 - 1

// Codec / piece kinds. The numeric values are part of the Python <-> C++
// contract (megatier/ops/compression.py mirrors them).
enum PieceKind : int64_t {
  kPieceFp32 = 0,  // t0: float32[numel]
  kPieceBf16 = 1,  // t0: bfloat16[numel]
  kPieceInt8 = 2,  // t0: int8[numel] codes, t1: float32[ceil(numel/param)] scales, param = block size
  kPieceTopk = 3,  // t0: float16[count] values, t1: int32[count] ascending piece-local indices
  kPieceZero = 4,  // no tensors: gradient is zero on the range
};

// ---------------------------------------------------------------------------
// Validation helpers: every message names the op and the argument.

inline std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  if (t.dim() == 1) s += ",";
  return s + ")";
}

inline void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                         bool require_1d = true) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined (pass a tensor)");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()), "; convert it with .to(", c10::toString(dtype), ")");
  if (require_1d) {
    TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", shape_str(t), "; flatten it with .view(-1)");
  }
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous; call .contiguous() first");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* na,
                              const char* nb) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", na, " is on ", a.device(), " but ", nb, " is on ", b.device(),
              "; move them to the same device");
}

// ---------------------------------------------------------------------------
// Scalar conversions (bit exact with torch's CPU conversions).

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Magnitude key: monotone in |x| for non-NaN values; NaN sorts above +inf.
inline uint32_t mag_key(float f) { return f32_bits(f) & 0x7fffffffu; }

// float -> bfloat16 bits, round to nearest even, NaN -> 0x7fc0 (as c10::BFloat16).
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (f != f) ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}
inline float bf16_bits_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// ---------------------------------------------------------------------------
// Deterministic PRNG for threshold sampling (splitmix64).

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Elements actually sampled for a chunk of n: sample_size, but no more than
// n / 64 (and no less than 2048) so that sampling stays a small fraction of the pass.
inline int64_t effective_sample_size(int64_t n, int64_t sample_size) {
  return std::min(sample_size, std::max<int64_t>(2048, n / 64));
}

// Starts of the 16-element runs that sparsify_topk samples: one random line of
// 16 elements in each of ceil(sample_size / 16) equal strata of the chunk
// (ascending, spread over the whole chunk; shared by the CPU and CUDA paths).
constexpr int64_t kSampleRun = 16;
inline std::vector<int64_t> sample_run_starts(int64_t n, int64_t sample_size, int64_t seed) {
  const int64_t nruns = (sample_size + kSampleRun - 1) / kSampleRun;
  const int64_t nlines = (n + kSampleRun - 1) / kSampleRun;
  std::vector<int64_t> starts;
  starts.reserve((size_t)nruns);
  uint64_t state = (uint64_t)seed;
  for (int64_t r = 0; r < nruns; ++r) {
    const int64_t lo = (int64_t)((__int128)nlines * r / nruns);
    const int64_t hi = (int64_t)((__int128)nlines * (r + 1) / nruns);
    const uint64_t rnd = splitmix64(state);
    if (hi > lo) starts.push_back((lo + (int64_t)(rnd % (uint64_t)(hi - lo))) * kSampleRun);
  }
  return starts;
}

// Seed of chunk `c` of top-k segment `seg` (shared by the CPU and CUDA paths
// and mirrored by megatier/ops/compression.py::_chunk_seed).
inline int64_t chunk_seed(int64_t seed, int64_t seg, int64_t c) {
  return (int64_t)((uint64_t)seed + (uint64_t)seg * 1000003ULL + (uint64_t)c);
}

// Target number of kept entries for a top-k over n elements.
inline int64_t topk_target(int64_t n, double ratio) {
  if (n <= 0) return 0;
  double k = ratio * (double)n;
  int64_t ki = (int64_t)(k + 0.5);
  if (ki < 1) ki = 1;
  if (ki > n) ki = n;
  return ki;
}

// ---------------------------------------------------------------------------
// AdamW scalars of one step, cast to float once.
struct StepScalars {
  float beta1, omb1, beta2, omb2, eps, inv_bc2, neg_step_size, keep;  // inv_bc2 = 1 / sqrt(1 - beta2^t)
  bool decay;    // weight decay applies (weight_decay != 0)
  bool skipped;  // step applies nothing
};

inline StepScalars make_step_scalars(double step_size, double bc2_sqrt, double beta1, double beta2, double eps,
                                     double keep, bool decay, bool skipped) {
  StepScalars s;
  s.beta1 = (float)beta1;
  s.omb1 = (float)(1.0 - beta1);
  s.beta2 = (float)beta2;
  s.omb2 = (float)(1.0 - beta2);
  s.eps = (float)eps;
  s.inv_bc2 = (float)(1.0 / bc2_sqrt);
  s.neg_step_size = (float)(-step_size);
  s.keep = (float)keep;
  s.decay = decay;
  s.skipped = skipped;
  return s;
}

// Sorted, merged decay ranges [start, end) clipped to [0, n).
std::vector<std::pair<int64_t, int64_t>> merge_decay_segments(const at::Tensor& decay_segments, int64_t n,
                                                             const char* op);

}  // namespace megatier
