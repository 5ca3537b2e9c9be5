// CPU kernels of the differential stream's codecs: blockwise INT8, sampled
// threshold top-k (fp16 values + int32 indices), densify, and the multi-segment
// compressor used for every step's gradient shard.
#include "ops.h"

#include <c10/util/Half.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 false positives inside avx512fintrin.h
#endif

#include <algorithm>
#include <functional>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <limits>
#include <numeric>

namespace megatier {

namespace {

constexpr int64_t kParallelMin = 1 << 15;  // below this, stay on one thread
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (q + M) - M rounds |q| < 2^22 to nearest even

inline int max_threads() { return std::max(1, omp_get_max_threads()); }

// at::empty for an output buffer. Large buffers are fresh pages from mmap, and
// faulting them in 4 KiB at a time costs more than the kernel itself; ask for
// transparent huge pages (a no-op where THP is disabled).
at::Tensor empty_output(int64_t n, const at::TensorOptions& opts) {
  at::Tensor t = at::empty({n}, opts);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = 2u << 20;
  const size_t bytes = (size_t)t.nbytes();
  if (bytes >= 4 * kHuge) {
    const uintptr_t a = (reinterpret_cast<uintptr_t>(t.data_ptr()) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t e = (reinterpret_cast<uintptr_t>(t.data_ptr()) + bytes) & ~(kHuge - 1);
    if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// ---------------------------------------------------------------------------
// INT8

// Quantizes one block. Semantics (== megatier.ops.reference.quantize_int8):
//   scale = max|x| / 127 and inv = 127 / max|x| (NaN if the block has a NaN),
//   code = round_half_even(clamp(x * inv, -127, 127)), NaN codes -> 0.
inline void quant_block(const float* __restrict x, int64_t len, int8_t* __restrict codes, float* __restrict scale_out) {
  uint32_t kmax = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    __m512i vmax = _mm512_setzero_si512();
    for (; i + 16 <= len; i += 16)
      vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_loadu_si512((const void*)(x + i)), absmask));
    kmax = (uint32_t)_mm512_reduce_max_epu32(vmax);
  }
#elif defined(__AVX2__)
  {
    // Magnitude keys (sign bit cleared) compare as unsigned integers in float order, NaNs above +inf.
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    __m256i vmax = _mm256_setzero_si256();
    for (; i + 8 <= len; i += 8)
      vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i)), absmask));
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256((__m256i*)lanes, vmax);
    for (uint32_t k : lanes) kmax = k > kmax ? k : kmax;
  }
#endif
  for (; i < len; ++i) {
    const uint32_t k = mag_key(x[i]);
    kmax = k > kmax ? k : kmax;
  }
  // NaN keys exceed +inf's; any NaN makes the scale NaN (as torch.amax propagates NaN).
  const float amax = bits_f32(kmax > 0x7f800000u ? 0x7fc00000u : kmax);
  *scale_out = amax / 127.0f;
  const float inv = 127.0f / amax;
  i = 0;
#if defined(__AVX512F__)
  {
    // cvtps2dq rounds half to even (default MXCSR), like the scalar path's magic-number rounding;
    // max/min are ordered so that a NaN passes through and is then masked to 0.
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; i + 16 <= len; i += 16) {
      __m512 q = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
      q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
      const __mmask16 ord = _mm512_cmp_ps_mask(q, q, _CMP_ORD_Q);
      _mm_storeu_si128((__m128i*)(codes + i), _mm512_cvtepi32_epi8(_mm512_maskz_cvtps_epi32(ord, q)));
    }
  }
#elif defined(__AVX2__)
  {
    // Same operations 8 lanes at a time: max/min with q second let a NaN through, the ordered mask
    // zeroes it, cvtps2dq rounds half to even; 32 codes are packed (saturation never triggers:
    // |code| <= 127) and the packs' lane interleave is undone by one permute.
    const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i unshuffle = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    auto code8 = [&](const float* src) {
      __m256 q = _mm256_mul_ps(_mm256_loadu_ps(src), vinv);
      q = _mm256_min_ps(hi, _mm256_max_ps(lo, q));
      q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q));
      return _mm256_cvtps_epi32(q);
    };
    for (; i + 32 <= len; i += 32) {
      const __m256i ab = _mm256_packs_epi32(code8(x + i), code8(x + i + 8));
      const __m256i cd = _mm256_packs_epi32(code8(x + i + 16), code8(x + i + 24));
      const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), unshuffle);
      _mm256_storeu_si256((__m256i*)(codes + i), packed);
    }
  }
#endif
  for (; i < len; ++i) {
    float q = x[i] * inv;
    q = q > 127.0f ? 127.0f : q;
    q = q < -127.0f ? -127.0f : q;
    float r = (q + kRoundMagic) - kRoundMagic;
    r = (r == r) ? r : 0.0f;
    codes[i] = (int8_t)(int32_t)r;
  }
}

inline void dequant_block(const int8_t* __restrict codes, int64_t len, float scale, float* __restrict out) {
  for (int64_t i = 0; i < len; ++i) out[i] = (float)codes[i] * scale;
}

inline void bf16_range(const float* __restrict x, int64_t len, uint16_t* __restrict out) {
  for (int64_t i = 0; i < len; ++i) out[i] = f32_to_bf16_bits(x[i]);
}

// Error feedback, x -= decoded value, with the decoder's own float operations (pieces.cpp's decode_range)
// so the result equals decompressing the record and subtracting it, bit for bit.
inline void subtract_dequant(const int8_t* __restrict codes, int64_t len, float scale, float* __restrict x) {
  for (int64_t i = 0; i < len; ++i) x[i] -= (float)codes[i] * scale;
}

inline void subtract_bf16(const uint16_t* __restrict bits, int64_t len, float* __restrict x) {
  for (int64_t i = 0; i < len; ++i) x[i] -= bf16_bits_to_f32(bits[i]);
}

// ---------------------------------------------------------------------------
// Top-k by sampled threshold.

struct Part {
  int64_t lo = 0, hi = 0;
  int64_t count = 0;          // kept entries (may exceed stored ones when overflowed)
  bool overflow = false;
  std::vector<uint16_t> vals;  // fp16 bits
  std::vector<int32_t> idx;    // chunk-local indices
};

// Contiguous, 32-aligned parts in index order. There are more parts than
// threads (scheduled dynamically) so that a thread descheduled on a busy
// machine does not hold the others back.
std::vector<Part> make_parts(int64_t n) {
  const int64_t threads = max_threads();
  int64_t P = 1;
  if (n >= kParallelMin && threads > 1) P = std::max<int64_t>(threads, std::min<int64_t>(64, n / 65536));
  std::vector<Part> parts((size_t)P);
  const int64_t per = ((n + P - 1) / P + 31) / 32 * 32;
  for (int64_t p = 0; p < P; ++p) {
    parts[p].lo = std::min(n, p * per);
    parts[p].hi = std::min(n, (p + 1) * per);
  }
  return parts;
}

// float -> IEEE half bits, round to nearest even.
inline uint16_t f32_to_f16_bits(float f) {
#if defined(__F16C__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return c10::Half(f).x;
#endif
}

inline void keep_entry(Part& part, const float* x, int64_t i) {
  part.vals.push_back(f32_to_f16_bits(x[i]));
  part.idx.push_back((int32_t)i);
}

// Appends the elements of x[i : i + 32] selected by the bits of mk.
inline void keep_mask(Part& part, size_t& c, const float* x, int64_t i, uint32_t mk) {
  if (c + 32 > part.idx.size()) {
    const size_t grow = std::max<size_t>(2 * part.idx.size(), c + 32);
    part.vals.resize(grow);
    part.idx.resize(grow);
  }
  uint16_t* vp = part.vals.data();
  int32_t* ip = part.idx.data();
  while (mk) {
    const int j = __builtin_ctz(mk);
    vp[c] = f32_to_f16_bits(x[i + j]);
    ip[c] = (int32_t)(i + j);
    ++c;
    mk &= mk - 1;
  }
}

// Bit j set when mag_key(x[j]) >= t, for the 32 elements at x (t >= 1).
inline uint32_t ge_mask32(const float* x, uint32_t t) {
#if defined(__AVX512F__)
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff), tv = _mm512_set1_epi32((int32_t)t);
  const __mmask16 m0 = _mm512_cmpge_epu32_mask(_mm512_and_si512(_mm512_loadu_si512((const void*)x), absmask), tv);
  const __mmask16 m1 =
      _mm512_cmpge_epu32_mask(_mm512_and_si512(_mm512_loadu_si512((const void*)(x + 16)), absmask), tv);
  return (uint32_t)m0 | ((uint32_t)m1 << 16);
#elif defined(__AVX2__)
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff), tv = _mm256_set1_epi32((int32_t)t - 1);
  uint32_t mk = 0;
  for (int q = 0; q < 4; ++q) {
    const __m256i k = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + 8 * q)), absmask);
    mk |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, tv))) << (8 * q);
  }
  return mk;
#else
  uint32_t mk = 0;
  for (int j = 0; j < 32; ++j) mk |= (uint32_t)(mag_key(x[j]) >= t) << j;
  return mk;
#endif
}

// x[i] += add[i] for i < len: the addend folded into a pass that reads x anyway (the same IEEE additions as
// torch's x.add_(add)).
inline void add_range(float* __restrict x, const float* __restrict add, int64_t len) {
  for (int64_t i = 0; i < len; ++i) x[i] += add[i];
}

// Runs fn(part, p) on every part in parallel, each part's entries cleared first.
template <typename Fn>
void refill_parts(std::vector<Part>& parts, Fn fn) {
  const int64_t P = (int64_t)parts.size();
#pragma omp parallel for schedule(dynamic, 1) if (P > 1)
  for (int64_t p = 0; p < P; ++p) {
    parts[p].vals.clear();
    parts[p].idx.clear();
    fn(parts[p], p);
  }
}

// One compacting pass with threshold key t: keeps every element with key >= t.
// Stores at most `cap` entries per part; a part that passes `cap` stops
// compacting early (the total is then out of bounds anyway). With `add`, each
// block first becomes x + add (stored in x, the whole part even past an early
// stop), so x holds the sum when the pass returns.
void compact_ge(float* x, const float* add, std::vector<Part>& parts, uint32_t t, int64_t cap, double frac) {
  refill_parts(parts, [&](Part& part, int64_t) {
    const int64_t len = part.hi - part.lo;
    const int64_t reserve = std::min<int64_t>(cap, (int64_t)(1.25 * frac * (double)len)) + 64;
    part.vals.resize((size_t)reserve);
    part.idx.resize((size_t)reserve);
    size_t c = 0;
    int64_t i = part.lo;
    const int64_t hi = part.hi;
    bool over = false;
    for (; i + 32 <= hi; i += 32) {
      if (add) add_range(x + i, add + i, 32);
      const uint32_t mk = ge_mask32(x + i, t);
      if (mk) {
        keep_mask(part, c, x, i, mk);
        if ((int64_t)c > cap) {
          over = true;
          i += 32;
          break;
        }
      }
    }
    if (add && i < hi) add_range(x + i, add + i, hi - i);  // the tail, or the rest after an early stop
    if (!over && i < hi) {  // tail (< 32 elements)
      uint32_t mk = 0;
      for (int64_t j = 0; j < hi - i; ++j) mk |= (uint32_t)(mag_key(x[i + j]) >= t) << j;
      if (mk) keep_mask(part, c, x, i, mk);
      over = (int64_t)c > cap;
    }
    part.vals.resize(c);
    part.idx.resize(c);
    part.overflow = over;
    part.count = (int64_t)c;
  });
}

// Exact compaction: keeps key > t, and the first `tie_allow[p]` keys == t of each part.
void compact_exact(const float* x, std::vector<Part>& parts, uint32_t t, const std::vector<int64_t>& tie_allow) {
  refill_parts(parts, [&](Part& part, int64_t p) {
    int64_t allow = tie_allow[p];
    for (int64_t i = part.lo; i < part.hi; ++i) {
      const uint32_t k = mag_key(x[i]);
      if (k > t || (k == t && allow-- > 0)) keep_entry(part, x, i);
    }
    part.overflow = false;
    part.count = (int64_t)part.idx.size();
  });
}

// Radix select of the k-th largest key (3 histogram passes). Returns the key and
// fills `eq_per_part` with each part's number of keys equal to it and `n_gt`
// with the number of keys strictly greater.
uint32_t radix_select(const float* x, const std::vector<Part>& parts, int64_t k, int64_t& n_gt,
                      std::vector<int64_t>& eq_per_part) {
  const int64_t P = (int64_t)parts.size();
  // (shift, bits) of the three levels: key bits 30..20, 19..8, 7..0.
  const int shifts[3] = {20, 8, 0};
  const int widths[3] = {11, 12, 8};
  uint32_t prefix = 0;  // key bits above the current level
  int64_t above = 0;    // keys strictly greater than the current prefix range
  int64_t krem = k;
  std::vector<std::vector<int64_t>> hists((size_t)P);
  for (int level = 0; level < 3; ++level) {
    const int sh = shifts[level];
    const int nb = 1 << widths[level];
    const int hsh = sh + widths[level];  // bits >= hsh must equal prefix
    const uint32_t mask = (uint32_t)(nb - 1);
#pragma omp parallel for schedule(dynamic, 1) if (P > 1)
    for (int64_t p = 0; p < P; ++p) {
      std::vector<int64_t>& h = hists[p];
      h.assign((size_t)nb, 0);
      const Part& part = parts[p];
      for (int64_t i = part.lo; i < part.hi; ++i) {
        const uint32_t key = mag_key(x[i]);
        if (level == 0 || (key >> hsh) == prefix) ++h[(key >> sh) & mask];
      }
    }
    std::vector<int64_t> total((size_t)nb, 0);
    for (int64_t p = 0; p < P; ++p)
      for (int b = 0; b < nb; ++b) total[b] += hists[p][b];
    int b = nb - 1;
    int64_t acc = 0;
    for (; b > 0; --b) {
      if (acc + total[b] >= krem) break;
      acc += total[b];
    }
    above += acc;
    krem -= acc;
    prefix = (prefix << widths[level]) | (uint32_t)b;
    if (level == 2) {
      eq_per_part.assign((size_t)P, 0);
      for (int64_t p = 0; p < P; ++p) eq_per_part[p] = hists[p][b];
    }
  }
  n_gt = above;
  return prefix;
}

// k-th largest of `keys` (1-based): a histogram of the top 11 key bits finds
// its bin, then nth_element runs on that bin's keys only.
uint32_t kth_largest(const std::vector<uint32_t>& keys, int64_t k) {
  std::vector<int64_t> hist(2048, 0);
  for (uint32_t key : keys) ++hist[key >> 20];
  int b = 2047;
  int64_t acc = 0;
  for (; b > 0; --b) {
    if (acc + hist[b] >= k) break;
    acc += hist[b];
  }
  std::vector<uint32_t> sub;
  sub.reserve((size_t)hist[b]);
  for (uint32_t key : keys)
    if ((int)(key >> 20) == b) sub.push_back(key);
  const int64_t r = k - acc - 1;  // rank inside the bin
  std::nth_element(sub.begin(), sub.begin() + r, sub.end(), std::greater<uint32_t>());
  return sub[(size_t)r];
}

// The threshold key from a sample of x (of x + add, with `add`; nothing is written).
uint32_t sampled_threshold(const float* x, const float* add, int64_t n, double ratio, int64_t sample_size,
                           int64_t seed) {
  const std::vector<int64_t> starts = sample_run_starts(n, sample_size, seed);
  std::vector<uint32_t> keys;
  keys.reserve(starts.size() * kSampleRun);
  constexpr size_t kAhead = 8;  // the runs are ascending: prefetch a few ahead
  for (size_t r = 0; r < starts.size(); ++r) {
    if (r + kAhead < starts.size()) {
      __builtin_prefetch(x + starts[r + kAhead]);
      if (add) __builtin_prefetch(add + starts[r + kAhead]);
    }
    const int64_t end = std::min(n, starts[r] + kSampleRun);
    if (add) {
      for (int64_t i = starts[r]; i < end; ++i) keys.push_back(mag_key(x[i] + add[i]));
    } else {
      for (int64_t i = starts[r]; i < end; ++i) keys.push_back(mag_key(x[i]));
    }
  }
  const int64_t ks = topk_target((int64_t)keys.size(), ratio);
  return std::max<uint32_t>(kth_largest(keys, ks), 1u);  // never keep exact zeros
}

// Top-k of one chunk (n <= 2^31-1) of x, or of x + add (left in x). Results stay in `parts` (in index order).
void topk_chunk(float* x, const float* add, int64_t n, double ratio, int64_t sample_size, int64_t seed,
                std::vector<Part>& parts) {
  parts = make_parts(n);
  if (n == 0) return;
  const int64_t k = topk_target(n, ratio);
  if (k >= n) {  // keep every nonzero element
    compact_ge(x, add, parts, 1u, std::numeric_limits<int64_t>::max(), 1.0);
    return;
  }
  if (n > sample_size) {
    const uint32_t t = sampled_threshold(x, add, n, ratio, effective_sample_size(n, sample_size), seed);
    compact_ge(x, add, parts, t, 2 * k, (double)k / (double)n);  // x holds the sum from here on
    int64_t c = 0;
    bool over = false;
    for (const Part& p : parts) {
      c += p.count;
      over |= p.overflow;
    }
    if (!over && 2 * c >= k && c <= 2 * k) return;
  } else if (add) {
    const int64_t P = (int64_t)parts.size();
#pragma omp parallel for schedule(dynamic, 1) if (P > 1)
    for (int64_t p = 0; p < P; ++p) add_range(x + parts[p].lo, add + parts[p].lo, parts[p].hi - parts[p].lo);
  }
  // Refine: exact k-th largest magnitude, ties broken by lowest index.
  int64_t n_gt = 0;
  std::vector<int64_t> eq;
  uint32_t t = radix_select(x, parts, k, n_gt, eq);
  std::vector<int64_t> allow(parts.size(), 0);
  if (t == 0) {
    t = 1;  // fewer than k nonzeros: keep all of them, no zeros
    compact_ge(x, nullptr, parts, t, std::numeric_limits<int64_t>::max(), (double)k / (double)n);
    return;
  }
  int64_t budget = k - n_gt;
  for (size_t p = 0; p < parts.size(); ++p) {
    allow[p] = std::min(budget, eq[p]);
    budget -= allow[p];
  }
  compact_exact(x, parts, t, allow);
}

int64_t parts_count(const std::vector<Part>& parts) {
  int64_t c = 0;
  for (const Part& p : parts) c += (int64_t)p.idx.size();
  return c;
}

// Error feedback for one top-k chunk: only its kept entries change (x - 0 is x for every other one).
void subtract_kept(const std::vector<Part>& parts, float* chunk) {
  for (const Part& p : parts)
    for (size_t e = 0; e < p.idx.size(); ++e)
      chunk[p.idx[e]] -= static_cast<float>(c10::Half(p.vals[e], c10::Half::from_bits()));
}

// Copies the parts' entries to vals/idx (index order).
void gather_parts(const std::vector<Part>& parts, uint16_t* vals, int32_t* idx) {
  int64_t off = 0;
  for (const Part& p : parts) {
    const size_t c = p.idx.size();
    if (c) {
      std::memcpy(vals + off, p.vals.data(), c * sizeof(uint16_t));
      std::memcpy(idx + off, p.idx.data(), c * sizeof(int32_t));
    }
    off += (int64_t)c;
  }
}

void check_ratio(double ratio, int64_t sample_size, const char* op) {
  TORCH_CHECK(ratio > 0.0 && ratio <= 1.0, op, ": ratio must be in (0, 1], got ", ratio);
  TORCH_CHECK(sample_size >= 1, op, ": sample_size must be >= 1, got ", sample_size);
}

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor here, got ", t.device());
}

// check_tensor (dtype, layout) and check_cpu in one: every CPU op's argument check.
void check_cpu_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  check_tensor(t, op, name, dtype);
  check_cpu(t, op, name);
}

// The caller's ``out`` (checked: CPU, fp32, ``n`` elements) or a new fp32 tensor of ``n`` elements.
at::Tensor float_output(const std::optional<at::Tensor>& out, int64_t n, const at::TensorOptions& opts,
                        const char* op) {
  if (!out.has_value()) return empty_output(n, opts.dtype(at::kFloat));
  const at::Tensor& res = *out;
  check_cpu_tensor(res, op, "out", at::kFloat);
  TORCH_CHECK(res.numel() == n, op, ": out has ", res.numel(), " elements, expected ", n);
  return res;
}

}  // namespace

// ---------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                     std::optional<at::Tensor> codes_out,
                                                     std::optional<at::Tensor> scales_out) {
  const char* op = "quantize_int8";
  check_cpu_tensor(x, op, "x", at::kFloat);
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  const int64_t n = x.numel();
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor codes = codes_out.has_value() ? *codes_out : empty_output(n, x.options().dtype(at::kChar));
  at::Tensor scales = scales_out.has_value() ? *scales_out : at::empty({nb}, x.options().dtype(at::kFloat));
  check_cpu_tensor(codes, op, "codes out", at::kChar);
  check_cpu_tensor(scales, op, "scales out", at::kFloat);
  TORCH_CHECK(codes.numel() == n && scales.numel() == nb, op, ": out tensors must have ", n, " codes and ", nb,
              " scales");
  const float* xp = x.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t blocks_per_task = std::max<int64_t>(1, 65536 / block_size);
#pragma omp parallel for schedule(dynamic, blocks_per_task) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t a = b * block_size;
    quant_block(xp + a, std::min(block_size, n - a), cp + a, sp + b);
  }
  return {codes, scales};
}

at::Tensor dequantize_int8_cpu(const at::Tensor& codes, const at::Tensor& scales, int64_t block_size,
                               std::optional<at::Tensor> out) {
  const char* op = "dequantize_int8";
  check_cpu_tensor(codes, op, "codes", at::kChar);
  check_cpu_tensor(scales, op, "scales", at::kFloat);
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  const int64_t n = codes.numel();
  const int64_t nb = (n + block_size - 1) / block_size;
  TORCH_CHECK(scales.numel() == nb, op, ": scales has ", scales.numel(), " elements but ", n,
              " codes in blocks of ", block_size, " need ", nb, "; pass the block_size used by quantize_int8");
  at::Tensor res = float_output(out, n, scales.options(), op);
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op_ = res.data_ptr<float>();
  const int64_t blocks_per_task = std::max<int64_t>(1, 65536 / block_size);
#pragma omp parallel for schedule(dynamic, blocks_per_task) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t a = b * block_size;
    dequant_block(cp + a, std::min(block_size, n - a), sp[b], op_ + a);
  }
  return res;
}

std::tuple<at::Tensor, at::Tensor> sparsify_topk_cpu(const at::Tensor& x, double ratio, int64_t sample_size,
                                                     int64_t seed) {
  const char* op = "sparsify_topk";
  check_cpu_tensor(x, op, "x", at::kFloat);
  check_ratio(ratio, sample_size, op);
  const int64_t n = x.numel();
  TORCH_CHECK(n <= kMaxTopkChunk, op, ": x has ", n, " elements, more than a chunk's 2^31-1; ",
              "use megatier.ops.sparsify_topk, which splits it into chunks");
  std::vector<Part> parts;
  topk_chunk(x.data_ptr<float>(), nullptr, n, ratio, sample_size, seed, parts);  // no addend: x is not written
  const int64_t c = parts_count(parts);
  at::Tensor vals = at::empty({c}, x.options().dtype(at::kHalf));
  at::Tensor idx = at::empty({c}, x.options().dtype(at::kInt));
  gather_parts(parts, reinterpret_cast<uint16_t*>(vals.data_ptr<at::Half>()), idx.data_ptr<int32_t>());
  return {vals, idx};
}

at::Tensor densify_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t n,
                       const std::optional<at::Tensor>& chunk_counts, int64_t chunk_size,
                       std::optional<at::Tensor> out) {
  const char* op = "densify";
  check_cpu_tensor(values, op, "values", at::kHalf);
  check_cpu_tensor(indices, op, "indices", at::kInt);
  TORCH_CHECK(values.numel() == indices.numel(), op, ": values has ", values.numel(), " elements but indices has ",
              indices.numel(), "; pass the pair returned by sparsify_topk");
  TORCH_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= kMaxTopkChunk, op, ": chunk_size must be in [1, 2^31-1], got ",
              chunk_size);
  const int64_t nchunks = n == 0 ? 0 : (n + chunk_size - 1) / chunk_size;
  std::vector<int64_t> counts;
  if (chunk_counts.has_value() && chunk_counts->defined()) {
    check_cpu_tensor(*chunk_counts, op, "chunk_counts", at::kLong);
    TORCH_CHECK(chunk_counts->numel() == nchunks, op, ": chunk_counts has ", chunk_counts->numel(),
                " entries but n=", n, " in chunks of ", chunk_size, " has ", nchunks);
    const int64_t* cc = chunk_counts->data_ptr<int64_t>();
    counts.assign(cc, cc + nchunks);
  } else {
    TORCH_CHECK(nchunks <= 1, op, ": n=", n, " spans ", nchunks, " chunks; pass chunk_counts");
    if (nchunks == 1) counts.push_back(values.numel());
  }
  int64_t total = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, op, ": chunk_counts must be >= 0");
    total += c;
  }
  TORCH_CHECK(total == values.numel(), op, ": chunk_counts sum to ", total, " but there are ", values.numel(),
              " values");
  at::Tensor res = float_output(out, n, values.options(), op);
  float* dst = res.data_ptr<float>();
  const c10::Half* vp = values.data_ptr<at::Half>();
  const int32_t* ip = indices.data_ptr<int32_t>();
#pragma omp parallel for schedule(dynamic, 65536) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = 0.0f;
  int64_t bad = -1;
  int64_t e0 = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t base = c * chunk_size;
    const int64_t len = std::min(chunk_size, n - base);
    const int64_t cnt = counts[c];
    int64_t bad_c = -1;
#pragma omp parallel for schedule(dynamic, 65536) if (cnt >= kParallelMin) reduction(max : bad_c)
    for (int64_t e = e0; e < e0 + cnt; ++e) {
      const int64_t j = ip[e];
      if (j >= 0 && j < len) {
        dst[base + j] = static_cast<float>(vp[e]);
      } else {
        bad_c = std::max(bad_c, e);
      }
    }
    if (bad_c >= 0 && bad < 0) bad = bad_c;
    e0 += cnt;
  }
  TORCH_CHECK(bad < 0, op, ": indices[", bad, "] = ", bad >= 0 ? ip[bad] : 0,
              " is outside its chunk (n=", n, ", chunk_size=", chunk_size, ")");
  return res;
}

std::vector<at::Tensor> compress_segments_cpu(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                                              const std::vector<int64_t>& numels,
                                              const std::vector<int64_t>& codecs, double ratio, int64_t block_size,
                                              int64_t sample_size, int64_t seed, int64_t chunk_size,
                                              bool feedback, const std::optional<at::Tensor>& addend) {
  const char* op = "compress_segments";
  check_cpu_tensor(flat, op, "flat", at::kFloat);
  const float* add_p = nullptr;  // flat += addend inside the passes below, block by block while in cache
  if (addend.has_value() && addend->defined()) {
    check_cpu_tensor(*addend, op, "addend", at::kFloat);
    TORCH_CHECK(addend->numel() == flat.numel(), op, ": addend has ", addend->numel(), " elements but flat has ",
                flat.numel());
    TORCH_CHECK(addend->data_ptr<float>() != flat.data_ptr<float>(), op, ": addend must not be flat itself");
    add_p = addend->data_ptr<float>();
  }
  check_ratio(ratio, sample_size, op);
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= kMaxTopkChunk, op, ": chunk_size must be in [1, 2^31-1], got ",
              chunk_size);
  const size_t S = offsets.size();
  TORCH_CHECK(numels.size() == S && codecs.size() == S, op, ": offsets, numels and codecs must have the same length");
  const int64_t n = flat.numel();
  int64_t pos = 0;
  int64_t n_codes = 0, n_scales = 0, n_bf16 = 0, n_fp32 = 0;
  for (size_t s = 0; s < S; ++s) {
    TORCH_CHECK(offsets[s] == pos && numels[s] >= 0, op, ": segment ", s, " covers [", offsets[s], ", ",
                offsets[s] + numels[s], ") but the previous one ended at ", pos,
                "; segments must tile the flat tensor in order");
    pos += numels[s];
    switch (codecs[s]) {
      case kPieceInt8:
        n_codes += numels[s];
        n_scales += (numels[s] + block_size - 1) / block_size;
        break;
      case kPieceBf16: n_bf16 += numels[s]; break;
      case kPieceFp32: n_fp32 += numels[s]; break;
      case kPieceTopk: break;
      default: TORCH_CHECK(false, op, ": segment ", s, " has unknown codec ", codecs[s]);
    }
  }
  TORCH_CHECK(pos == n, op, ": segments cover [0, ", pos, ") but flat has ", n, " elements");

  auto opts = flat.options();
  at::Tensor codes = empty_output(n_codes, opts.dtype(at::kChar));
  at::Tensor scales = at::empty({n_scales}, opts.dtype(at::kFloat));
  at::Tensor bf16 = empty_output(n_bf16, opts.dtype(at::kBFloat16));
  at::Tensor fp32 = empty_output(n_fp32, opts.dtype(at::kFloat));
  float* x = flat.data_ptr<float>();

  // Dense codecs: one parallel loop over tasks of ~64K elements (block aligned).
  struct Task {
    int64_t codec, src, len, dst, sdst;
  };
  std::vector<Task> tasks;
  const int64_t task_len = std::max<int64_t>(1, 65536 / block_size) * block_size;
  int64_t oc = 0, osc = 0, ob = 0, of = 0;
  for (size_t s = 0; s < S; ++s) {
    const int64_t c = codecs[s], len = numels[s];
    if (c == kPieceTopk) continue;
    const int64_t step = c == kPieceInt8 ? task_len : 65536;
    for (int64_t a = 0; a < len; a += step) {
      const int64_t l = std::min(step, len - a);
      if (c == kPieceInt8) tasks.push_back({c, offsets[s] + a, l, oc + a, osc + a / block_size});
      else if (c == kPieceBf16) tasks.push_back({c, offsets[s] + a, l, ob + a, 0});
      else tasks.push_back({c, offsets[s] + a, l, of + a, 0});
    }
    if (c == kPieceInt8) {
      oc += len;
      osc += (len + block_size - 1) / block_size;
    } else if (c == kPieceBf16) {
      ob += len;
    } else {
      of += len;
    }
  }
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  uint16_t* bp = reinterpret_cast<uint16_t*>(bf16.data_ptr<at::BFloat16>());
  float* fp = fp32.data_ptr<float>();
  const int64_t dense_total = n_codes + n_bf16 + n_fp32;
#pragma omp parallel for schedule(dynamic, 1) if (dense_total >= kParallelMin && tasks.size() > 1)
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Task& tk = tasks[t];
    if (add_p) add_range(x + tk.src, add_p + tk.src, tk.len);
    if (tk.codec == kPieceInt8) {
      int64_t b = 0;
      for (int64_t a = 0; a < tk.len; a += block_size, ++b) {
        const int64_t len = std::min(block_size, tk.len - a);
        quant_block(x + tk.src + a, len, cp + tk.dst + a, sp + tk.sdst + b);
        if (feedback) subtract_dequant(cp + tk.dst + a, len, sp[tk.sdst + b], x + tk.src + a);
      }
    } else if (tk.codec == kPieceBf16) {
      bf16_range(x + tk.src, tk.len, bp + tk.dst);
      if (feedback) subtract_bf16(bp + tk.dst, tk.len, x + tk.src);
    } else {
      std::memcpy(fp + tk.dst, x + tk.src, (size_t)tk.len * sizeof(float));
      if (feedback)
        for (int64_t i = 0; i < tk.len; ++i) x[tk.src + i] -= fp[tk.dst + i];
    }
  }

  // Top-k segments, chunk by chunk (each chunk is parallel inside).
  std::vector<std::vector<Part>> chunk_parts;
  std::vector<int64_t> chunk_counts;
  for (size_t s = 0; s < S; ++s) {
    if (codecs[s] != kPieceTopk) continue;
    const int64_t len = numels[s];
    const int64_t nch = len == 0 ? 0 : (len + chunk_size - 1) / chunk_size;
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = offsets[s] + c * chunk_size;
      chunk_parts.emplace_back();
      topk_chunk(x + at, add_p ? add_p + at : nullptr, std::min(chunk_size, len - c * chunk_size), ratio,
                 sample_size, chunk_seed(seed, (int64_t)s, c), chunk_parts.back());
      chunk_counts.push_back(parts_count(chunk_parts.back()));
      if (feedback) subtract_kept(chunk_parts.back(), x + at);
    }
  }
  const int64_t n_topk = std::accumulate(chunk_counts.begin(), chunk_counts.end(), (int64_t)0);
  at::Tensor tv = at::empty({n_topk}, opts.dtype(at::kHalf));
  at::Tensor ti = at::empty({n_topk}, opts.dtype(at::kInt));
  at::Tensor tc = at::empty({(int64_t)chunk_counts.size()}, opts.dtype(at::kLong));
  uint16_t* tvp = reinterpret_cast<uint16_t*>(tv.data_ptr<at::Half>());
  int32_t* tip = ti.data_ptr<int32_t>();
  int64_t off = 0;
  for (size_t c = 0; c < chunk_parts.size(); ++c) {
    gather_parts(chunk_parts[c], tvp + off, tip + off);
    off += chunk_counts[c];
    tc.data_ptr<int64_t>()[c] = chunk_counts[c];
  }
  return {codes, scales, tv, ti, tc, bf16, fp32};
}

void decompress_into_cpu(at::Tensor& out, const GradSpec& spec) {
  const char* op = "decompress_segments";
  check_cpu_tensor(out, op, "out", at::kFloat);
  const int64_t n = out.numel();
  Grad g = parse_grad(spec, n, out.device(), op, "record", /*check_indices=*/true);
  float* dst = out.data_ptr<float>();
  constexpr int64_t kTile = 16384;
  const int64_t ntiles = (n + kTile - 1) / kTile;
#pragma omp parallel for schedule(dynamic, 4) if (n >= kParallelMin)
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t a = t * kTile;
    decode_range(g, a, std::min(n, a + kTile), dst + a);
  }
}

}  // namespace megatier
