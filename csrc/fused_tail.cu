// Local fused tail, launched after NCCL's all-reduce: one kernel for residual add, RMSNorm and
// optional quantization (the device code lives in epilogue.cuh). With residual_in
// nullptr it is a plain RMSNorm (+ quantization) of a, commfuse.local's fused_add_rmsnorm(x, None, ...).
//
// Grid: one CTA per row, plus (swizzled scale factors: NVFP4, MXFP8) one per padding row of the last 128-row
// tile, which only zeroes that row's scale factors (FP8 block scales, MN-major: the same for the
// rows up to roundup(t, 4)). Rows go on gridDim.x (up to 2^31 - 1).
// Block: a multiple of 32 threads, at most kMaxThreads<VPT>, chosen by commfuse/kernels/fused_tail.py:
// for many rows 256 at most (several CTAs per SM overlap one row's loads with another's math; 512
// at VPT 2 for a tail without quantization, which has little math to overlap), for few rows
// (decode) up to 1024, so that each row's chain of dependent work is spread thin.
//
// One row per CTA even for small h: a row of a real model (h >= 2048) already fills 2 to 32
// warps, and smaller rows are too cheap for packing several per CTA to matter.
#include "cluster.cuh"
#include "epilogue.cuh"
#include "moe.cuh"
#include "pdl.cuh"

namespace commfuse {

// 1 or 2 vectors per thread fit 1024 threads (<= 64 registers); 4, and the looped variant,
// are built for 256.
template <int VPT>
constexpr int kMaxThreads = VPT == 1 || VPT == 2 ? 1024 : 256;
// CTAs of up to 256 threads that must fit on an SM at once: for VPT 4 (many rows), 4, i.e. <= 64
// registers (bf16 took 74-80 and fitted 3). With programmatic dependent launch the next kernel's
// CTAs become resident (and wait) while this one's run; with 3 slots per SM they crowded this
// kernel out: at 256 rows the bf16 tail took 6.0 us with PDL against 4.8 us without, and 4.8 us
// with PDL and 4 slots (H200). The bf16 FP8 variant then spills 4 bytes, which costs it 1-6% at
// h = 4096 (bench/journal.md).
template <int VPT>
constexpr int kMinBlocks = VPT == 4 ? 4 : 1;
// The VPT 4 tails without quantization, fp8 and nvfp4 load the weights after the row's sum (from L1 / L2:
// every row reads them), not with the row: 55-64 registers, no spill. They fit 5 CTAs an SM at 48
// registers too, but 4 measured 2-10% faster at 256-1024 rows and level from 2048 (H200, bench/journal.md).
template <int VPT, int QUANT>
constexpr bool kWeightAfterSum = VPT == 4 && (QUANT == kQuantNone || QUANT == kQuantFp8 || QUANT == kQuantNvfp4);

// The kernel's only parameter is FusedTailParams (the all-reduced input a, TailParams, then the post-norm's
// weight), declared in commfuse/kernels/params.py (the generated header commfuse_params.cuh, via epilogue.cuh).

// The post-norm (docs/semantics.md section 2a): a's row normalised with the post weight, the tail's eps and weight
// offset, in place, before the residual add. Its own block sum, which frees red for the tail's. The weight is
// loaded after the sum, a vector at a time: it takes no registers across it.
template <typename T, int VPT>
__device__ __forceinline__ void post_norm(const TailParams& p, const void* post_weight, uint4 (&a)[VPT], float* red) {
  const int nv = p.h / kVecElems;
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) add_squares<T>(a[i], sumsq);  // zero past the row's end
  const float inv = inv_rms(block_sum(sumsq, red), p);
  const uint4* w = static_cast<const uint4*>(post_weight);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nv) a[i] = norm_round<T>(a[i], __ldg(w + v), inv, p.weight_offset);
  }
}

// VPT > 0: the row lives in registers, VPT vectors of 8 elements per thread.
// VPT == 0: rows of any length, looped over (two passes over residual_out; with POST one more over a first).
// POST: the post-norm first (FusedTailParams::post_weight).
template <typename T, int QUANT, int VPT, bool POST>
__global__ void __launch_bounds__(kMaxThreads<VPT>, kMinBlocks<VPT>)
    fused_tail(const __grid_constant__ FusedTailParams p) {
  __shared__ float red[kMaxThreads<VPT> / 32];
  pdl_wait();  // the input is the previous kernel's (NCCL's) output
  pdl_launch_dependents();
  const int row = blockIdx.x;
  if (row >= p.tail.t) {
    tail_padding_row<QUANT>(p.tail, row);
    return;
  }
  const int nv = p.tail.h / kVecElems;
  const uint4* a = reinterpret_cast<const uint4*>(static_cast<const T*>(p.a) + static_cast<size_t>(row) * p.tail.h);
  if constexpr (VPT > 0) {
    uint4 av[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      av[i] = v < nv ? a[v] : make_uint4(0, 0, 0, 0);
    }
    // POST at VPT 4: the residual loaded after the post-norm's sum and the weight after the tail's, else the row,
    // the residual and the weight in flight across the post-norm's sum spill (4-62 bytes under 4 CTAs an SM).
    constexpr bool kResidualAfterPost = POST && VPT == 4;
    constexpr bool kLate = kWeightAfterSum<VPT, QUANT> || kResidualAfterPost;
    uint4 x[VPT], w[VPT];
    if constexpr (kResidualAfterPost) post_norm<T, VPT>(p.tail, p.post_weight, av, red);
    if (p.tail.residual_in != nullptr) {
      tail_load_residual<T, VPT>(p.tail, row, x);
    } else {  // a plain RMSNorm: tail_row takes a as the norm's input
#pragma unroll
      for (int i = 0; i < VPT; ++i) x[i] = make_uint4(0, 0, 0, 0);
    }
    if constexpr (!kLate) tail_load_weight<T, VPT>(p.tail, w);
    if constexpr (POST && !kResidualAfterPost) post_norm<T, VPT>(p.tail, p.post_weight, av, red);
    tail_row<T, QUANT, VPT, true, kLate>(p.tail, row, av, x, w, quant_scalar<QUANT>(p.tail), red);
  } else if constexpr (POST) {
    // A first pass for the post-norm's sum; then each read of a normalises it again (the same bits each time:
    // the later passes read residual_out, or a again without a residual).
    float sumsq = 0.f;
    for (int v = threadIdx.x; v < nv; v += blockDim.x) add_squares<T>(a[v], sumsq);
    const float inv = inv_rms(block_sum(sumsq, red), p.tail);
    const uint4* w = static_cast<const uint4*>(p.post_weight);
    const float offset = p.tail.weight_offset;
    tail_row_looped<T, QUANT, kLoopVectors, true>(
        p.tail, row, [a, w, inv, offset](int v) { return norm_round<T>(a[v], __ldg(w + v), inv, offset); },
        quant_scalar<QUANT>(p.tail), red);
  } else {
    tail_row_looped<T, QUANT, kLoopVectors, true>(p.tail, row, [a](int v) { return a[v]; },
                                                  quant_scalar<QUANT>(p.tail), red);
  }
}

// The MoE tail's VPT 1 variants built for more than kCombineChunk slots (k 6, 8) hold a token's k rows, their
// weights, indices and the indices' guess in flight at once: 256 threads at most, for up to 255 registers (under the
// 64 of 1024 threads the finalize form at k 8 spilled up to 300 bytes). commfuse/kernels/moe_tail.py takes them only
// where the grid's CTAs fit the SMs one each, so the registers cost no CTA its place. Those for fewer slots fit 64.
template <int VPT, int K>
constexpr int kMoeMaxThreads = VPT == 1 && K > kCombineChunk ? 256 : kMaxThreads<VPT>;

// The fused MoE tail (Communicator.moe_all_reduce at world size 1, where the all-reduce is the identity):
// each token's combine (moe.cuh) is the tail's input a, computed as its vectors are loaded, then
// fused_tail's row. FORM is kCombineReduction or kCombineFinalize32 / 64. A residual is required.
//
// Few tokens (VPT 1, SM 9.0+): launched in clusters of up to 8 CTAs per token (moe_tail.py's split). The
// combine reads k rows for every row of the tail, and one SM alone does not pull them at the HBM's pace
// (1 token, k = 8, h = 7168: 4.5 us against the dense tail's 2.2); so the row is cut into one slice a CTA
// (slice_vectors), and each CTA runs the whole tail on its slice: the combine, the residual, its sum
// of squares, which the cluster adds in rank order (cluster_reduce: one word a CTA through distributed
// shared memory), then the norm and the quantization of its slice (fp8_per_token's row scale is the
// cluster's maximum, row_scale). The combine is per vector: the same bits whichever CTA computes it.
// K: the k the variant is built for (combine_vec's K; the VPT 1 variants), 0 for any.
template <typename T, int FORM, int QUANT, int VPT, int K>
__global__ void __launch_bounds__(kMoeMaxThreads<VPT, K>, kMinBlocks<VPT>)
    moe_tail(const __grid_constant__ MoeTailParams p) {
  __shared__ float red[kMoeMaxThreads<VPT, K> / 32];
  // split CTAs for each token's row, then one for each padding row (the grid rounded up to clusters).
  const auto token_row = [&p](unsigned split) {
    const unsigned data = static_cast<unsigned>(p.tail.t) * split;
    return blockIdx.x >= data ? p.tail.t + static_cast<int>(blockIdx.x - data)
           : VPT == 1         ? static_cast<int>(cluster_id())  // blockIdx.x / split, without the division
                              : static_cast<int>(blockIdx.x);
  };
  // The finalize form at few tokens reads its row indices before the wait, as a guess (moe.cuh's guess_rows).
  constexpr bool kGuess = VPT == 1 && FORM != kCombineReduction;
  int guess[kChunk<K>];
  if constexpr (kGuess) {
    const int row = token_row(cluster_ctas());
    if (row < p.tail.t) guess_rows<FORM, K>(p.combine, row, guess);
  }
  pdl_wait();
  pdl_launch_dependents();
  const unsigned split = VPT == 1 ? cluster_ctas() : 1;
  const int row = token_row(split);
  if (row >= p.tail.t) {
    if (row < tail_row_slots<QUANT>(p.tail)) tail_padding_row<QUANT>(p.tail, row);
    return;  // a padding row's cluster holds padding rows only (the token rows come first, whole clusters)
  }
  const int nv = p.tail.h / kVecElems;
  if constexpr (VPT == 1) {
    if (split > 1) {
      cluster_arrive();
      const int per = p.slice;  // slice_vectors(nv, split), from the host: no division before the first load
      const int first = static_cast<int>(cluster_rank()) * per;
      const int n = max(0, min(nv - first, per));  // a CTA past the row's end takes part in the sums only
      const int v = first + static_cast<int>(threadIdx.x);
      const bool mine = static_cast<int>(threadIdx.x) < n;
      const size_t row_base = static_cast<size_t>(row) * p.tail.h;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      const uint4 x = mine ? reinterpret_cast<const uint4*>(static_cast<const T*>(p.tail.residual_in) + row_base)[v]
                           : zero;
      const uint4 w = mine ? __ldg(reinterpret_cast<const uint4*>(p.tail.weight) + v) : zero;
      const uint4 a = mine ? combine_vec<T, FORM, K, kGuess>(p.combine, row, v, guess) : zero;
      float sumsq = 0.f;
      const uint4 y = norm_input<T, false>(p.tail, a, x, sumsq);
      if (mine) reinterpret_cast<uint4*>(static_cast<T*>(p.tail.residual_out) + row_base)[v] = y;
      sumsq = block_sum<false>(sumsq, red);  // red is not written again
      cluster_wait();  // every CTA runs: their shared memory may take the stores
      const float inv = inv_rms(cluster_reduce<kClusterSum>(sumsq, [](float s, float t) { return s + t; }), p.tail);
      const uint4 normed[1] = {norm_round<T>(y, w, inv, p.tail.weight_offset)};
      emit_slice<T, QUANT, 1>(p.tail, row, normed, quant_scalar<QUANT>(p.tail), first, n);
      return;
    }
  }
  if constexpr (VPT > 0) {
    // VPT 1 (the few-rows variant up to h = 8192): the residual's and weight's loads go first, in flight
    // during the combine's. Not for VPT 2 and 4: under their 64-register bounds the row held through the
    // combine's chunk would spill.
    uint4 x[VPT], w[VPT];
    if constexpr (VPT == 1) tail_load<T, VPT>(p.tail, row, x, w);
    uint4 av[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      av[i] = v < nv ? combine_vec<T, FORM, K, kGuess>(p.combine, row, v, guess) : make_uint4(0, 0, 0, 0);
    }
    if constexpr (VPT != 1) tail_load<T, VPT>(p.tail, row, x, w);
    tail_row<T, QUANT, VPT, false>(p.tail, row, av, x, w, quant_scalar<QUANT>(p.tail), red);
  } else {
    tail_row_looped<T, QUANT, kLoopVectors, false>(
        p.tail, row, [&p, row](int v) { return combine_vec<T, FORM, K>(p.combine, row, v); },
        quant_scalar<QUANT>(p.tail), red);
  }
}

}  // namespace commfuse
