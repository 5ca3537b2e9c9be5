// Validation and CPU decoding of piece lists (see pieces.h).
#include "pieces.h"

#include <c10/util/Half.h>

namespace megatier {

namespace {

const char* kind_name(int64_t kind) {
  switch (kind) {
    case kPieceFp32: return "fp32";
    case kPieceBf16: return "bf16";
    case kPieceInt8: return "int8";
    case kPieceTopk: return "topk";
    case kPieceZero: return "zero";
    default: return "unknown";
  }
}

void check_piece_tensor(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const c10::Device& device,
                        const char* op, const char* what, size_t i, const char* role) {
  TORCH_CHECK(t.defined() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(), op, ": ", what,
              " piece ", i, ": ", role, " must be a contiguous 1-D ", c10::toString(dtype), " tensor, got ",
              t.defined() ? c10::toString(t.scalar_type()) : "undefined", " of shape ",
              t.defined() ? shape_str(t) : std::string("()"), (t.defined() && !t.is_contiguous() ? " (non-contiguous)" : ""));
  TORCH_CHECK(t.numel() == numel, op, ": ", what, " piece ", i, ": ", role, " has ", t.numel(),
              " elements, expected ", numel, " (record is inconsistent with its header)");
  TORCH_CHECK(numel == 0 || t.device() == device, op, ": ", what, " piece ", i, ": ", role, " is on ", t.device(),
              " but the optimizer state is on ", device, "; move the record to that device");
}

}  // namespace

Grad parse_grad(const GradSpec& spec, int64_t n, const c10::Device& device, const char* op, const char* what,
                bool check_indices) {
  Grad g;
  int64_t pos = 0;
  for (size_t i = 0; i < spec.size(); ++i) {
    const auto& [kind, offset, numel, param, t0, t1] = spec[i];
    TORCH_CHECK(kind >= kPieceFp32 && kind <= kPieceZero, op, ": ", what, " piece ", i, " has unknown kind ", kind);
    TORCH_CHECK(offset == pos && numel >= 0, op, ": ", what, " piece ", i, " (", kind_name(kind), ") covers [",
                offset, ", ", offset + numel, ") but the previous piece ended at ", pos,
                "; pieces must tile the gradient in order");
    TORCH_CHECK(offset + numel <= n, op, ": ", what, " piece ", i, " ends at ", offset + numel,
                " past the gradient length ", n, " (record built for a different shard size?)");
    Piece p;
    p.kind = kind;
    p.offset = offset;
    p.numel = numel;
    p.param = param;
    switch (kind) {
      case kPieceFp32:
        check_piece_tensor(t0, at::kFloat, numel, device, op, what, i, "values");
        p.t0 = t0.data_ptr();
        break;
      case kPieceBf16:
        check_piece_tensor(t0, at::kBFloat16, numel, device, op, what, i, "values");
        p.t0 = t0.data_ptr();
        break;
      case kPieceInt8: {
        TORCH_CHECK(param >= 1, op, ": ", what, " piece ", i, ": int8 block size must be >= 1, got ", param);
        check_piece_tensor(t0, at::kChar, numel, device, op, what, i, "codes");
        check_piece_tensor(t1, at::kFloat, (numel + param - 1) / param, device, op, what, i, "scales");
        p.t0 = t0.data_ptr();
        p.t1 = t1.data_ptr();
        break;
      }
      case kPieceTopk: {
        TORCH_CHECK(numel <= kMaxTopkChunk, op, ": ", what, " piece ", i, ": a top-k piece holds at most 2^31-1 ",
                    "elements, got ", numel, "; split it into chunks");
        TORCH_CHECK(t0.defined() && t1.defined(), op, ": ", what, " piece ", i, ": top-k values/indices missing");
        const int64_t count = t0.numel();
        check_piece_tensor(t0, at::kHalf, count, device, op, what, i, "values");
        check_piece_tensor(t1, at::kInt, count, device, op, what, i, "indices");
        p.count = count;
        p.t0 = t0.data_ptr();
        p.t1 = t1.data_ptr();
        if (check_indices && count > 0) {
          const int32_t* idx = t1.data_ptr<int32_t>();
          int64_t prev = -1;
          for (int64_t e = 0; e < count; ++e) {
            const int64_t j = idx[e];
            TORCH_CHECK(j > prev && j < numel, op, ": ", what, " piece ", i, ": top-k index ", e, " is ", j,
                        "; indices must be strictly ascending and in [0, ", numel, ") (corrupt record?)");
            prev = j;
          }
        }
        break;
      }
      default:
        break;
    }
    pos = offset + numel;
    if (numel > 0) {
      g.pieces.push_back(p);
      g.starts.push_back(offset);
    }
  }
  TORCH_CHECK(pos == n, op, ": ", what, " pieces cover [0, ", pos, ") but the gradient has ", n,
              " elements (record built for a different shard size?)");
  return g;
}

void decode_range(const Grad& g, int64_t a, int64_t b, float* out) {
  if (a >= b) return;
  auto it = std::upper_bound(g.starts.begin(), g.starts.end(), a);
  size_t i = (size_t)(it - g.starts.begin()) - 1;
  int64_t pos = a;
  while (pos < b) {
    const Piece& p = g.pieces[i];
    const int64_t end = std::min(b, p.offset + p.numel);
    const int64_t lo = pos - p.offset, hi = end - p.offset;  // piece-local
    float* dst = out + (pos - a);
    switch (p.kind) {
      case kPieceFp32:
        std::memcpy(dst, static_cast<const float*>(p.t0) + lo, (size_t)(hi - lo) * sizeof(float));
        break;
      case kPieceBf16: {
        const uint16_t* src = static_cast<const uint16_t*>(p.t0) + lo;
        for (int64_t j = 0; j < hi - lo; ++j) dst[j] = bf16_bits_to_f32(src[j]);
        break;
      }
      case kPieceInt8: {
        const int8_t* codes = static_cast<const int8_t*>(p.t0);
        const float* scales = static_cast<const float*>(p.t1);
        const int64_t bs = p.param;
        int64_t j = lo;
        while (j < hi) {
          const int64_t blk = j / bs;
          const int64_t bend = std::min(hi, (blk + 1) * bs);
          const float s = scales[blk];
          float* d = dst + (j - lo);
          const int8_t* c = codes + j;
          for (int64_t q = 0; q < bend - j; ++q) d[q] = (float)c[q] * s;
          j = bend;
        }
        break;
      }
      case kPieceTopk: {
        std::memset(dst, 0, (size_t)(hi - lo) * sizeof(float));
        const int32_t* idx = static_cast<const int32_t*>(p.t1);
        const c10::Half* vals = static_cast<const c10::Half*>(p.t0);
        const int32_t* e = std::lower_bound(idx, idx + p.count, (int32_t)lo);
        const int32_t* stop = idx + p.count;
        for (; e < stop && *e < hi; ++e) dst[*e - lo] = static_cast<float>(vals[e - idx]);
        break;
      }
      default:
        std::memset(dst, 0, (size_t)(hi - lo) * sizeof(float));
        break;
    }
    pos = end;
    ++i;
  }
}

}  // namespace megatier
