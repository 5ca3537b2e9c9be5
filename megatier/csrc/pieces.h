// A gradient handed to the native ops as an ordered list of "pieces".
//
// A dense gradient is one fp32 piece; a compressed record (see
// megatier/ops/compression.py) becomes one piece per segment, or per top-k chunk.
// Pieces tile [0, n) in order. Decoding a range of a gradient only touches the
// pieces that overlap it, which is what lets adamw_replay decompress records
// tile by tile instead of materializing N dense gradients.
#pragma once

#include "common.h"

#include <algorithm>
#include <tuple>

namespace megatier {

// Python passes a piece as (kind, offset, numel, param, t0, t1).
using PieceSpec = std::tuple<int64_t, int64_t, int64_t, int64_t, at::Tensor, at::Tensor>;
using GradSpec = std::vector<PieceSpec>;

struct Piece {
  int64_t kind = kPieceZero;
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t param = 0;  // int8: block size
  int64_t count = 0;  // top-k: number of kept entries
  const void* t0 = nullptr;
  const void* t1 = nullptr;
};

struct Grad {
  std::vector<Piece> pieces;  // ordered, tiling [0, n)
  std::vector<int64_t> starts;  // pieces[i].offset, for binary search
  bool single_fp32() const { return pieces.size() == 1 && pieces[0].kind == kPieceFp32; }
};

// Validates a piece list against a gradient of n elements on `device` and
// returns raw views. `check_indices` scans top-k indices (ascending, in range).
Grad parse_grad(const GradSpec& spec, int64_t n, const c10::Device& device, const char* op, const char* what,
                bool check_indices);

// Writes the gradient's values on [a, b) into out[0 : b - a] (CPU only).
void decode_range(const Grad& g, int64_t a, int64_t b, float* out);

// Pointer to the gradient's values on [a, b): directly into an fp32 piece when
// one piece covers the range, else decoded into `buf` (CPU only).
inline const float* grad_range(const Grad& g, int64_t a, int64_t b, float* buf) {
  if (g.single_fp32()) return static_cast<const float*>(g.pieces[0].t0) + a;
  // Find the piece containing a.
  auto it = std::upper_bound(g.starts.begin(), g.starts.end(), a);
  size_t i = (size_t)(it - g.starts.begin()) - 1;
  const Piece& p = g.pieces[i];
  if (p.kind == kPieceFp32 && b <= p.offset + p.numel) return static_cast<const float*>(p.t0) + (a - p.offset);
  decode_range(g, a, b, buf);
  return buf;
}

}  // namespace megatier
