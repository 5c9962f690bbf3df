// Quantization alone (commfuse.local's quantize): each row of x, already in T, goes to epilogue.cuh's
// emit_row, the same code that quantizes the tail's T-rounded norm, so every format (FP8 with a static
// or computed scale, NVFP4, MXFP8) and every scale layout is the tail's, bit for bit.
//
// Grid: `split` CTAs per row, and as many per padding row of the scale storage (as fused_tail.cu), split =
// gridDim.x / those rows (commfuse/kernels/quantize.py's splits: 1, or at few rows a slice a CTA, so that one
// SM does not issue the whole row; never for a format whose scale spans the row, fp8_per_token). Block: a
// multiple of 32 threads, at most kMaxThreads<VPT>, chosen by quantize.py; the row or slice lives in
// registers (VPT vectors of 8 elements per thread, h / split <= 8 * VPT * blockDim.x).
#include "epilogue.cuh"
#include "pdl.cuh"

namespace commfuse {

// fused_tail.cu's thread limits. Only the row is held (no residual, no weight), so VPT 4 fits four
// 256-thread CTAs per SM as the tail's does.
template <int VPT>
constexpr int kMaxThreads = VPT == 1 || VPT == 2 ? 1024 : 256;
template <int VPT>
constexpr int kMinBlocks = VPT == 4 ? 4 : 1;

// Vectors [first, first + nv) of row `row` (a data row), quantized.
template <typename T, int QUANT, int VPT>
__device__ __forceinline__ void quantize_slice(const FusedTailParams& p, int row, int first, int nv) {
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const T*>(p.a) + static_cast<size_t>(row) * p.tail.h) + first;
  uint4 n[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    n[i] = v < nv ? x[v] : make_uint4(0, 0, 0, 0);
  }
  emit_slice<T, QUANT, VPT>(p.tail, row, n, quant_scalar<QUANT>(p.tail), first, nv);
}

// The parameter is FusedTailParams with a = x, no residual and no norm output (commfuse/kernels/params.py).
template <typename T, int QUANT, int VPT>
__global__ void __launch_bounds__(kMaxThreads<VPT>, kMinBlocks<VPT>) quantize(const __grid_constant__ FusedTailParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int rows = tail_row_slots<QUANT>(p.tail);
  // One CTA a row without a division: at 1024 threads each instruction before the loads costs 8 cycles of
  // the row's latency (a division in every CTA measured 0.6 us slower at 1 x 8192 on an H200).
  if (static_cast<int>(gridDim.x) == rows) {
    const int row = blockIdx.x;
    if (row >= p.tail.t) {
      tail_padding_row<QUANT>(p.tail, row);
    } else {
      quantize_slice<T, QUANT, VPT>(p, row, 0, p.tail.h / kVecElems);
    }
    return;
  }
  const int split = static_cast<int>(gridDim.x) / rows;
  const int row = static_cast<int>(blockIdx.x) / split;
  const int part = static_cast<int>(blockIdx.x) - row * split;
  if (row >= p.tail.t) {
    if (part == 0) tail_padding_row<QUANT>(p.tail, row);
    return;
  }
  const int nv = p.tail.h / kVecElems;
  const int per = slice_vectors(nv, split);
  const int first = part * per;
  quantize_slice<T, QUANT, VPT>(p, row, first, max(0, min(nv - first, per)));  // past the row's end: nothing
}

}  // namespace commfuse
