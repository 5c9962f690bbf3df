// Test kernel for csrc/epilogue.cuh's FP8 division: fp8_divide against __fdiv_rn.
#include "epilogue.cuh"

namespace commfuse_test {

// Packed by tests/test_fp8_division.py as "<4QI4x".
struct CheckParams {
  const float* scales;           // one per blockIdx.y
  unsigned long long x_count;    // inputs: the fp32 bit patterns x_first, x_first + 1, ...
  unsigned long long* counts;    // [0] e4m3 codes that differ, [1] quotients inside fp8_divide's
                                 // exact band whose fp32 bits differ, [2] quotients inside the band
  unsigned long long* first;     // a mismatch, as (scale index << 32) | x bits; ~0 when none
  unsigned x_first;
};
static_assert(sizeof(CheckParams) == 40, "layout shared with tests/test_fp8_division.py");

__global__ void check_fp8_division(const __grid_constant__ CheckParams p) {
  const float scale = p.scales[blockIdx.y];
  const float r = commfuse::fp8_reciprocal(scale);
  unsigned long long code_diff = 0, bits_diff = 0, in_band = 0;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < p.x_count; i += stride) {
    const unsigned xb = p.x_first + static_cast<unsigned>(i);
    const float x = __uint_as_float(xb);
    const float want = __fdiv_rn(x, scale);
    float got = want;
    bool band = false;
    if (r != 0.f) {
      got = commfuse::fp8_divide(x, scale, r);
      band = commfuse::fp8_in_band(__fmul_rn(x, r));
    }
    const bool codes_differ = (commfuse::e4m3x2(want, 0.f) & 0xffu) != (commfuse::e4m3x2(got, 0.f) & 0xffu);
    const bool bits_differ = band && __float_as_uint(want) != __float_as_uint(got);
    code_diff += codes_differ;
    bits_diff += bits_differ;
    in_band += band;
    if (codes_differ || bits_differ)
      atomicCAS(p.first, ~0ull, (static_cast<unsigned long long>(blockIdx.y) << 32) | xb);
  }
  // One atomic per warp and counter.
  for (int o = 16; o > 0; o >>= 1) {
    code_diff += __shfl_xor_sync(0xffffffffu, code_diff, o);
    bits_diff += __shfl_xor_sync(0xffffffffu, bits_diff, o);
    in_band += __shfl_xor_sync(0xffffffffu, in_band, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&p.counts[0], code_diff);
    atomicAdd(&p.counts[1], bits_diff);
    atomicAdd(&p.counts[2], in_band);
  }
}

}  // namespace commfuse_test
