// Quantization alone (commfuse.local's quantize): each row of x, already in T, goes to epilogue.cuh's
// emit_row, the same code that quantizes the tail's T-rounded norm, so every format (FP8 with a static
// or computed scale, NVFP4, MXFP8) and every scale layout is the tail's, bit for bit.
//
// Grid: one CTA per row, plus the padding rows of the scale storage (as fused_tail.cu). Block: a
// multiple of 32 threads, at most kMaxThreads<VPT>, chosen by commfuse/kernels/quantize.py; the row
// lives in registers (VPT vectors of 8 elements per thread, h <= 8 * VPT * blockDim.x).
#include "epilogue.cuh"
#include "pdl.cuh"

namespace commfuse {

// fused_tail.cu's thread limits. Only the row is held (no residual, no weight), so VPT 4 fits four
// 256-thread CTAs per SM as the tail's does.
template <int VPT>
constexpr int kMaxThreads = VPT == 1 || VPT == 2 ? 1024 : 256;
template <int VPT>
constexpr int kMinBlocks = VPT == 4 ? 4 : 1;

// The parameter is FusedTailParams with a = x, no residual and no norm output (commfuse/kernels/params.py).
template <typename T, int QUANT, int VPT>
__global__ void __launch_bounds__(kMaxThreads<VPT>, kMinBlocks<VPT>) quantize(const __grid_constant__ FusedTailParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x;
  if (row >= p.tail.t) {
    tail_padding_row<QUANT>(p.tail, row);
    return;
  }
  const int nv = p.tail.h / kVecElems;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const T*>(p.a) + static_cast<size_t>(row) * p.tail.h);
  uint4 n[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    n[i] = v < nv ? x[v] : make_uint4(0, 0, 0, 0);
  }
  emit_row<T, QUANT, VPT>(p.tail, row, n, quant_scalar<QUANT>(p.tail));
}

}  // namespace commfuse
