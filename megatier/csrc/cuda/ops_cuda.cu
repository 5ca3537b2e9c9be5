// CUDA versions of MegaTier's native ops, behind the same functions as the CPU
// kernels (bindings.cpp dispatches on the tensors' device). Compiled only when
// setup.py finds a CUDA build of torch and a CUDA toolkit (MEGATIER_WITH_CUDA).
//
// The AdamW kernels evaluate the same per-element expression as the CPU ones
// with IEEE division and square root and no fused multiply-add (--fmad=false,
// __fdiv_rn/__fsqrt_rn), so step and replay agree bit for bit here too.
//
// Only the CUDA runtime's headers are needed (the stream, guard and launch-check
// headers of c10/cuda), not ATen/cuda/CUDAContext.h, which pulls in cuBLAS,
// cuSPARSE and cuSOLVER; tools/cuda_compile.py compiles this file without a GPU.
#include "../ops.h"

#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/kthvalue.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <functional>
#include <limits>

namespace megatier {

namespace {

constexpr int kThreads = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline unsigned grid_for(int64_t n, int64_t per_block) {
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, per_block), 65535LL * 64));
}

__device__ __forceinline__ uint32_t dev_key(float f) { return __float_as_uint(f) & 0x7fffffffu; }

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor here, got ", t.device());
}

// ---------------------------------------------------------------------------
// INT8

__global__ void quantize_kernel(const float* __restrict__ x, int64_t n, int64_t bs, int8_t* __restrict__ codes,
                                float* __restrict__ scales) {
  __shared__ uint32_t red[kThreads / 32];
  const int64_t b = blockIdx.x;
  const int64_t a = b * bs;
  const int64_t len = min(bs, n - a);
  uint32_t kmax = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) kmax = max(kmax, dev_key(x[a + i]));
  for (int o = 16; o > 0; o >>= 1) kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = kmax;
  __syncthreads();
  if (threadIdx.x < 32) {
    kmax = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0u;
    for (int o = 16; o > 0; o >>= 1) kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
    if (threadIdx.x == 0) red[0] = kmax;
  }
  __syncthreads();
  kmax = red[0];
  const float amax = __uint_as_float(kmax > 0x7f800000u ? 0x7fc00000u : kmax);
  // A NaN block's scale is the canonical NaN, as on the CPU: the GPU's division would make it 0x7fffffff.
  if (threadIdx.x == 0) scales[b] = kmax > 0x7f800000u ? amax : __fdiv_rn(amax, 127.0f);
  const float inv = __fdiv_rn(127.0f, amax);
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float q = __fmul_rn(x[a + i], inv);
    q = q > 127.0f ? 127.0f : q;
    q = q < -127.0f ? -127.0f : q;
    codes[a + i] = (q == q) ? (int8_t)__float2int_rn(q) : (int8_t)0;
  }
}

__global__ void dequantize_kernel(const int8_t* __restrict__ codes, const float* __restrict__ scales, int64_t n,
                                  int64_t bs, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __fmul_rn((float)codes[i], scales[i / bs]);
}

// ---------------------------------------------------------------------------
// top-k: per-block counts, exclusive scan, ordered compaction.

constexpr int64_t kScanPerBlock = kThreads * 16;

__global__ void count_ge_kernel(const float* __restrict__ x, int64_t n, uint32_t t, int64_t* __restrict__ counts) {
  __shared__ int64_t red[kThreads / 32];
  const int64_t a = blockIdx.x * kScanPerBlock;
  const int64_t e = min(n, a + kScanPerBlock);
  int c = 0;
  for (int64_t i = a + threadIdx.x; i < e; i += blockDim.x) c += dev_key(x[i]) >= t;
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) s += red[w];
    counts[blockIdx.x] = s;
  }
}

// Writes the kept entries of this block's range at offsets[blockIdx.x], in index order.
__global__ void compact_ge_kernel(const float* __restrict__ x, int64_t n, uint32_t t,
                                  const int64_t* __restrict__ offsets, __half* __restrict__ vals,
                                  int32_t* __restrict__ idx) {
  __shared__ int warp_tot[kThreads / 32];
  __shared__ int64_t base;
  const int64_t a = blockIdx.x * kScanPerBlock;
  const int64_t e = min(n, a + kScanPerBlock);
  if (threadIdx.x == 0) base = offsets[blockIdx.x];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t s = a; s < e; s += blockDim.x) {
    const int64_t i = s + threadIdx.x;
    const bool keep = i < e && dev_key(x[i]) >= t;
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) {
      before += w < warp ? warp_tot[w] : 0;
      total += warp_tot[w];
    }
    if (keep) {
      const int64_t o = base + before + __popc(ballot & ((1u << lane) - 1u));
      vals[o] = __float2half_rn(x[i]);
      idx[o] = (int32_t)i;
    }
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
}

__global__ void gather_keys_kernel(const float* __restrict__ x, const int64_t* __restrict__ pos, int64_t S,
                                   uint32_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < S; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = dev_key(x[pos[i]]);
}

// Host-side copy of the CPU kth_largest (compression.cpp) on a small sample.
uint32_t host_kth_largest(std::vector<uint32_t>& keys, int64_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  return keys[(size_t)(k - 1)];
}

std::tuple<at::Tensor, at::Tensor> compact_threshold(const at::Tensor& x, uint32_t t, int64_t lo, int64_t hi,
                                                     bool* in_bounds) {
  const int64_t n = x.numel();
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t nblocks = ceil_div(n, kScanPerBlock);
  at::Tensor counts = at::empty({nblocks}, x.options().dtype(at::kLong));
  count_ge_kernel<<<(unsigned)nblocks, kThreads, 0, stream>>>(x.data_ptr<float>(), n, t, counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor incl = at::cumsum(counts, 0);
  const int64_t total = incl[nblocks - 1].item<int64_t>();
  *in_bounds = total >= lo && total <= hi;
  if (!*in_bounds) return {};
  at::Tensor offsets = incl.sub(counts);
  at::Tensor vals = at::empty({total}, x.options().dtype(at::kHalf));
  at::Tensor idx = at::empty({total}, x.options().dtype(at::kInt));
  if (total > 0) {
    compact_ge_kernel<<<(unsigned)nblocks, kThreads, 0, stream>>>(
        x.data_ptr<float>(), n, t, offsets.data_ptr<int64_t>(), reinterpret_cast<__half*>(vals.data_ptr<at::Half>()),
        idx.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {vals, idx};
}

// ---------------------------------------------------------------------------
// Pieces on the device.

struct DevPiece {
  int64_t kind, offset, numel, param, count;
  const void* t0;
  const void* t1;
};

__device__ __forceinline__ float piece_value(const DevPiece& p, int64_t j) {  // dense kinds, piece-local j
  switch (p.kind) {
    case kPieceFp32: return static_cast<const float*>(p.t0)[j];
    case kPieceBf16: return __uint_as_float((uint32_t) static_cast<const uint16_t*>(p.t0)[j] << 16);
    case kPieceInt8:
      return __fmul_rn((float)static_cast<const int8_t*>(p.t0)[j], static_cast<const float*>(p.t1)[j / p.param]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ int64_t lower_bound_i32(const int32_t* a, int64_t count, int64_t v) {
  int64_t lo = 0, hi = count;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if ((int64_t)a[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// First piece (in [pb, pe)) whose range contains element a.
__device__ __forceinline__ int64_t find_piece(const DevPiece* pieces, int64_t pb, int64_t pe, int64_t a) {
  int64_t lo = pb, hi = pe;  // last piece with offset <= a
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (pieces[mid].offset <= a) lo = mid;
    else hi = mid;
  }
  return lo;
}

constexpr int kTileElems = 4;                         // elements per thread
constexpr int64_t kTile = (int64_t)kThreads * kTileElems;  // elements per block and tile

// Decodes the gradient of [a, b) (pieces [pb, pe)) into sh[0 : b - a]. All threads participate.
__device__ void decode_tile(const DevPiece* pieces, int64_t pb, int64_t pe, int64_t a, int64_t b, float* sh) {
  const int64_t first = find_piece(pieces, pb, pe, a);
  for (int64_t q = first; q < pe && pieces[q].offset < b; ++q) {
    const DevPiece p = pieces[q];
    const int64_t lo = max(a, p.offset), hi = min(b, p.offset + p.numel);
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) sh[i - a] = piece_value(p, i - p.offset);
  }
  __syncthreads();
  for (int64_t q = first; q < pe && pieces[q].offset < b; ++q) {
    const DevPiece p = pieces[q];
    if (p.kind != kPieceTopk || p.count == 0) continue;
    const int64_t lo = max(a, p.offset) - p.offset, hi = min(b, p.offset + p.numel) - p.offset;
    const int32_t* idx = static_cast<const int32_t*>(p.t1);
    const __half* vals = static_cast<const __half*>(p.t0);
    const int64_t e0 = lower_bound_i32(idx, p.count, lo), e1 = lower_bound_i32(idx, p.count, hi);
    for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) sh[p.offset + idx[e] - a] = __half2float(vals[e]);
  }
  __syncthreads();
}

__global__ void decompress_kernel(const DevPiece* pieces, int64_t npieces, int64_t n, float* __restrict__ out) {
  __shared__ float sh[kTile];
  for (int64_t t = blockIdx.x; t * kTile < n; t += gridDim.x) {
    const int64_t a = t * kTile, b = min(n, a + kTile);
    decode_tile(pieces, 0, npieces, a, b, sh);
    for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) out[i] = sh[i - a];
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// AdamW

template <bool kDecay>
__device__ __forceinline__ void adamw_elem(float& p, float& m, float& v, float g, const StepScalars& s) {
  if (kDecay) p = __fmul_rn(p, s.keep);
  m = __fadd_rn(__fmul_rn(m, s.beta1), __fmul_rn(s.omb1, g));
  v = __fadd_rn(__fmul_rn(v, s.beta2), __fmul_rn(__fmul_rn(s.omb2, g), g));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), s.inv_bc2), s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

__device__ __forceinline__ bool in_ranges(const int64_t* r, int64_t k, int64_t i) {  // r: sorted [s0,e0,s1,e1,...]
  int64_t lo = 0, hi = k;  // first range with end > i
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (r[2 * mid + 1] <= i) lo = mid + 1;
    else hi = mid;
  }
  return lo < k && r[2 * lo] <= i;
}

// One block per tile: p/m/v of the tile live in registers across the N steps;
// each step's gradient tile is decoded into shared memory.
__global__ void adamw_replay_kernel(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, int64_t n,
                                    const DevPiece* __restrict__ pieces, const int64_t* __restrict__ piece_begin,
                                    const StepScalars* __restrict__ steps, int nsteps,
                                    const int64_t* __restrict__ ranges, int64_t nranges, bool decay_on) {
  __shared__ float sh[kTile];
  for (int64_t t = blockIdx.x; t * kTile < n; t += gridDim.x) {
    const int64_t a = t * kTile, b = min(n, a + kTile);
    float rp[kTileElems], rm[kTileElems], rv[kTileElems];
    bool dec[kTileElems];
#pragma unroll
    for (int j = 0; j < kTileElems; ++j) {
      const int64_t i = a + threadIdx.x + (int64_t)j * blockDim.x;
      const bool ok = i < b;
      rp[j] = ok ? p[i] : 0.0f;
      rm[j] = ok ? m[i] : 0.0f;
      rv[j] = ok ? v[i] : 0.0f;
      dec[j] = ok && decay_on && in_ranges(ranges, nranges, i);
    }
    for (int s = 0; s < nsteps; ++s) {
      const StepScalars sc = steps[s];
      decode_tile(pieces, piece_begin[s], piece_begin[s + 1], a, b, sh);
#pragma unroll
      for (int j = 0; j < kTileElems; ++j) {
        const int64_t l = threadIdx.x + (int64_t)j * blockDim.x;
        if (a + l < b) {
          if (dec[j]) adamw_elem<true>(rp[j], rm[j], rv[j], sh[l], sc);
          else adamw_elem<false>(rp[j], rm[j], rv[j], sh[l], sc);
        }
      }
      __syncthreads();  // sh is rewritten by the next step
    }
#pragma unroll
    for (int j = 0; j < kTileElems; ++j) {
      const int64_t i = a + threadIdx.x + (int64_t)j * blockDim.x;
      if (i < b) {
        p[i] = rp[j];
        m[i] = rm[j];
        v[i] = rv[j];
      }
    }
  }
}

template <typename T>
at::Tensor to_device(const std::vector<T>& host, const at::Device& device) {
  const int64_t bytes = (int64_t)(host.size() * sizeof(T));
  at::Tensor cpu = at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte));
  if (bytes) std::memcpy(cpu.data_ptr(), host.data(), (size_t)bytes);
  return cpu.to(device);
}

std::vector<DevPiece> to_dev_pieces(const Grad& g) {
  std::vector<DevPiece> out;
  for (const Piece& p : g.pieces) out.push_back({p.kind, p.offset, p.numel, p.param, p.count, p.t0, p.t1});
  return out;
}

// Top-k indices of device pieces: ascending and inside their piece (checked with torch ops).
void check_topk_indices(const GradSpec& spec, const char* op, const char* what) {
  for (size_t i = 0; i < spec.size(); ++i) {
    const auto& [kind, offset, numel, param, t0, t1] = spec[i];
    if (kind != kPieceTopk || !t1.defined() || t1.numel() == 0) continue;
    const int64_t lo = t1.min().item<int64_t>(), hi = t1.max().item<int64_t>();
    bool sorted = true;
    if (t1.numel() > 1) sorted = t1.slice(0, 1).gt(t1.slice(0, 0, -1)).all().item<bool>();
    TORCH_CHECK(lo >= 0 && hi < numel && sorted, op, ": ", what, " piece ", i,
                ": top-k indices must be strictly ascending and in [0, ", numel, ") (corrupt record?)");
  }
}

void launch_adamw(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const std::vector<Grad>& grads,
                  const std::vector<StepScalars>& steps, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                  bool decay) {
  const int64_t n = param.numel();
  std::vector<DevPiece> pieces;
  std::vector<int64_t> begin{0};
  std::vector<StepScalars> active;
  for (size_t s = 0; s < steps.size(); ++s) {
    if (steps[s].skipped) continue;
    auto dp = to_dev_pieces(grads[s]);
    pieces.insert(pieces.end(), dp.begin(), dp.end());
    begin.push_back((int64_t)pieces.size());
    active.push_back(steps[s]);
  }
  if (active.empty() || n == 0) return;
  std::vector<int64_t> flat_ranges;
  for (const auto& r : ranges) {
    flat_ranges.push_back(r.first);
    flat_ranges.push_back(r.second);
  }
  const at::Device dev = param.device();
  at::Tensor d_pieces = to_device(pieces, dev), d_begin = to_device(begin, dev), d_steps = to_device(active, dev),
             d_ranges = to_device(flat_ranges, dev);
  auto stream = at::cuda::getCurrentCUDAStream();
  adamw_replay_kernel<<<grid_for(n, kTile), kThreads, 0, stream>>>(
      param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n,
      reinterpret_cast<const DevPiece*>(d_pieces.data_ptr()), reinterpret_cast<const int64_t*>(d_begin.data_ptr()),
      reinterpret_cast<const StepScalars*>(d_steps.data_ptr()), (int)active.size(),
      reinterpret_cast<const int64_t*>(d_ranges.data_ptr()), (int64_t)ranges.size(), decay);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_state_cuda(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const char* op) {
  check_tensor(param, op, "param", at::kFloat);
  check_tensor(exp_avg, op, "exp_avg", at::kFloat);
  check_tensor(exp_avg_sq, op, "exp_avg_sq", at::kFloat);
  check_cuda(param, op, "param");
  check_same_device(param, exp_avg, op, "param", "exp_avg");
  check_same_device(param, exp_avg_sq, op, "param", "exp_avg_sq");
  const int64_t n = param.numel();
  TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n, op,
              ": param, exp_avg and exp_avg_sq must have the same number of elements");
}

}  // namespace

// ---------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(const at::Tensor& x, int64_t block_size,
                                                      std::optional<at::Tensor> codes_out,
                                                      std::optional<at::Tensor> scales_out) {
  const char* op = "quantize_int8";
  check_tensor(x, op, "x", at::kFloat);
  check_cuda(x, op, "x");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nb = ceil_div(n, block_size);
  at::Tensor codes = codes_out.has_value() ? *codes_out : at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = scales_out.has_value() ? *scales_out : at::empty({nb}, x.options());
  check_tensor(codes, op, "codes out", at::kChar);
  check_tensor(scales, op, "scales out", at::kFloat);
  TORCH_CHECK(codes.numel() == n && scales.numel() == nb, op, ": out tensors must have ", n, " codes and ", nb,
              " scales");
  TORCH_CHECK(nb <= 2147483647LL, op, ": too many blocks; use a larger block_size");
  if (nb > 0) {
    quantize_kernel<<<(unsigned)nb, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), n, block_size, codes.data_ptr<int8_t>(), scales.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {codes, scales};
}

at::Tensor dequantize_int8_cuda(const at::Tensor& codes, const at::Tensor& scales, int64_t block_size,
                                std::optional<at::Tensor> out) {
  const char* op = "dequantize_int8";
  check_tensor(codes, op, "codes", at::kChar);
  check_tensor(scales, op, "scales", at::kFloat);
  check_cuda(codes, op, "codes");
  check_same_device(codes, scales, op, "codes", "scales");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  const int64_t n = codes.numel();
  TORCH_CHECK(scales.numel() == ceil_div(n, block_size), op, ": scales has ", scales.numel(),
              " elements; pass the block_size used by quantize_int8");
  c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor res = out.has_value() ? *out : at::empty({n}, scales.options());
  check_tensor(res, op, "out", at::kFloat);
  check_same_device(codes, res, op, "codes", "out");
  TORCH_CHECK(res.numel() == n, op, ": out has ", res.numel(), " elements, expected ", n);
  if (n > 0) {
    dequantize_kernel<<<grid_for(n, kThreads * 4), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        codes.data_ptr<int8_t>(), scales.data_ptr<float>(), n, block_size, res.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return res;
}

std::tuple<at::Tensor, at::Tensor> sparsify_topk_cuda(const at::Tensor& x, double ratio, int64_t sample_size,
                                                      int64_t seed) {
  const char* op = "sparsify_topk";
  check_tensor(x, op, "x", at::kFloat);
  check_cuda(x, op, "x");
  TORCH_CHECK(ratio > 0.0 && ratio <= 1.0, op, ": ratio must be in (0, 1], got ", ratio);
  TORCH_CHECK(sample_size >= 1, op, ": sample_size must be >= 1, got ", sample_size);
  const int64_t n = x.numel();
  TORCH_CHECK(n <= kMaxTopkChunk, op, ": x has ", n, " elements, more than a chunk's 2^31-1");
  c10::cuda::CUDAGuard guard(x.device());
  if (n == 0) return {at::empty({0}, x.options().dtype(at::kHalf)), at::empty({0}, x.options().dtype(at::kInt))};
  const int64_t k = topk_target(n, ratio);
  const int64_t big = std::numeric_limits<int64_t>::max();
  bool ok = false;
  if (k >= n) return compact_threshold(x, 1u, 0, big, &ok);
  if (n > sample_size) {
    // Same sample positions as the CPU kernel.
    std::vector<int64_t> pos;
    for (int64_t start : sample_run_starts(n, effective_sample_size(n, sample_size), seed))
      for (int64_t i = start; i < std::min(n, start + kSampleRun); ++i) pos.push_back(i);
    const int64_t S = (int64_t)pos.size();
    at::Tensor d_pos = to_device(pos, x.device());
    at::Tensor d_keys = at::empty({S}, x.options().dtype(at::kInt));
    gather_keys_kernel<<<grid_for(S, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), reinterpret_cast<const int64_t*>(d_pos.data_ptr()), S,
        reinterpret_cast<uint32_t*>(d_keys.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor h_keys = d_keys.cpu();
    std::vector<uint32_t> keys(reinterpret_cast<uint32_t*>(h_keys.data_ptr<int32_t>()),
                               reinterpret_cast<uint32_t*>(h_keys.data_ptr<int32_t>()) + S);
    const uint32_t t = std::max<uint32_t>(host_kth_largest(keys, topk_target(S, ratio)), 1u);
    auto res = compact_threshold(x, t, (k + 1) / 2, 2 * k, &ok);
    if (ok) return res;
  }
  // Refine: exact k-th largest key, ties to the lowest indices (torch ops; rare path).
  at::Tensor keys = x.view(at::kInt).bitwise_and(0x7fffffff);
  const int64_t t = std::get<0>(at::kthvalue(keys, n - k + 1)).item<int64_t>();
  if (t == 0) return compact_threshold(x, 1u, 0, big, &ok);
  at::Tensor gt = keys.gt(t), eq = keys.eq(t);
  const int64_t allow = k - gt.sum().item<int64_t>();
  at::Tensor mask = gt.logical_or(eq.logical_and(at::cumsum(eq, 0, at::kLong).le(allow)));
  at::Tensor idx = at::nonzero(mask).view({-1});
  return {x.index_select(0, idx).to(at::kHalf), idx.to(at::kInt)};
}

namespace {
__global__ void scatter_kernel(const __half* __restrict__ vals, const int32_t* __restrict__ idx, int64_t count,
                               int64_t len, float* __restrict__ out, int* __restrict__ bad) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < count; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = idx[e];
    if (j >= 0 && j < len) out[j] = __half2float(vals[e]);
    else atomicExch(bad, 1);
  }
}
}  // namespace

at::Tensor densify_cuda(const at::Tensor& values, const at::Tensor& indices, int64_t n,
                        const std::optional<at::Tensor>& chunk_counts, int64_t chunk_size,
                        std::optional<at::Tensor> out) {
  const char* op = "densify";
  check_tensor(values, op, "values", at::kHalf);
  check_tensor(indices, op, "indices", at::kInt);
  check_cuda(values, op, "values");
  check_same_device(values, indices, op, "values", "indices");
  TORCH_CHECK(values.numel() == indices.numel(), op, ": values and indices differ in length");
  TORCH_CHECK(n >= 0 && chunk_size >= 1 && chunk_size <= kMaxTopkChunk, op, ": bad n or chunk_size");
  c10::cuda::CUDAGuard guard(values.device());
  const int64_t nchunks = n == 0 ? 0 : ceil_div(n, chunk_size);
  std::vector<int64_t> counts;
  if (chunk_counts.has_value() && chunk_counts->defined()) {
    at::Tensor cc = chunk_counts->to(at::kCPU).contiguous();
    TORCH_CHECK(cc.scalar_type() == at::kLong && cc.numel() == nchunks, op, ": chunk_counts must be int64[", nchunks,
                "]");
    counts.assign(cc.data_ptr<int64_t>(), cc.data_ptr<int64_t>() + nchunks);
  } else {
    TORCH_CHECK(nchunks <= 1, op, ": n spans several chunks; pass chunk_counts");
    if (nchunks == 1) counts.push_back(values.numel());
  }
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  TORCH_CHECK(total == values.numel(), op, ": chunk_counts sum to ", total, " but there are ", values.numel(),
              " values");
  at::Tensor res = out.has_value() ? *out : at::empty({n}, values.options().dtype(at::kFloat));
  check_tensor(res, op, "out", at::kFloat);
  TORCH_CHECK(res.numel() == n, op, ": out has ", res.numel(), " elements, expected ", n);
  res.zero_();
  at::Tensor bad = at::zeros({1}, values.options().dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  int64_t e0 = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t cnt = counts[c];
    if (cnt > 0) {
      scatter_kernel<<<grid_for(cnt, kThreads), kThreads, 0, stream>>>(
          reinterpret_cast<const __half*>(values.data_ptr<at::Half>()) + e0, indices.data_ptr<int32_t>() + e0, cnt,
          std::min(chunk_size, n - c * chunk_size), res.data_ptr<float>() + c * chunk_size, bad.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    e0 += cnt;
  }
  TORCH_CHECK(bad.item<int>() == 0, op, ": an index is outside its chunk (n=", n, ", chunk_size=", chunk_size, ")");
  return res;
}

void decompress_into_cuda(at::Tensor& out, const GradSpec& spec) {
  const char* op = "decompress_segments";
  check_tensor(out, op, "out", at::kFloat);
  check_cuda(out, op, "out");
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  Grad g = parse_grad(spec, n, out.device(), op, "record", /*check_indices=*/false);
  check_topk_indices(spec, op, "record");
  if (n == 0) return;
  std::vector<DevPiece> pieces = to_dev_pieces(g);
  at::Tensor d_pieces = to_device(pieces, out.device());
  decompress_kernel<<<grid_for(n, kTile), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const DevPiece*>(d_pieces.data_ptr()), (int64_t)pieces.size(), n, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adamw_step_cuda(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                     double step_size, double bc2_sqrt, double beta1, double beta2, double eps, double keep,
                     bool decay, const at::Tensor& decay_segments) {
  const char* op = "adamw_step";
  check_state_cuda(param, exp_avg, exp_avg_sq, op);
  check_tensor(grad, op, "grad", at::kFloat);
  check_same_device(param, grad, op, "param", "grad");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, op, ": grad has ", grad.numel(), " elements but param has ", n);
  c10::cuda::CUDAGuard guard(param.device());
  auto ranges = merge_decay_segments(decay_segments, n, op);
  std::vector<Grad> grads(1);
  Piece pc;
  pc.kind = kPieceFp32;
  pc.numel = n;
  pc.t0 = grad.data_ptr();
  grads[0].pieces.push_back(pc);
  grads[0].starts.push_back(0);
  std::vector<StepScalars> steps{make_step_scalars(step_size, bc2_sqrt, beta1, beta2, eps, keep, decay, false)};
  launch_adamw(param, exp_avg, exp_avg_sq, grads, steps, ranges, decay);
}

void adamw_replay_cuda(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                       const std::vector<GradSpec>& grads, const std::vector<double>& step_sizes,
                       const std::vector<double>& bc2_sqrts, const std::vector<double>& keeps,
                       const std::vector<bool>& skipped, double beta1, double beta2, double eps, bool decay,
                       const at::Tensor& decay_segments) {
  const char* op = "adamw_replay";
  check_state_cuda(param, exp_avg, exp_avg_sq, op);
  const size_t N = grads.size();
  TORCH_CHECK(step_sizes.size() == N && bc2_sqrts.size() == N && keeps.size() == N && skipped.size() == N, op,
              ": one step size, bias correction, decay factor and skip flag per gradient");
  const int64_t n = param.numel();
  c10::cuda::CUDAGuard guard(param.device());
  auto ranges = merge_decay_segments(decay_segments, n, op);
  std::vector<Grad> gs(N);
  std::vector<StepScalars> steps;
  for (size_t s = 0; s < N; ++s) {
    steps.push_back(make_step_scalars(step_sizes[s], bc2_sqrts[s], beta1, beta2, eps, keeps[s], decay, skipped[s]));
    if (skipped[s]) continue;
    const std::string what = "grads[" + std::to_string(s) + "]";
    gs[s] = parse_grad(grads[s], n, param.device(), op, what.c_str(), /*check_indices=*/false);
    check_topk_indices(grads[s], op, what.c_str());
  }
  launch_adamw(param, exp_avg, exp_avg_sq, gs, steps, ranges, decay);
}

}  // namespace megatier
