// The all-reduce tail as device code: residual add, RMSNorm, then optional FP8 or NVFP4
// quantization of one row.
//
// One implementation serves the local tail kernel (fused_tail.cu, after NCCL) and the P2P
// all-reduce kernels, which reduce a row across ranks and hand it over here. The semantics are
// docs/semantics.md, bit for bit where they pin the bits; commfuse/reference.py is the
// oracle the kernels are tested against.
//
// Contract with callers
// - One CTA handles one row at a time. blockDim.x is a multiple of 32 (full-warp shuffles) and
//   at most 32 * kTailMaxWarps. Every thread of the CTA calls the row functions (they contain
//   __syncthreads and warp shuffles).
// - A row is split into 16-byte vectors of 8 elements of T; thread threadIdx.x owns vectors
//   v = threadIdx.x + i * blockDim.x. Because blockDim.x is even, the two vectors of an NVFP4
//   block (2j, 2j+1) sit on neighbouring lanes of one warp.
// - All pointers are 16-byte aligned (the launcher guarantees it), h % 8 == 0 (h % 16 == 0 for
//   NVFP4).
// - Swizzled scale-factor padding: the owner of row m < t writes its row's padding columns;
//   the rows in [t, roundup(t, 128)) are written by whoever the caller assigns (fused_tail.cu
//   launches one extra CTA per padding row, which calls tail_sf_zero<QUANT>(p, row, 0)). The MN-major
//   FP8 block scales are padded alike: row m's padding bytes (UE8M0, blocks K..roundup(K, 4)) by
//   its owner, the rows in [t, roundup(t, 4)) by the caller's extra rows (tail_scale_zero(p, row, 0)).
// - fp8_block: h % 128 == 0, so a block of 128 elements is 16 consecutive vectors, held by 16
//   consecutive lanes of one warp (blockDim.x is a multiple of 32), all inside the row or all past it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cluster.cuh"
#include "commfuse_params.cuh"

namespace commfuse {

// The QUANT ids (kQuantNone, kQuantFp8, ...), the TailParams layout bits (kScaleMnMajor,
// kScaleUe8m0) and the parameter structs come from commfuse/kernels/params.py, which generates
// commfuse_params.cuh (included above) from the format registry, commfuse/tail/formats.py.
constexpr int kFp8Block = 128;
constexpr int kFp8BlockVectors = kFp8Block / 8;

constexpr int kVecElems = 8;       // elements of T in one 16-byte vector
// The formats whose block scales are scale factors in TailParams::sf_out, row-major or swizzled in
// 128x4 tiles (sf_swizzled), and the elements each one covers (NVFP4: 16, two vectors).
template <int QUANT>
constexpr bool kScaleFactors = QUANT == kQuantNvfp4 || QUANT == kQuantMxfp8;
template <int QUANT>
constexpr int kSfBlock = QUANT == kQuantMxfp8 ? 32 : 16;
constexpr int kTailMaxWarps = 32;  // size of the reduction scratch callers provide


// ------------------------------------------------------------------ T <-> fp32, two at a time

template <typename T>
struct Pack;

template <>
struct Pack<__half> {
  static __device__ __forceinline__ float2 unpack(unsigned w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
  static __device__ __forceinline__ float from_bits(unsigned bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};

template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ float2 unpack(unsigned w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
  static __device__ __forceinline__ float from_bits(unsigned bits) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
  }
};

__device__ __forceinline__ void words(const uint4& v, unsigned (&w)[4]) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  unsigned w[4];
  words(v, w);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = Pack<T>::unpack(w[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

// ------------------------------------------------------------------ FP8 e4m3

// fp32 pair -> two e4m3 bytes (lo in the low byte): RNE, saturating to +-448 (Inf too).
// The hardware convert (sm_89+) and the emulation below it may disagree on a NaN's sign; the
// contract has one NaN code, 0x7F, so NaNs are made positive first.
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
  const float qnan = __int_as_float(0x7fffffff);
  const float2 v = make_float2(isnan(lo) ? qnan : lo, isnan(hi) ? qnan : hi);
  return __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_to_float(unsigned char b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// ------------------------------------------------------------------ e2m1

// Hardware e2m1 conversion exists on the arch-specific Blackwell targets (sm_100a, sm_120a, ...,
// and the sm_10x/11x/12x families); the guard follows cuda_fp8.h's own. NVRTC 12.8 has only the
// __CUDA_ARCH_FEAT_* macros.
#if defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000) && \
    (__CUDA_ARCH_FAMILY_SPECIFIC__ < 1300)
#define COMMFUSE_HW_E2M1 1
#elif defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) || \
    defined(__CUDA_ARCH_FEAT_SM103_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL) ||     \
    defined(__CUDA_ARCH_FEAT_SM121_ALL)
#define COMMFUSE_HW_E2M1 1
#else
#define COMMFUSE_HW_E2M1 0
#endif

// Full e2m1 code from x and its magnitude code: the sign bit is the float's (so -0.0 -> 0x8).
// kNaNs: x may be NaN, whose code is 0 (reference.e2m1_encode). norm * enc is NaN only when enc
// is not finite (a NaN block, or S / sf overflowing for an absurdly small scale); the caller
// takes this slower form only then.
template <bool kNaNs>
__device__ __forceinline__ unsigned e2m1_with_sign(float x, unsigned magnitude) {
  const unsigned code = magnitude | ((__float_as_uint(x) >> 28) & 0x8u);
  return (kNaNs && isnan(x)) ? 0u : code;
}

#if COMMFUSE_HW_E2M1
// The instruction is fed |x|, and its NaN result (+6, per the emulation in cuda_fp4.hpp) is
// overridden by e2m1_with_sign: only its RNE rounding of finite values and Inf is relied on.
template <bool kNaNs>
__device__ __forceinline__ unsigned e2m1_pair(float lo, float hi) {
  unsigned short packed;
  asm("{\n"
      "  .reg .b8 q;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 q, %1, %2;\n"  // first source -> high nibble
      "  mov.b16 %0, {q, 0};\n"
      "}"
      : "=h"(packed)
      : "f"(fabsf(hi)), "f"(fabsf(lo)));
  return e2m1_with_sign<kNaNs>(lo, packed & 0x7u) | (e2m1_with_sign<kNaNs>(hi, (packed >> 4) & 0x7u) << 4);
}
#else
// e2m1 magnitude code of |x| (0..7 for 0, .5, 1, 1.5, 2, 3, 4, 6), RNE, saturating; NaN is the
// caller's. The spec is the threshold form of reference.e2m1_encode:
//   (m > .25) + (m >= .75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5)
// which costs ~21 instructions per element on sm_90; this form costs ~8 and equals it for every
// non-NaN fp32 (checked exhaustively over all 2^32 bit patterns).
__device__ __forceinline__ unsigned e2m1_magnitude(float x) {
  const unsigned b = __float_as_uint(x) & 0x7fffffffu;
  // |x| < 1: the codes 0, 1, 2 are 2|x| rounded to an integer. Added to 1.5 * 2^23 (unit ulp,
  // even) in one fma, the rounding is the adder's RNE and the integer lands in the low bits.
  const unsigned small = __float_as_uint(fmaf(fabsf(x), 2.0f, 12582912.0f)) & 0x3u;
  // |x| >= 1: e2m1 is fp32 cut to one mantissa bit. Rounding the bit pattern (add half an ulp
  // of the kept bit, minus one, plus the kept bit: RNE) and dropping 22 bits leaves
  // (exponent << 1 | bit); fp32's 1.0 (254) is code 2. Inf and overflow saturate at 7.
  const unsigned big = min(((b + 0x1fffffu + ((b >> 22) & 1u)) >> 22) - 252u, 7u);
  return b < 0x3f800000u ? small : big;
}

template <bool kNaNs>
__device__ __forceinline__ unsigned e2m1_pair(float lo, float hi) {
  return e2m1_with_sign<kNaNs>(lo, e2m1_magnitude(lo)) | (e2m1_with_sign<kNaNs>(hi, e2m1_magnitude(hi)) << 4);
}
#endif

// Eight codes, element j in bits [4j, 4j+4): the even element of each byte in its low nibble.
template <bool kNaNs>
__device__ __forceinline__ unsigned e2m1x8(const float (&x)[8]) {
  unsigned out = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) out |= e2m1_pair<kNaNs>(x[2 * j], x[2 * j + 1]) << (8 * j);
  return out;
}

// ------------------------------------------------------------------ per-vector steps

// round_T(a + r) for 8 elements; adds the squares of the rounded values to sumsq.
template <typename T>
__device__ __forceinline__ uint4 add_round(const uint4& a, const uint4& r, float& sumsq) {
  unsigned wa[4], wr[4], out[4];
  words(a, wa);
  words(r, wr);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 fa = Pack<T>::unpack(wa[j]);
    const float2 fr = Pack<T>::unpack(wr[j]);
    out[j] = Pack<T>::pack(fa.x + fr.x, fa.y + fr.y);
    const float2 fo = Pack<T>::unpack(out[j]);  // the norm sees the T-rounded residual
    sumsq = fmaf(fo.x, fo.x, sumsq);
    sumsq = fmaf(fo.y, fo.y, sumsq);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Without a residual the norm's input is a itself: round_T(a + 0) would turn -0.0 into +0.0.
template <typename T>
__device__ __forceinline__ void add_squares(const uint4& a, float& sumsq) {
  float f[8];
  unpack8<T>(a, f);
#pragma unroll
  for (int j = 0; j < 8; ++j) sumsq = fmaf(f[j], f[j], sumsq);
}

// The norm's input: round_T(a + r), or a when the call has no residual (TailParams::residual_in
// nullptr). kMayLackResidual: the caller takes calls without one (the local tail kernel); the P2P
// kernels always have one, and their 1024-thread tails have no register to spare for the branch.
template <typename T, bool kMayLackResidual>
__device__ __forceinline__ uint4 norm_input(const TailParams& p, const uint4& a, const uint4& r, float& sumsq) {
  if (kMayLackResidual && p.residual_in == nullptr) {
    add_squares<T>(a, sumsq);
    return a;
  }
  return add_round<T>(a, r, sumsq);
}

// round_T((x * inv) * (offset + w)), in the reference's order of operations. The host passes
// offset = -0.0 for a weight offset of 0: w + (-0.0) is w for every w (-0.0 included), so the
// reference's "no addition" needs no branch here.
template <typename T>
__device__ __forceinline__ uint4 norm_round(const uint4& x, const uint4& w, float inv, float offset) {
  unsigned wx[4], ww[4], out[4];
  words(x, wx);
  words(w, ww);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 fx = Pack<T>::unpack(wx[j]);
    const float2 fw = Pack<T>::unpack(ww[j]);
    out[j] = Pack<T>::pack(__fmul_rn(__fmul_rn(fx.x, inv), __fadd_rn(offset, fw.x)),
                           __fmul_rn(__fmul_rn(fx.y, inv), __fadd_rn(offset, fw.y)));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The contract quantizes e4m3(x / scale) with a true division; x * (1/scale) alone can round
// differently, and __fdiv_rn per element (a reciprocal on the SFU, its refinement and a range
// check) made the FP8 tail the slowest pattern. Instead one correctly rounded reciprocal
// r = RN(1/scale) per vector, and per element q = RN(x r) and RN(q + (x - q scale) r), two FMAs:
// Markstein's correction. His theorem needs q within an ulp of x / scale, which q = RN(x r) can
// miss (by up to ~1.4 ulp), so the proof is a check instead: with |scale| in [2^-64, 2^64] and
// |q| in the band [2^-20, 2^20], every operation is an IEEE-rounded fmul/fma on normal numbers
// (inexact remainders are >= 2^-106, exact ones lie on a 2^-130 grid), so the result for
// (x 2^i, scale 2^j) is the result for (x, scale) times 2^(i-j), and tests/test_fp8_division.py
// compares it with __fdiv_rn for every pair of mantissas (COMMFUSE_TEST_EXHAUSTIVE=1; done on an
// H200: the same on any GPU, as only correctly rounded operations are involved): identical.
// Outside the band q is used as it is: e4m3 saturates above 448 and rounds below 2^-10 to a
// signed zero, so q and the true quotient give the same code there (NaN and Inf too). Outside
// that scale range fp8_reciprocal returns 0 and every element divides truly.
constexpr float kFp8BandLow = 0x1p-20f, kFp8BandHigh = 0x1p20f;

__device__ __forceinline__ float fp8_reciprocal(float scale) {
  const float a = fabsf(scale);
  return a >= 0x1p-64f && a <= 0x1p64f ? __frcp_rn(scale) : 0.f;
}

// Whether fp8_divide corrects q = RN(x r) (inside the band) or keeps it.
__device__ __forceinline__ bool fp8_in_band(float q) {
  const float a = fabsf(q);
  return a >= kFp8BandLow && a <= kFp8BandHigh;
}

// x / scale as e4m3 sees it; r = fp8_reciprocal(scale), not 0.
__device__ __forceinline__ float fp8_divide(float x, float scale, float r) {
  const float q = __fmul_rn(x, r);
  const float exact = __fmaf_rn(__fmaf_rn(-q, scale, x), r, q);
  return fp8_in_band(q) ? exact : q;
}

// x / scale as e4m3 sees it for a computed scale (reference._fp8_groups: normal >= 2^-126, +Inf or
// NaN), given k, s = scale * k and r = RN(1 / s) of fp8_computed_reciprocal. No true division: x / scale
// is (x k) / (scale k) for a power of two k that brings s into fp8_divide's proven range; x k is exact
// (k = 2^64 for a scale below 2^-64, so x is no smaller than a subnormal), or, for k = 2^-64 (a scale
// above 2^64), inexact only below 2^-62, where both quotients are below e4m3's smallest half-step and
// give the same signed zero. Scale +Inf: r = 0 and q = x * 0, a signed zero; +-Inf in such a group
// gives +-448 (x itself, saturated), not Inf / Inf. A NaN scale gives NaN codes.
__device__ __forceinline__ float fp8_computed_divide(float x, float k, float s, float r) {
  return isinf(x) && isinf(s) ? x : fp8_divide(__fmul_rn(x, k), s, r);
}

// e4m3x2 for values that are not NaN: the convert alone.
__device__ __forceinline__ unsigned e4m3x2_number(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// fp8_divide of an element x of a group by the group's computed scale (fp8_group_scale, or its
// UE8M0 rounding up), inside fp8_reciprocal's range: |x| <= amax and scale >= RN(amax / 448), so
// |q| <= 448 (1 + 2^-22) and only the band's lower end needs a test.
__device__ __forceinline__ float fp8_group_divide(float x, float scale, float r) {
  const float q = __fmul_rn(x, r);
  const float exact = __fmaf_rn(__fmaf_rn(-q, scale, x), r, q);
  return fabsf(q) >= kFp8BandLow ? exact : q;
}

// e4m3(norm / scale) as the contract divides (see fp8_divide), given r = fp8_reciprocal(scale).
// kComputed: a computed scale, see fp8_computed_divide; pow2: it is a power of two (UE8M0).
template <typename T, bool kComputed = false>
__device__ __forceinline__ uint2 quant_fp8(const uint4& n, float scale, float r, bool pow2 = false) {
  unsigned w[4];
  words(n, w);
  // A pair at a time, and the rare cases in branches of their own: the 1024-thread P2P tails have
  // 64 registers.
  if (r != 0.f) {
    if constexpr (kComputed) {
      // The common case of a computed scale: k = 1 and s finite in fp8_computed_divide, so x k is x
      // and its Inf test is false. The scale is finite, so no element of its group is NaN or Inf
      // (either would make amax NaN or +Inf; lanes past the row's end, whose codes are not stored,
      // aside), and e4m3x2's NaN test is left out. For a power of two
      // r is exact and x r is RN(x / scale) itself, which is what fp8_divide returns then (inside
      // the band q is exact, so the remainder is 0).
      if (pow2) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = Pack<T>::unpack(w[j]);
          w[j] = e4m3x2_number(__fmul_rn(f.x, r), __fmul_rn(f.y, r));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = Pack<T>::unpack(w[j]);
          w[j] = e4m3x2_number(fp8_group_divide(f.x, scale, r), fp8_group_divide(f.y, scale, r));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Pack<T>::unpack(w[j]);
        w[j] = e4m3x2(fp8_divide(f.x, scale, r), fp8_divide(f.y, scale, r));
      }
    }
  } else if constexpr (kComputed) {
    const float k = scale < 0x1p-64f ? 0x1p64f : scale > 0x1p64f ? 0x1p-64f : 1.f;
    const float s = __fmul_rn(scale, k);
    const float rs = __frcp_rn(s);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = Pack<T>::unpack(w[j]);
      w[j] = e4m3x2(fp8_computed_divide(f.x, k, s, rs), fp8_computed_divide(f.y, k, s, rs));
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = Pack<T>::unpack(w[j]);
      w[j] = e4m3x2(__fdiv_rn(f.x, scale), __fdiv_rn(f.y, scale));
    }
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// Largest |x| of 8 T values, as the bit pattern of a T. Without the sign bit, the integer order
// of fp16/bf16 patterns is the order of their magnitudes, with every NaN above Inf: so a NaN in
// the block comes out as NaN (fmaxf would drop it) and gives the block a NaN scale factor.
__device__ __forceinline__ unsigned abs_max_bits(const uint4& n) {
  unsigned m = __vmaxu2(n.x & 0x7fff7fffu, n.y & 0x7fff7fffu);
  m = __vmaxu2(m, n.z & 0x7fff7fffu);
  m = __vmaxu2(m, n.w & 0x7fff7fffu);
  return max(m & 0xffffu, m >> 16);
}

// Where row m's scale factors start; block k of the row is at sf_offset(p, base, k).
template <int QUANT>
__device__ __forceinline__ size_t sf_row_base(const TailParams& p, unsigned m) {
  const unsigned K = static_cast<unsigned>(p.h) / kSfBlock<QUANT>;
  if (!p.sf_swizzled) return static_cast<size_t>(m) * K;
  const unsigned k_tiles = (K + 3) / 4;
  return static_cast<size_t>(m / 128) * (static_cast<size_t>(k_tiles) * 512) + (m % 32) * 16 +
         ((m % 128) / 32) * 4;
}

__device__ __forceinline__ size_t sf_offset(const TailParams& p, size_t row_base, unsigned k) {
  return row_base + (p.sf_swizzled ? (k / 4) * 512 + (k % 4) : k);
}

// Zero the swizzled scale factors of row m for blocks [k_begin, roundup(K, 4)).
template <int QUANT>
__device__ __forceinline__ void tail_sf_zero(const TailParams& p, int m, int k_begin) {
  const int k_end = ((p.h / kSfBlock<QUANT>) + 3) & ~3;
  const size_t base = sf_row_base<QUANT>(p, m);
  unsigned char* sf = static_cast<unsigned char*>(p.sf_out);
  for (int k = k_begin + static_cast<int>(threadIdx.x); k < k_end; k += blockDim.x) sf[sf_offset(p, base, k)] = 0;
}

// ------------------------------------------------------------------ FP8 with computed scales

// reference._fp8_groups' scale of a group of largest magnitude amax: max(RN(amax / 448), 2^-126),
// NaN as the canonical 0x7FC00000. amax is a T value (the largest |norm| of the group, from
// abs_max_bits), and for those the division is fp8_divide's reciprocal and correction without its
// band: RN(amax RN(1/448)) corrected by two FMAs is RN(amax / 448) for every finite fp16 and bf16
// value, subnormal quotients included (tests/test_fp8_group_scale.py checks each one in exact
// arithmetic). For amax = +Inf, the one input that makes q infinite, the remainder is NaN and q
// itself is the quotient.
constexpr float kFp8Max = 448.f, kFp8MaxReciprocal = 0x1.24924ap-9f;  // RN(1 / 448)

__device__ __forceinline__ float fp8_group_scale(float amax) {
  const float q = __fmul_rn(amax, kFp8MaxReciprocal);
  const float s = isinf(q) ? q : __fmaf_rn(__fmaf_rn(-q, kFp8Max, amax), kFp8MaxReciprocal, q);
  return isnan(s) ? __int_as_float(0x7fc00000) : fmaxf(s, 0x1p-126f);
}

// The scale a block's codes divide by: its group scale, or with UE8M0 that rounded up to a power
// of two on the bits (reference.ue8m0_from_scale: E = e + (mantissa != 0), at most 0xFF, whose
// value is +Inf; a NaN scale stays NaN). The UE8M0 byte is the result's bits >> 23 in every case.
// The group scale is positive and normal or +Inf, so adding 2^23 - 1 to its bits carries into the
// exponent exactly when the mantissa is not 0 (a scale above 2^127 carries into +Inf's pattern, and
// +Inf stays +Inf), and the mask drops the mantissa.
__device__ __forceinline__ float fp8_block_scale(const TailParams& p, float amax) {
  const float s = fp8_group_scale(amax);
  if (!(p.scale_layout & kScaleUe8m0)) return s;
  return isnan(s) ? s : __uint_as_float((__float_as_uint(s) + 0x7fffffu) & 0x7f800000u);
}

// Block k of row m's scale (sq: what its codes divide by), in the caller's layout (docs/semantics.md
// section 11): float32 or UE8M0 bytes, row-major [t, K] or MN-major with column stride scale_stride
// (roundup(t, 4) of the whole call, also when the P2P launcher cuts it into pieces of rows).
__device__ __forceinline__ void store_block_scale(const TailParams& p, int m, unsigned k, float sq) {
  const int K = p.h / kFp8Block;
  const bool mn = p.scale_layout & kScaleMnMajor;
  if (p.scale_layout & kScaleUe8m0) {
    const size_t i = mn ? 4 * (static_cast<size_t>(k / 4) * p.scale_stride + m) + k % 4 : static_cast<size_t>(m) * K + k;
    static_cast<unsigned char*>(p.scales_out)[i] = static_cast<unsigned char>(__float_as_uint(sq) >> 23);
  } else {
    const size_t i = mn ? static_cast<size_t>(k) * p.scale_stride + m : static_cast<size_t>(m) * K + k;
    static_cast<float*>(p.scales_out)[i] = sq;
  }
}

// MN-major padding of row m: its entries for blocks [k_begin, K) (float32) or [k_begin, roundup(K, 4))
// (UE8M0 bytes) are zeroed; the row-major layouts have none.
__device__ __forceinline__ void tail_scale_zero(const TailParams& p, int m, int k_begin) {
  if (!(p.scale_layout & kScaleMnMajor)) return;
  const int K = p.h / kFp8Block;
  const int k_end = (p.scale_layout & kScaleUe8m0) ? (K + 3) & ~3 : K;
  for (int k = k_begin + static_cast<int>(threadIdx.x); k < k_end; k += blockDim.x) store_block_scale(p, m, k, 0.f);
}

// The scalar the quantizer needs: the dequant scale for FP8, S = 1/scale for NVFP4.
template <int QUANT>
__device__ __forceinline__ float quant_scalar(const TailParams& p) {
  if constexpr (QUANT == kQuantFp8) return *p.scale;
  if constexpr (QUANT == kQuantNvfp4) return __frcp_rn(*p.scale);
  return 0.f;
}

// The maximum of v over this lane's half warp (lanes 0-15 or 16-31: an fp8_block block), for all
// 32 lanes. redux.sync (sm_80+, which every arch built is) reduces a whole warp in one instruction,
// so two of them, each over the values of one half (0 in the other), replace four dependent
// shuffles and maxima; the max of unsigned bit patterns is exact and needs no order.
__device__ __forceinline__ unsigned half_warp_max(unsigned v) {
  const bool low = (threadIdx.x & 16) == 0;
  const unsigned lo = __reduce_max_sync(0xffffffffu, low ? v : 0u);
  const unsigned hi = __reduce_max_sync(0xffffffffu, low ? 0u : v);
  return low ? lo : hi;
}

// fp8_block: the scale of a block whose amax (abs_max_bits, over its half warp) is m.
template <typename T>
__device__ __forceinline__ float block_scale(const TailParams& p, unsigned m) {
  return fp8_block_scale(p, Pack<T>::from_bits(m));
}

// Stores, and quantization, of vector v of row `row`, given its T-rounded norm n. Every lane of
// the warp must call it (NVFP4 pairs lanes through a shuffle, MXFP8 joins four); `active` is false for
// lanes past the row's end, whose inputs are zero. sf_base: sf_row_base(p, row). qs: quant_scalar<QUANT>, for
// fp8_per_token the row's scale, for fp8_block the block's (block_scale; the caller stores it).
// kGivenReciprocal: qr is fp8_reciprocal(qs), computed by the caller; else it is computed here.
template <typename T, int QUANT, bool kGivenReciprocal = false>
__device__ __forceinline__ void emit_norm(const TailParams& p, int row, size_t sf_base, int v, bool active,
                                          const uint4& n, float qs, float qr = 0.f) {
  const size_t row_base = static_cast<size_t>(row) * p.h;
  if (active && p.norm_out != nullptr)
    reinterpret_cast<uint4*>(static_cast<T*>(p.norm_out) + row_base)[v] = n;
  if constexpr (QUANT == kQuantFp8 || QUANT == kQuantFp8PerToken || QUANT == kQuantFp8Block) {
    const float r = kGivenReciprocal ? qr : fp8_reciprocal(qs);
    const uint2 q = quant_fp8<T, QUANT != kQuantFp8>(n, qs, r, QUANT == kQuantFp8Block && (p.scale_layout & kScaleUe8m0));
    if (active) reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + row_base)[v] = q;
  } else if constexpr (QUANT == kQuantNvfp4) {
    unsigned m = abs_max_bits(n);
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the block's other half, on lane ^ 1
    const float vmax = Pack<T>::from_bits(m);
    // A block of zeros has scale factor 0 whatever the scale: where 1/scale overflows (a scale of 0, which the
    // host cannot read in a device tensor), Inf * 0 would make it NaN.
    const float scaled = vmax == 0.f ? 0.f : __fmul_rn(qs, vmax);
    const unsigned char sf = static_cast<unsigned char>(e4m3x2(__fdiv_rn(scaled, 6.0f), 0.f));
    const float sf_value = e4m3_to_float(sf);
    // A NaN scale factor gives enc = NaN, so every code of the block is 0 (e2m1 of NaN).
    const float enc = sf_value == 0.f ? 0.f : __fdiv_rn(qs, sf_value);
    float f[8];
    unpack8<T>(n, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = __fmul_rn(f[j], enc);
    unsigned codes;
    if (isfinite(enc)) {
      codes = e2m1x8<false>(f);
    } else {
      codes = e2m1x8<true>(f);
    }
    if (active) {
      reinterpret_cast<unsigned*>(static_cast<unsigned char*>(p.quant_out) + row_base / 2)[v] = codes;
      if ((v & 1) == 0) static_cast<unsigned char*>(p.sf_out)[sf_offset(p, sf_base, v / 2)] = sf;
    }
  } else if constexpr (QUANT == kQuantMxfp8) {
    // A block of 32 is vectors 4j..4j+3: lanes 4j..4j+3 of one warp (blockDim.x % 32 == 0, h % 32 == 0,
    // so a block's lanes are all inside the row or all past it). Its scale is fp8_block's rounded up
    // to a power of two (the UE8M0 bit is set for MXFP8), its byte the scale's exponent bits.
    unsigned m = abs_max_bits(n);
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float s = block_scale<T>(p, m);
    const uint2 q = quant_fp8<T, true>(n, s, fp8_reciprocal(s), true);
    if (active) {
      reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + row_base)[v] = q;
      if ((v & 3) == 0)
        static_cast<unsigned char*>(p.sf_out)[sf_offset(p, sf_base, v / 4)] =
            static_cast<unsigned char>(__float_as_uint(s) >> 23);
    }
  }
}

// Norm, and quantization, of vector v of row `row`, given its T-rounded residual x and weight w
// (emit_norm's contract; for fp8_block every lane of the warp must call it, as the block maximum is
// reduced over 16 lanes).
template <typename T, int QUANT>
__device__ __forceinline__ void emit_vector(const TailParams& p, int row, size_t sf_base, int v, bool active,
                                            const uint4& x, const uint4& w, float inv, float qs) {
  const uint4 n = norm_round<T>(x, w, inv, p.weight_offset);
  if constexpr (QUANT == kQuantFp8Block) {  // every lane of the block's half warp computes its scale
    qs = block_scale<T>(p, half_warp_max(abs_max_bits(n)));
    if (active && v % kFp8BlockVectors == 0) store_block_scale(p, row, static_cast<unsigned>(v) / kFp8BlockVectors, qs);
  }
  emit_norm<T, QUANT>(p, row, sf_base, v, active, n, qs);
}

// op(...op(op(init, x_0), x_1)..., x_n) of v over the CTA, the same bits in every thread (warp
// results are combined in warp order). red: shared scratch of at least blockDim.x / 32 words, free
// again on return; kFreeRed false leaves out the barrier that frees it, for a caller whose next
// __syncthreads comes before any thread writes red again.
template <bool kFreeRed = true, typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, V* red, V init, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warps = blockDim.x / 32;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  V total = init;
  for (int i = 0; i < warps; ++i) total = op(total, red[i]);
  if (kFreeRed) __syncthreads();  // lets the caller reuse red for the next row
  return total;
}

template <bool kFreeRed = true>
__device__ __forceinline__ float block_sum(float v, float* red) {
  return block_reduce<kFreeRed>(v, red, 0.f, [](float a, float b) { return a + b; });
}

// fp8_per_token: the row's scale from the largest |norm| bit pattern each thread saw (abs_max_bits:
// a NaN stays above every number, so the scale is NaN), stored by thread 0 (float32 [t]).
// A maximum is exact in any order, so unlike block_sum it takes redux.sync (sm_80+, which every arch
// built is): one instruction per warp, and one more per warp over the warps' maxima. Its scratch is
// its own, so it needs no barrier of its own after the read: the next row's block_sum writes only
// its red, and its barrier comes before this scratch is written again. For the same reason the
// row's block_sum before it need not free red (tail_row, tail_row_looped): every thread has read it
// before this barrier, the next write of red comes after.
// A row split over a thread-block cluster (fused_tail.cu's moe_tail: one slice a CTA, every CTA
// calling this) takes the maximum over the cluster's CTAs, stored by the first.
template <typename T>
__device__ __forceinline__ float row_scale(const TailParams& p, int row, unsigned m) {
  __shared__ unsigned warp_max[kTailMaxWarps];
  m = __reduce_max_sync(0xffffffffu, m);
  const unsigned lane = threadIdx.x & 31;
  if (lane == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  unsigned amax = __reduce_max_sync(0xffffffffu, lane < blockDim.x / 32 ? warp_max[lane] : 0u);
  if (cluster_ctas() > 1) amax = cluster_reduce<kClusterMax>(amax, [](unsigned a, unsigned b) { return max(a, b); });
  const float s = fp8_group_scale(Pack<T>::from_bits(amax));
  if (threadIdx.x == 0 && cluster_rank() == 0) static_cast<float*>(p.scales_out)[row] = s;
  return s;
}

// rsqrt(mean + eps) of n values whose squares sum to sumsq (a row, or a gated norm's group).
__device__ __forceinline__ float inv_rms(float sumsq, int n, float eps) {
  return rsqrtf(__fdiv_rn(sumsq, static_cast<float>(n)) + eps);
}

__device__ __forceinline__ float inv_rms(float sumsq, const TailParams& p) { return inv_rms(sumsq, p.h, p.eps); }

// ------------------------------------------------------------------ whole rows

// The padding entries row `row` owns in its scale storage: swizzled scale-factor columns, MN-major
// UE8M0 bytes past the row's last block.
template <int QUANT>
__device__ __forceinline__ void tail_row_padding(const TailParams& p, int row) {
  if constexpr (kScaleFactors<QUANT>) {
    if (p.sf_swizzled) tail_sf_zero<QUANT>(p, row, p.h / kSfBlock<QUANT>);
  }
  if constexpr (QUANT == kQuantFp8Block) tail_scale_zero(p, row, p.h / kFp8Block);
}

// The rows of a tail's grid (commfuse/tail/spec.py's row_slots): t, and the padding rows of the scale
// storage (up to roundup(t, 128) for swizzled scale factors, roundup(t, 4) for MN-major FP8 block scales).
template <int QUANT>
__device__ __forceinline__ int tail_row_slots(const TailParams& p) {
  if constexpr (kScaleFactors<QUANT>) {
    if (p.sf_swizzled) return (p.t + 127) / 128 * 128;
  }
  if constexpr (QUANT == kQuantFp8Block) {
    if (p.scale_layout & kScaleMnMajor) return (p.t + 3) / 4 * 4;
  }
  return p.t;
}

// The padding rows [t, slots) a caller assigns beyond the data rows: their scale storage is zeroed.
template <int QUANT>
__device__ __forceinline__ void tail_padding_row(const TailParams& p, int row) {
  if constexpr (kScaleFactors<QUANT>) tail_sf_zero<QUANT>(p, row, 0);
  if constexpr (QUANT == kQuantFp8Block) tail_scale_zero(p, row, 0);
}

// The vectors of each CTA's slice of a row of nv vectors cut over `split` CTAs: an equal share rounded up to
// whole 16-vector blocks, so that every slice holds whole scale blocks of every format (emit_slice);
// commfuse/kernels/launch.py's slice_vectors, which sizes the CTAs by it.
__device__ __forceinline__ int slice_vectors(int nv, unsigned split) {
  return (nv + static_cast<int>(split) * 16 - 1) / (static_cast<int>(split) * 16) * 16;
}

// Stores and quantization of the T-rounded norms n of vectors [first, first + nv) of row `row` (thread
// threadIdx.x holds vectors first + threadIdx.x + i * blockDim.x, i < VPT; anything past nv), and, where
// the slice ends the row (an empty one past the end does not), the row's scale-storage padding. first
// is a multiple of 16 vectors, so a slice holds whole scale blocks of every format. qs: quant_scalar<QUANT>(p); fp8_per_token computes
// the scale of the slice here (the row's only where the slice is the whole row or the row's slices are
// a cluster's CTAs, row_scale: a caller that splits rows otherwise must not take that format), fp8_block
// its blocks' scales.
template <typename T, int QUANT, int VPT>
__device__ __forceinline__ void emit_slice(const TailParams& p, int row, const uint4 (&n)[VPT], float qs, int first,
                                           int nv) {
  const size_t sf_base = kScaleFactors<QUANT> ? sf_row_base<QUANT>(p, row) : 0;
  if constexpr (QUANT == kQuantFp8PerToken) {
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < nv) m = max(m, abs_max_bits(n[i]));  // past the row, 0 * inv may be NaN (inv = Inf)
    }
    qs = row_scale<T>(p, row, m);
  }
  if constexpr (QUANT == kQuantFp8Block) {
    // Vector i of the 16 lanes of a half warp is one block (kFp8BlockVectors). Its amax is reduced
    // by all of them, but its scale, reciprocal and scale store are one lane's work: lane i of the
    // half warp's, shuffled to the other lanes (the same bits as every lane computing them; the
    // per-vector version made this kernel issue ~18% more instructions than static FP8's).
    static_assert(VPT <= kFp8BlockVectors, "one lane of the half warp per vector");
    const int j = threadIdx.x % kFp8BlockVectors;  // the vector whose block this lane scales, if < VPT
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const unsigned mi = half_warp_max(abs_max_bits(n[i]));
      if (j == i) m = mi;
    }
    const float s = block_scale<T>(p, m);
    const float r = fp8_reciprocal(s);
    const int v_own = threadIdx.x + j * blockDim.x;
    if (j < VPT && v_own < nv)
      store_block_scale(p, row, static_cast<unsigned>(first + v_own) / kFp8BlockVectors, s);
    const int lane0 = threadIdx.x & 16;  // the half warp's first lane
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      emit_norm<T, QUANT, true>(p, row, sf_base, first + v, v < nv, n[i], __shfl_sync(0xffffffffu, s, lane0 + i),
                                __shfl_sync(0xffffffffu, r, lane0 + i));
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      emit_norm<T, QUANT>(p, row, sf_base, first + v, v < nv, n[i], qs);
    }
  }
  if (nv > 0 && first + nv == p.h / kVecElems) tail_row_padding<QUANT>(p, row);
}

// emit_slice of the whole row.
template <typename T, int QUANT, int VPT>
__device__ __forceinline__ void emit_row(const TailParams& p, int row, const uint4 (&n)[VPT], float qs) {
  emit_slice<T, QUANT, VPT>(p, row, n, qs, 0, p.h / kVecElems);
}

// The row tail comes in two steps, so that a caller can issue the loads that do not depend on
// the all-reduced values early (the P2P kernels issue them before their cross-rank wait, where
// their HBM latency hides behind the NVLink round trip):
//   tail_load (or tail_load_residual + tail_load_weight) and quant_scalar: loads only;
//   tail_row: the arithmetic and the stores, given the all-reduced values as well.
// Thread threadIdx.x holds vectors v = threadIdx.x + i * blockDim.x, i < VPT, of the row (zero
// past the row's end) in every array. Needs VPT * blockDim.x * 8 >= h.

// Residual vectors of row `row`.
template <typename T, int VPT>
__device__ __forceinline__ void tail_load_residual(const TailParams& p, int row, uint4 (&x)[VPT]) {
  const int nv = p.h / kVecElems;
  const uint4* res_in =
      reinterpret_cast<const uint4*>(static_cast<const T*>(p.residual_in) + static_cast<size_t>(row) * p.h);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    x[i] = v < nv ? res_in[v] : make_uint4(0, 0, 0, 0);
  }
}

// Weight vectors (the same for every row; read through the read-only path).
template <typename T, int VPT>
__device__ __forceinline__ void tail_load_weight(const TailParams& p, uint4 (&w)[VPT]) {
  const int nv = p.h / kVecElems;
  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    w[i] = v < nv ? __ldg(weight + v) : make_uint4(0, 0, 0, 0);
  }
}

// Residual and weight of row `row`, all loads in flight together.
template <typename T, int VPT>
__device__ __forceinline__ void tail_load(const TailParams& p, int row, uint4 (&x)[VPT], uint4 (&w)[VPT]) {
  tail_load_residual<T, VPT>(p, row, x);
  tail_load_weight<T, VPT>(p, w);
}

// Tail of row `row`: a[i] are the all-reduced values, x[i] the residual (tail_load_residual of
// this row; ignored without a residual), w[i] the weight (tail_load_weight), qs = quant_scalar<QUANT>(p).
// kMayLackResidual: see norm_input. kLateWeight: w_in is not read; the weights are loaded after the row's
// sum instead (from L1 / L2: every row reads them), so that they take no registers across it.
template <typename T, int QUANT, int VPT, bool kMayLackResidual = false, bool kLateWeight = false>
__device__ __forceinline__ void tail_row(const TailParams& p, int row, const uint4 (&a)[VPT], const uint4 (&x)[VPT],
                                         const uint4 (&w_in)[VPT], float qs, float* red) {
  const int nv = p.h / kVecElems;
  const size_t row_base = static_cast<size_t>(row) * p.h;
  uint4* res_out = reinterpret_cast<uint4*>(static_cast<T*>(p.residual_out) + row_base);
  const size_t sf_base = kScaleFactors<QUANT> ? sf_row_base<QUANT>(p, row) : 0;

  uint4 y[VPT];  // round_T(a + residual) (or a): residual_out, and the norm's input
  float sumsq = 0.f;
  const bool store_residual = !kMayLackResidual || p.residual_in != nullptr;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    y[i] = norm_input<T, kMayLackResidual>(p, a[i], x[i], sumsq);
    if (store_residual && v < nv) res_out[v] = y[i];
  }
  const float inv = inv_rms(block_sum<QUANT != kQuantFp8PerToken>(sumsq, red), p);
  uint4 w[VPT];
  if constexpr (kLateWeight) {
    tail_load_weight<T, VPT>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) w[i] = w_in[i];
  }

  if constexpr (QUANT == kQuantFp8PerToken || QUANT == kQuantFp8Block) {
    // The row's (the blocks') scales need the norms first: they replace the residual in registers.
#pragma unroll
    for (int i = 0; i < VPT; ++i) y[i] = norm_round<T>(y[i], w[i], inv, p.weight_offset);
    emit_row<T, QUANT, VPT>(p, row, y, qs);
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      emit_vector<T, QUANT>(p, row, sf_base, v, v < nv, y[i], w[i], inv, qs);
    }
    tail_row_padding<QUANT>(p, row);
  }
}

// Tail of a row too long for registers: LV vectors per thread at a time, in two passes (three for
// fp8_per_token). Pass 1 writes residual_out and sums squares; the last pass reads residual_out
// back (each thread only its own writes, so no fence is needed) for the norm and quantization;
// fp8_per_token's row scale comes from a pass in between that computes the norms without storing
// them. Without a residual there is no residual_out: the later passes re-read a (load_a) instead.
// load_a(v) returns vector v of the all-reduced row; qs = quant_scalar<QUANT>(p). Both kernels use
// LV = kLoopVectors.
constexpr int kLoopVectors = 4;
template <typename T, int QUANT, int LV, bool kMayLackResidual = false, typename LoadA>
__device__ __forceinline__ void tail_row_looped(const TailParams& p, int row, LoadA load_a, float qs, float* red) {
  const int nv = p.h / kVecElems;
  const int step = LV * blockDim.x;
  const size_t row_base = static_cast<size_t>(row) * p.h;
  const uint4* res_in = reinterpret_cast<const uint4*>(static_cast<const T*>(p.residual_in) + row_base);
  uint4* res_out = reinterpret_cast<uint4*>(static_cast<T*>(p.residual_out) + row_base);
  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const size_t sf_base = kScaleFactors<QUANT> ? sf_row_base<QUANT>(p, row) : 0;
  const bool has_residual = !kMayLackResidual || p.residual_in != nullptr;
  // Vector v of the norm's input, in the passes after the first.
  const auto load_input = [&](int v) { return has_residual ? __ldcg(res_out + v) : load_a(v); };

  float sumsq = 0.f;
  for (int c = 0; c < nv; c += step) {
    uint4 a[LV], r[LV];
#pragma unroll
    for (int i = 0; i < LV; ++i) {
      const int v = c + threadIdx.x + i * blockDim.x;
      a[i] = v < nv ? load_a(v) : zero;
      r[i] = v < nv && has_residual ? res_in[v] : zero;
    }
#pragma unroll
    for (int i = 0; i < LV; ++i) {
      const int v = c + threadIdx.x + i * blockDim.x;
      const uint4 x = norm_input<T, kMayLackResidual>(p, a[i], r[i], sumsq);
      if (has_residual && v < nv) res_out[v] = x;
    }
  }
  const float inv = inv_rms(block_sum<QUANT != kQuantFp8PerToken>(sumsq, red), p);

  if constexpr (QUANT == kQuantFp8PerToken) {
    unsigned m = 0;
    for (int c = 0; c < nv; c += step) {
      uint4 x[LV], w[LV];
#pragma unroll
      for (int i = 0; i < LV; ++i) {
        const int v = c + threadIdx.x + i * blockDim.x;
        x[i] = v < nv ? load_input(v) : zero;
        w[i] = v < nv ? __ldg(weight + v) : zero;
      }
#pragma unroll
      for (int i = 0; i < LV; ++i) {
        const int v = c + threadIdx.x + i * blockDim.x;
        if (v < nv) m = max(m, abs_max_bits(norm_round<T>(x[i], w[i], inv, p.weight_offset)));
      }
    }
    qs = row_scale<T>(p, row, m);
  }

  // The trip count is the same for every thread: emit_vector's shuffle needs whole warps.
  for (int c = 0; c < nv; c += step) {
    uint4 x[LV], w[LV];
#pragma unroll
    for (int i = 0; i < LV; ++i) {
      const int v = c + threadIdx.x + i * blockDim.x;
      x[i] = v < nv ? load_input(v) : zero;
      w[i] = v < nv ? __ldg(weight + v) : zero;
    }
#pragma unroll
    for (int i = 0; i < LV; ++i) {
      const int v = c + threadIdx.x + i * blockDim.x;
      emit_vector<T, QUANT>(p, row, sf_base, v, v < nv, x[i], w[i], inv, qs);
    }
  }
  tail_row_padding<QUANT>(p, row);
}

}  // namespace commfuse
