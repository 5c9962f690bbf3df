// The MoE combine of one rank (commfuse.moe.combine): x = round_T(shared + sum_j w_j * y_j) in fp32, in slot
// order, with one rounding to T (moe.cuh; docs/semantics.md section 14), written for the collective that
// follows.
//
// Grid: one CTA per token. Block: a multiple of 32 threads (at most 256, chosen by
// commfuse/kernels/moe_combine.py), looping over the row's vectors of 8 elements.
#include "moe.cuh"
#include "pdl.cuh"

namespace commfuse {

// FORM: kCombineReduction or kCombineFinalize32 / 64.
template <typename T, int FORM>
__global__ void __launch_bounds__(256) moe_combine(const __grid_constant__ MoeCombineParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x;
  uint4* x = reinterpret_cast<uint4*>(static_cast<T*>(p.x) + static_cast<size_t>(row) * p.h);
  for (int v = threadIdx.x; v < p.h / kVecElems; v += blockDim.x) x[v] = combine_vec<T, FORM>(p, row, v);
}

}  // namespace commfuse
