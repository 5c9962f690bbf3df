// The MoE combine of one vector of 8 elements (docs/semantics.md section 14), shared by the combine
// kernel (moe_combine.cu), the fused MoE tail (fused_tail.cu's moe_tail) and the P2P all-reduce's MoE
// variants (p2p_allreduce.cu, which combine each rank's rows as they read them):
// acc = float(shared) or +0.0, then for each kept slot j in order acc = RN(acc + RN(w_j * y_j)), with
// __fmul_rn / __fadd_rn, which the compiler may not contract into an FMA (one rounding, not two).
#pragma once

#include "epilogue.cuh"

namespace commfuse {

constexpr int kCombineNone = -1;      // no combine: a kernel's input is x itself (p2p_allreduce.cu)
constexpr int kCombineReduction = 0;  // y [t, k, h]
constexpr int kCombineFinalize = 1;   // y = rows [R, h], row_index [t, k]

// The weights' and indices' types are fields, not template parameters: a uniform branch per slot costs
// nothing beside the row loads, and the callers' tensors are read as given (T weights and int64 indices
// converted on the host cost up to three more kernels a call, and tripled the variants).

// Routing weight `i` as float32: a float32 weight, or a T one (fp16 / bf16) converted exactly.
template <typename T>
__device__ __forceinline__ float combine_weight(const MoeCombineParams& p, size_t i) {
  if (p.weights_f32) return static_cast<const float*>(p.weights)[i];
  return Pack<T>::from_bits(static_cast<const unsigned short*>(p.weights)[i]);
}

__device__ __forceinline__ long long combine_row_index(const MoeCombineParams& p, size_t slot) {
  if (p.index64) return static_cast<const long long*>(p.row_index)[slot];
  return static_cast<const int*>(p.row_index)[slot];
}

// The combined vector v of token `row`, rounded to T; NaN where the token has a row index outside
// [-1, rows) (that index's row is not read; nothing raises without a synchronisation; the reference
// raises ValueError). The slots go in chunks of kCombineChunk whose index, weight and row loads are all issued
// before the first sum: two memory latencies a chunk (the indices, then the rows) instead of one or two
// a slot. The sums stay in slot order. 4, not 8: on an H200, chunks of 8 measured 7-10% slower at 1024
// tokens (k = 2 and 8) and no faster at 1-64 (more registers, the unused slots' predicates).
constexpr int kCombineChunk = 4;

template <typename T, int FORM>
__device__ __forceinline__ uint4 combine_vec(const MoeCombineParams& p, int row, int v) {
  const size_t slot0 = static_cast<size_t>(row) * p.k;
  float acc[8];
  if (p.shared != nullptr) {
    unpack8<T>(reinterpret_cast<const uint4*>(static_cast<const T*>(p.shared) + static_cast<size_t>(row) * p.h)[v], acc);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
  }
  bool bad = false;
  for (int j0 = 0; j0 < p.k; j0 += kCombineChunk) {
    long long r[kCombineChunk];  // < 0: past k, or a dropped slot (its step is left out, its row not read)
#pragma unroll
    for (int c = 0; c < kCombineChunk; ++c) {
      const int j = j0 + c;
      if constexpr (FORM == kCombineReduction) {
        r[c] = j < p.k ? static_cast<long long>(slot0 + j) : -1;
      } else {
        r[c] = j < p.k ? combine_row_index(p, slot0 + j) : -1;
        bad |= r[c] < -1 || r[c] >= p.rows;
        if (r[c] >= p.rows) r[c] = -1;
      }
    }
    float w[kCombineChunk];
    uint4 yv[kCombineChunk];
#pragma unroll
    for (int c = 0; c < kCombineChunk; ++c) {
      w[c] = 0.0f;
      yv[c] = make_uint4(0, 0, 0, 0);
      if (r[c] >= 0) {
        w[c] = combine_weight<T>(p, slot0 + j0 + c);
        yv[c] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.y) + static_cast<size_t>(r[c]) * p.h)[v];
      }
    }
#pragma unroll
    for (int c = 0; c < kCombineChunk; ++c) {
      if (r[c] < 0) continue;
      float y[8];
      unpack8<T>(yv[c], y);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w[c], y[e]));
    }
  }
  if (bad) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __int_as_float(0x7fffffff);
  }
  return make_uint4(Pack<T>::pack(acc[0], acc[1]), Pack<T>::pack(acc[2], acc[3]), Pack<T>::pack(acc[4], acc[5]),
                    Pack<T>::pack(acc[6], acc[7]));
}

}  // namespace commfuse
