// Test kernels for csrc/epilogue.cuh's divisions by reciprocals, each against __fdiv_rn (the
// contract's true division), over every fp32 bit pattern of the dividend.
#include "epilogue.cuh"

namespace commfuse_test {

// Packed by tests/test_fp8_division.py as "<4QI4x".
struct CheckParams {
  const float* scales;           // check_fp8_division: the divisor of blockIdx.y
  unsigned long long x_count;    // dividends: the fp32 bit patterns x_first, x_first + 1, ...
  unsigned long long* counts;    // [0] codes that differ, [1] quotients inside the exact range
                                 // whose fp32 bits differ, [2] quotients inside that range
  unsigned long long* first;     // a mismatch, as (blockIdx.y << 32) | x bits; ~0 when none
  unsigned x_first;
};
static_assert(sizeof(CheckParams) == 40, "layout shared with tests/test_fp8_division.py");

// Runs check(x) -> (codes differ, bits differ, in the exact range) over this block's share of the
// dividends and adds the counts up (one atomic per warp and counter).
template <typename Check>
__device__ __forceinline__ void tally(const CheckParams& p, Check check) {
  unsigned long long n[3] = {0, 0, 0};
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < p.x_count; i += stride) {
    const unsigned xb = p.x_first + static_cast<unsigned>(i);
    bool r[3];
    check(__uint_as_float(xb), r);
    for (int k = 0; k < 3; ++k) n[k] += r[k];
    if (r[0] || r[1]) atomicCAS(p.first, ~0ull, (static_cast<unsigned long long>(blockIdx.y) << 32) | xb);
  }
  for (int k = 0; k < 3; ++k) {
    for (int o = 16; o > 0; o >>= 1) n[k] += __shfl_xor_sync(0xffffffffu, n[k], o);
    if (threadIdx.x % 32 == 0) atomicAdd(&p.counts[k], n[k]);
  }
}

__device__ __forceinline__ unsigned e4m3_code(float x) { return commfuse::e4m3x2(x, 0.f) & 0xffu; }

__device__ __forceinline__ bool same_float(float a, float b) {
  return __float_as_uint(a) == __float_as_uint(b) || (isnan(a) && isnan(b));
}

// FP8: fp8_divide(x, scale) and __fdiv_rn(x, scale) give one e4m3 code, and inside fp8_divide's
// band (|q| in [2^-20, 2^20]) one fp32 quotient.
__global__ void check_fp8_division(const __grid_constant__ CheckParams p) {
  const float scale = p.scales[blockIdx.y];
  const float r = commfuse::fp8_reciprocal(scale);
  tally(p, [&](float x, bool (&out)[3]) {
    const float want = __fdiv_rn(x, scale);
    float got = want;
    bool band = false;
    if (r != 0.f) {
      got = commfuse::fp8_divide(x, scale, r);
      const float a = fabsf(__fmul_rn(x, r));
      band = a >= 0x1p-20f && a <= 0x1p20f;
    }
    out[0] = e4m3_code(want) != e4m3_code(got);
    out[1] = band && __float_as_uint(want) != __float_as_uint(got);
    out[2] = band;
  });
}

// NVFP4, for the scale factor byte blockIdx.y (0..127: every positive e4m3 code, 0 and NaN too)
// and every S: nvfp4_encode_scale(S, sf) is __fdiv_rn(S, sf) bit for bit (any NaN for a NaN).
// Block row 128 checks the scale factor itself: nvfp4_scale_factor(1, y) is e4m3(__fdiv_rn(y, 6)).
__global__ void check_nvfp4_scales(const __grid_constant__ CheckParams p) {
  if (blockIdx.y == 128) {
    tally(p, [](float y, bool (&out)[3]) {
      out[0] = commfuse::nvfp4_scale_factor(1.f, y) != e4m3_code(__fdiv_rn(y, 6.f));
      out[1] = false;
      out[2] = true;
    });
    return;
  }
  const unsigned sf = blockIdx.y;
  const float sf_value = commfuse::e4m3_to_float(static_cast<unsigned char>(sf));
  tally(p, [&](float S, bool (&out)[3]) {
    if (sf_value == 0.f) {  // the kernels take enc = 0 there without dividing
      out[0] = out[1] = out[2] = false;
      return;
    }
    const bool range = commfuse::exact_divisor_range(S);
    out[0] = false;
    out[1] = !same_float(commfuse::nvfp4_encode_scale(S, sf, sf_value), __fdiv_rn(S, sf_value));
    out[2] = range;
  });
}

}  // namespace commfuse_test
