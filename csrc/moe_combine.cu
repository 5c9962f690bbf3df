// The MoE combine of one rank (commfuse.moe.combine): x = round_T(shared + sum_j w_j * y_j) in fp32, in slot
// order, with one rounding to T (docs/semantics.md section 14), written for the collective that follows.
//
// Grid: one CTA per token. Block: a multiple of 32 threads (at most 256, chosen by
// commfuse/kernels/moe_combine.py), looping over the row's vectors of 8 elements. Products and sums
// are __fmul_rn / __fadd_rn: the compiler may not contract them into an FMA, whose single rounding would
// differ from the definition's two.
#include "epilogue.cuh"
#include "pdl.cuh"

namespace commfuse {

constexpr int kCombineReduction = 0;   // y [t, k, h]
constexpr int kCombineFinalize32 = 1;  // y = rows [R, h], row_index int32 [t, k]
constexpr int kCombineFinalize64 = 2;  // row_index int64

template <typename W>  // a T weight (fp16 / bf16), converted exactly
__device__ __forceinline__ float weight_f32(const void* w, size_t i) {
  return Pack<W>::from_bits(static_cast<const unsigned short*>(w)[i]);
}

template <>
__device__ __forceinline__ float weight_f32<float>(const void* w, size_t i) {
  return static_cast<const float*>(w)[i];
}

// W: the routing weights' type (float or T). FORM: kCombine*.
template <typename T, typename W, int FORM>
__global__ void __launch_bounds__(256) moe_combine(const __grid_constant__ MoeCombineParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x;
  const int nv = p.h / kVecElems;
  const size_t slot0 = static_cast<size_t>(row) * p.k;
  // A row index outside [-1, rows) has no row to read: the token's output is NaN (nothing raises
  // without a synchronisation; the reference raises ValueError).
  bool bad = false;
  if constexpr (FORM != kCombineReduction) {
    for (int j = 0; j < p.k; ++j) {
      const long long r = FORM == kCombineFinalize32 ? static_cast<const int*>(p.row_index)[slot0 + j]
                                                     : static_cast<const long long*>(p.row_index)[slot0 + j];
      bad |= r < -1 || r >= p.rows;
    }
  }
  uint4* x = reinterpret_cast<uint4*>(static_cast<T*>(p.x) + static_cast<size_t>(row) * p.h);
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float acc[8];
    if (p.shared != nullptr) {
      unpack8<T>(reinterpret_cast<const uint4*>(static_cast<const T*>(p.shared) + static_cast<size_t>(row) * p.h)[v],
                 acc);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    }
    for (int j = 0; j < p.k && !bad; ++j) {
      long long r;
      if constexpr (FORM == kCombineReduction) {
        r = static_cast<long long>(slot0 + j);
      } else {
        r = FORM == kCombineFinalize32 ? static_cast<const int*>(p.row_index)[slot0 + j]
                                       : static_cast<const long long*>(p.row_index)[slot0 + j];
        if (r < 0) continue;  // a dropped slot: its step is left out, its row not read
      }
      const float w = weight_f32<W>(p.weights, slot0 + j);
      float y[8];
      unpack8<T>(reinterpret_cast<const uint4*>(static_cast<const T*>(p.y) + static_cast<size_t>(r) * p.h)[v], y);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, y[e]));
    }
    if (bad) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __int_as_float(0x7fffffff);
    }
    x[v] = make_uint4(Pack<T>::pack(acc[0], acc[1]), Pack<T>::pack(acc[2], acc[3]), Pack<T>::pack(acc[4], acc[5]),
                      Pack<T>::pack(acc[6], acc[7]));
  }
}

}  // namespace commfuse
