// Fused AdamW over flat fp32 shards: one step (the trainer's optimizer) and N
// steps in one pass over memory (recovery replay).
//
// Both entry points run the same tile driver and the same inline per-element
// update, compiled in this one translation unit without -ffast-math and with
// -ffp-contract=off, so N calls of adamw_step and one adamw_replay over the
// same N dense gradients perform the same float operations in the same order
// and agree bit for bit.
#include "ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace megatier {

namespace {

constexpr int64_t kTile = 2048;            // elements per tile: the unit of decoding (N decoded tiles stay in L2)
constexpr int64_t kParallelMin = 1 << 14;  // below this, stay on one thread
constexpr int64_t kPrefetch = 256;         // elements ahead (1 KiB per stream)

// The per-element update. Matches megatier.ops.reference.adamw_step:
//   p = p * keep                                   (decay ranges only)
//   m = m * beta1 + (1 - beta1) * g
//   v = v * beta2 + ((1 - beta2) * g) * g
//   p = p + (-step_size * m) / (sqrt(v) * inv_bc2_sqrt + eps)   (inv_bc2_sqrt = float(1 / bc2_sqrt))
template <bool kDecay>
inline void adamw_elem(float& p, float& m, float& v, float g, const StepScalars& s) {
  if (kDecay) p = p * s.keep;
  m = m * s.beta1 + s.omb1 * g;
  v = v * s.beta2 + (s.omb2 * g) * g;
  const float denom = std::sqrt(v) * s.inv_bc2 + s.eps;
  p = p + (s.neg_step_size * m) / denom;
}

// Applies N steps to len elements: each element's p/m/v are loaded once, updated
// N times in registers (gradient s read from g[s][i]) and stored once. The
// element-wise operations and their order are those of N single steps, so the
// result does not depend on N or on how the range is split.
template <bool kDecay>
void adamw_multi(float* __restrict p, float* __restrict m, float* __restrict v, const float* const* g, int64_t len,
                 const StepScalars* sc, int N) {
  constexpr int W = 16;  // one AVX-512 vector (two AVX2 ones)
  int64_t i = 0;
  for (; i + W <= len; i += W) {
    // Prefetch every stream a few cache lines ahead so DRAM traffic overlaps the
    // (division-bound) arithmetic; prefetches past the end are harmless.
    __builtin_prefetch(p + i + kPrefetch, 1);
    __builtin_prefetch(m + i + kPrefetch, 1);
    __builtin_prefetch(v + i + kPrefetch, 1);
    for (int s = 0; s < N; ++s) __builtin_prefetch(g[s] + i + kPrefetch, 0);
    float pp[W], mm[W], vv[W];
    for (int j = 0; j < W; ++j) {
      pp[j] = p[i + j];
      mm[j] = m[i + j];
      vv[j] = v[i + j];
    }
    for (int s = 0; s < N; ++s) {
      const StepScalars c = sc[s];
      const float* __restrict gs = g[s] + i;
      for (int j = 0; j < W; ++j) adamw_elem<kDecay>(pp[j], mm[j], vv[j], gs[j], c);
    }
    for (int j = 0; j < W; ++j) {
      p[i + j] = pp[j];
      m[i + j] = mm[j];
      v[i + j] = vv[j];
    }
  }
  for (; i < len; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    for (int s = 0; s < N; ++s) adamw_elem<kDecay>(pi, mi, vi, g[s][i], sc[s]);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// Applies the non-skipped steps, in order, to every element of [0, n), tile by
// tile: the gradients of a tile are taken in place (dense) or decoded into a
// per-thread buffer (compressed), then adamw_multi runs over the tile.
void run_adamw(float* p, float* m, float* v, int64_t n, const std::vector<Grad>& grads,
               const std::vector<StepScalars>& steps, const Ranges& decay) {
  std::vector<size_t> active;
  std::vector<StepScalars> sc;
  for (size_t s = 0; s < steps.size(); ++s) {
    if (steps[s].skipped) continue;
    active.push_back(s);
    sc.push_back(steps[s]);
  }
  const int NA = (int)active.size();
  if (NA == 0 || n == 0) return;
  const bool decay_on = sc[0].decay;
  bool any_compressed = false;
  for (size_t s : active) any_compressed |= !grads[s].single_fp32();
  const int64_t ntiles = (n + kTile - 1) / kTile;
#pragma omp parallel if (n >= kParallelMin)
  {
    std::vector<float> buf(any_compressed ? (size_t)NA * kTile : 0);
    std::vector<const float*> gp((size_t)NA), go((size_t)NA);
    std::vector<std::pair<int64_t, bool>> cuts;  // sub-range starts of a tile and their decay flag
    cuts.reserve(16);
    // dynamic: a thread descheduled by a busy machine does not hold the others back
#pragma omp for schedule(dynamic, 32)
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t a = t * kTile;
      const int64_t b = std::min(n, a + kTile);
      cuts.clear();
      auto it = std::upper_bound(decay.begin(), decay.end(), a,
                                 [](int64_t x, const std::pair<int64_t, int64_t>& r) { return x < r.second; });
      int64_t pos = a;
      for (; it != decay.end() && it->first < b; ++it) {
        if (it->first > pos) {
          cuts.emplace_back(pos, false);
          pos = it->first;
        }
        cuts.emplace_back(pos, true);
        pos = std::min(b, it->second);
      }
      if (pos < b) cuts.emplace_back(pos, false);
      for (int k = 0; k < NA; ++k)
        gp[k] = grad_range(grads[active[k]], a, b, any_compressed ? buf.data() + (size_t)k * kTile : nullptr);
      for (size_t c = 0; c < cuts.size(); ++c) {
        const int64_t lo = cuts[c].first;
        const int64_t hi = c + 1 < cuts.size() ? cuts[c + 1].first : b;
        for (int k = 0; k < NA; ++k) go[k] = gp[k] + (lo - a);
        if (cuts[c].second && decay_on)
          adamw_multi<true>(p + lo, m + lo, v + lo, go.data(), hi - lo, sc.data(), NA);
        else
          adamw_multi<false>(p + lo, m + lo, v + lo, go.data(), hi - lo, sc.data(), NA);
      }
    }
  }
}

void check_state(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const char* op) {
  check_tensor(param, op, "param", at::kFloat);
  check_tensor(exp_avg, op, "exp_avg", at::kFloat);
  check_tensor(exp_avg_sq, op, "exp_avg_sq", at::kFloat);
  const int64_t n = param.numel();
  TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n, op, ": param (", n, "), exp_avg (", exp_avg.numel(),
              ") and exp_avg_sq (", exp_avg_sq.numel(), ") must have the same number of elements");
  check_same_device(param, exp_avg, op, "param", "exp_avg");
  check_same_device(param, exp_avg_sq, op, "param", "exp_avg_sq");
  TORCH_CHECK(n == 0 || (param.data_ptr() != exp_avg.data_ptr() && param.data_ptr() != exp_avg_sq.data_ptr() &&
                         exp_avg.data_ptr() != exp_avg_sq.data_ptr()),
              op, ": param, exp_avg and exp_avg_sq must be distinct tensors");
}

}  // namespace

Ranges merge_decay_segments(const at::Tensor& decay_segments, int64_t n, const char* op) {
  TORCH_CHECK(decay_segments.defined(), op, ": decay_segments is undefined; pass an int64 tensor of shape (k, 2)");
  TORCH_CHECK(decay_segments.scalar_type() == at::kLong &&
                  (decay_segments.numel() == 0 || (decay_segments.dim() == 2 && decay_segments.size(1) == 2)),
              op, ": decay_segments must be an int64 tensor of shape (k, 2), got ",
              c10::toString(decay_segments.scalar_type()), " of shape ", shape_str(decay_segments));
  at::Tensor ds = decay_segments.to(at::kCPU).contiguous();
  const int64_t k = ds.numel() / 2;
  const int64_t* d = ds.data_ptr<int64_t>();
  Ranges r;
  r.reserve((size_t)k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t s = d[2 * i], e = d[2 * i + 1];
    TORCH_CHECK(0 <= s && s <= e && e <= n, op, ": decay_segments[", i, "] = [", s, ", ", e,
                ") is not a range inside the shard [0, ", n, ")");
    if (s < e) r.emplace_back(s, e);
  }
  std::sort(r.begin(), r.end());
  Ranges merged;
  for (const auto& x : r) {
    if (!merged.empty()) {
      TORCH_CHECK(x.first >= merged.back().second, op, ": decay_segments overlap at [", x.first, ", ",
                  std::min(x.second, merged.back().second), "); each element may be decayed once per step");
      if (x.first == merged.back().second) {
        merged.back().second = x.second;
        continue;
      }
    }
    merged.push_back(x);
  }
  return merged;
}

void adamw_step_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                    double step_size, double bc2_sqrt, double beta1, double beta2, double eps, double keep,
                    bool decay, const at::Tensor& decay_segments) {
  const char* op = "adamw_step";
  check_state(param, exp_avg, exp_avg_sq, op);
  check_tensor(grad, op, "grad", at::kFloat);
  TORCH_CHECK(param.device().is_cpu(), op, ": expected CPU tensors here, got ", param.device());
  check_same_device(param, grad, op, "param", "grad");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, op, ": grad has ", grad.numel(), " elements but param has ", n);
  TORCH_CHECK(n == 0 || (grad.data_ptr() != param.data_ptr() && grad.data_ptr() != exp_avg.data_ptr() &&
                         grad.data_ptr() != exp_avg_sq.data_ptr()),
              op, ": grad must not be the same tensor as param, exp_avg or exp_avg_sq");
  Ranges ranges = merge_decay_segments(decay_segments, n, op);
  std::vector<Grad> grads(1);
  Piece pc;
  pc.kind = kPieceFp32;
  pc.offset = 0;
  pc.numel = n;
  pc.t0 = grad.data_ptr();
  grads[0].pieces.push_back(pc);
  grads[0].starts.push_back(0);
  std::vector<StepScalars> steps{make_step_scalars(step_size, bc2_sqrt, beta1, beta2, eps, keep, decay, false)};
  if (n == 0) return;
  run_adamw(param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n, grads, steps,
            ranges);
}

void adamw_replay_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      const std::vector<GradSpec>& grads, const std::vector<double>& step_sizes,
                      const std::vector<double>& bc2_sqrts, const std::vector<double>& keeps,
                      const std::vector<bool>& skipped, double beta1, double beta2, double eps, bool decay,
                      const at::Tensor& decay_segments) {
  const char* op = "adamw_replay";
  check_state(param, exp_avg, exp_avg_sq, op);
  TORCH_CHECK(param.device().is_cpu(), op, ": expected CPU tensors here, got ", param.device());
  const size_t N = grads.size();
  TORCH_CHECK(step_sizes.size() == N && bc2_sqrts.size() == N && keeps.size() == N && skipped.size() == N, op,
              ": got ", N, " gradients but ", step_sizes.size(), " step sizes, ", bc2_sqrts.size(),
              " bias corrections, ", keeps.size(), " decay factors and ", skipped.size(), " skip flags");
  const int64_t n = param.numel();
  Ranges ranges = merge_decay_segments(decay_segments, n, op);
  std::vector<Grad> gs(N);
  std::vector<StepScalars> steps;
  steps.reserve(N);
  for (size_t s = 0; s < N; ++s) {
    steps.push_back(make_step_scalars(step_sizes[s], bc2_sqrts[s], beta1, beta2, eps, keeps[s], decay, skipped[s]));
    if (skipped[s]) continue;
    const std::string what = "grads[" + std::to_string(s) + "]";
    gs[s] = parse_grad(grads[s], n, param.device(), op, what.c_str(), /*check_indices=*/true);
  }
  if (n == 0) return;
  run_adamw(param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n, gs, steps, ranges);
}

}  // namespace megatier
