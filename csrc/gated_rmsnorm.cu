// Gated RMSNorm of Mamba2 / Nemotron-H (commfuse.reference.gated_rmsnorm), then the tail's optional
// quantization: the norm is rounded to T once and handed to epilogue.cuh's emit_row, so every
// quantization format (FP8 with a static or computed scale, NVFP4, MXFP8) is the tail's, bit for bit.
//
// Per row, groups of group_size consecutive elements (group_size % 8 == 0, dividing h) are
// normalised separately; silu(z) gates x before the norm (norm_before_gate 0) or the weighted norm
// after it (1); z == nullptr: no gate.
//
// Work: `splits` items per row (GatedNormParams::splits), plus as many per padding row of the scale storage
// (as fused_tail.cu). The groups are normalised independently, so a row may be split into slices of whole
// groups that share nothing (at few rows, where one CTA a row leaves the GPU idle, and at many rows, where
// shorter slices keep more rows' loads in flight). Grid: one CTA an item.
// Block: a multiple of 32 threads, at most kMaxThreads<VPT>, chosen by commfuse/kernels/gated_norm.py; the
// slice lives in registers (VPT vectors of 8 elements per thread, h / splits <= 8 * VPT * blockDim.x).
#include "epilogue.cuh"
#include "pdl.cuh"

namespace commfuse {

// The thread limits of fused_tail.cu's register variants, for the same reasons. VPT 4 holds x, z
// and the weight (12 vectors), which spilled at fused_tail's 4 CTAs per SM (64 registers): 2 here.
template <int VPT>
constexpr int kMaxThreads = VPT == 1 || VPT == 2 ? 1024 : 256;
template <int VPT>
constexpr int kMinBlocks = VPT == 4 ? 2 : 1;

// silu in fp32 as z * sigmoid(z), sigmoid(z) = (z >= 0 ? 1 : e) / (1 + e) with e = 2^(-|z| log2(e)) from the
// SFU (exp2f: ex2.approx, subnormal results kept) and its approximate reciprocal of 1 + e, in [1, 2].
// torch's formula, z / (1 + expf(-z)) with the accurate expf and an IEEE division, cost a quarter of the
// kernel's time at many rows: its arithmetic, not its bytes, set the pace. The exponent's rounding (|z| log2(e)
// < 2^7, so within 2^-17 absolute) dominates: silu is within 2^-17 relative, and the norm within an ulp of T
// of the reference (docs/semantics.md). Below -88.72 torch's expf(-z) overflows and its silu is -0 (no bf16
// or fp16 value lies between -88.75 and -88.6875): so is this one. No branch: the 8 elements of a vector
// interleave their SFU latencies.
__device__ __forceinline__ float silu(float z) {
  constexpr float kLog2E = 1.4426950408889634f;
  const float e = exp2f(-fabsf(z) * kLog2E);
  const float r = __fdividef(1.f, __fadd_rn(1.f, e));
  const float s = z >= 0.f ? r : __fmul_rn(e, r);  // e may be subnormal: a plain multiply keeps it
  return __fmul_rn(z, z < -88.72f ? 0.f : s);
}

// A vector's 8 norm inputs as fp32: x widened, or (gated first) the fp32 values gate_first_in_place
// left in the registers of x and z.
template <typename T>
__device__ __forceinline__ void norm_inputs(const uint4& x, const uint4& z, bool gate_first, float (&v)[8]) {
  if (gate_first) {
    const unsigned w[8] = {x.x, x.y, x.z, x.w, z.x, z.y, z.z, z.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __uint_as_float(w[j]);
  } else {
    unpack8<T>(x, v);
  }
}

// Gated first: v = RN(x * silu(z)) for 8 elements, computed once and kept as fp32 bits in the registers
// that held x and z (floats 0-3 in x, 4-7 in z): silu is the kernel's costliest step, and recomputing it
// for the norm doubled it (the same bits either way).
template <typename T>
__device__ __forceinline__ void gate_first_in_place(uint4& x, uint4& z) {
  float fx[8], fz[8];
  unpack8<T>(x, fx);
  unpack8<T>(z, fz);
  unsigned v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __float_as_uint(__fmul_rn(fx[j], silu(fz[j])));
  x = make_uint4(v[0], v[1], v[2], v[3]);
  z = make_uint4(v[4], v[5], v[6], v[7]);
}

// The sum of squares of a vector's 8 norm inputs (norm_inputs).
template <typename T>
__device__ __forceinline__ float gated_squares(const uint4& x, const uint4& z, bool gate_first) {
  float v[8];
  norm_inputs<T>(x, z, gate_first, v);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s = fmaf(v[j], v[j], s);
  return s;
}

// round_T(y) of gated_reference for 8 elements: y = RN(RN(v * inv) * w), times silu(z) when gated
// after the norm (z is then still the gate: silu is computed once in either order).
template <typename T>
__device__ __forceinline__ uint4 gated_norm_round(const uint4& x, const uint4& z, const uint4& w, float inv,
                                                  bool gate_first, bool gate_after) {
  float v[8], fz[8], fw[8];
  norm_inputs<T>(x, z, gate_first, v);
  unpack8<T>(z, fz);
  unpack8<T>(w, fw);
  unsigned out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float y[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int e = 2 * j + k;
      y[k] = __fmul_rn(__fmul_rn(v[e], inv), fw[e]);
      if (gate_after) y[k] = __fmul_rn(y[k], silu(fz[e]));
    }
    out[j] = Pack<T>::pack(y[0], y[1]);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// x's and z's vectors of `row`'s slice [first, first + nv) as the thread holds them (zero past the slice).
template <typename T, int VPT>
__device__ __forceinline__ void gated_load(const GatedNormParams& p, int row, int first, int nv, uint4 (&xv)[VPT],
                                           uint4 (&zv)[VPT]) {
  const size_t row_base = static_cast<size_t>(row) * p.tail.h + static_cast<size_t>(first) * kVecElems;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + row_base);
  const uint4* z = reinterpret_cast<const uint4*>(static_cast<const T*>(p.z) + row_base);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    xv[i] = v < nv ? x[v] : make_uint4(0, 0, 0, 0);
    zv[i] = p.z != nullptr && v < nv ? z[v] : make_uint4(0, 0, 0, 0);
  }
}

// The norm of one row's slice, loaded (gated_load), and its stores (emit_slice).
template <typename T, int QUANT, int VPT>
__device__ __forceinline__ void gated_slice(const GatedNormParams& p, int row, int first, int nv, uint4 (&xv)[VPT],
                                            uint4 (&zv)[VPT], const uint4 (&wv)[VPT], float* part) {
  const TailParams& tp = p.tail;
  const bool gated = p.z != nullptr;
  const bool gate_first = gated && !p.norm_before_gate;
  const bool gate_after = gated && p.norm_before_gate;
  float sumsq[VPT];  // per vector, then its group's
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (gate_first) gate_first_in_place<T>(xv[i], zv[i]);
    sumsq[i] = gated_squares<T>(xv[i], zv[i], gate_first);
  }
  const int gv = p.group_size / kVecElems;
  if (gv <= 32 && (gv & (gv - 1)) == 0) {
    // Thread i holds vectors i, i + blockDim.x, ... and blockDim.x is whole warps: a group's vectors in
    // one slot are gv consecutive lanes aligned to gv, so xor shuffles within them sum it, without
    // shared memory or barriers. nv is whole groups: lanes past the row (zero inputs) never share a
    // group with lanes in it. Every lane of a group ends with the same bits (a + b == b + a), the
    // shared-memory path's (it adds the same pairs, after exact zeros).
    for (int o = gv / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) sumsq[i] += __shfl_xor_sync(0xffffffffu, sumsq[i], o);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < nv) part[v] = sumsq[i];
    }
    __syncthreads();
    // Other group sizes straddle lanes or warps: so each group is summed by one warp, lane l over its
    // vectors l, l + 32, ..., then across lanes; the same order in every run. The sum replaces the
    // group's first entry: only this warp reads the group, and its lanes have read it before the
    // shuffles complete.
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x / 32; g < nv / gv; g += blockDim.x / 32) {
      float s = 0.f;
      for (int j = lane; j < gv; j += 32) s += part[g * gv + j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) part[g * gv] = s;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < nv) sumsq[i] = part[v / gv * gv];
    }
  }

  uint4 n[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    const float inv = v < nv ? inv_rms(sumsq[i], p.group_size, tp.eps) : 0.f;
    n[i] = gated_norm_round<T>(xv[i], zv[i], wv[i], inv, gate_first, gate_after);
  }
  emit_slice<T, QUANT, VPT>(tp, row, n, quant_scalar<QUANT>(tp), first, nv);
}

// The kernel's only parameter is GatedNormParams (TailParams for the outputs and the weight, with
// no residual; x, z, the group size, the gate's place and the slices a row), declared in
// commfuse/kernels/params.py.
//
// CTA b takes item b of the (row, slice) pairs, row-major, over the row slots.
template <typename T, int QUANT, int VPT>
__global__ void __launch_bounds__(kMaxThreads<VPT>, kMinBlocks<VPT>) gated_rmsnorm(const __grid_constant__ GatedNormParams p) {
  __shared__ float part[VPT * kMaxThreads<VPT>];  // the shared-memory path's sums, per vector then per group
  pdl_wait();
  pdl_launch_dependents();
  const TailParams& tp = p.tail;
  const int row = blockIdx.x / p.splits;
  const int nv = tp.h / kVecElems / p.splits;  // the slice's vectors, whole groups (and 16-vector blocks)
  const int first = static_cast<int>(blockIdx.x) % p.splits * nv;
  const uint4* weight = reinterpret_cast<const uint4*>(tp.weight) + first;
  uint4 wv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    wv[i] = v < nv ? __ldg(weight + v) : make_uint4(0, 0, 0, 0);
  }
  if (row < tp.t) {
    uint4 xv[VPT], zv[VPT];
    gated_load<T, VPT>(p, row, first, nv, xv, zv);
    gated_slice<T, QUANT, VPT>(p, row, first, nv, xv, zv, wv, part);
  } else if (first == 0) {
    tail_padding_row<QUANT>(tp, row);
  }
}

}  // namespace commfuse
