// The MoE combine of one vector of 8 elements (docs/semantics.md section 14), shared by the combine
// kernel (moe_combine.cu), the fused MoE tail (fused_tail.cu's moe_tail) and the P2P all-reduce's MoE
// variants (p2p_allreduce.cu, which combine each rank's rows as they read them):
// acc = float(shared) or +0.0, then for each kept slot j in order acc = RN(acc + RN(w_j * y_j)), with
// __fmul_rn / __fadd_rn, which the compiler may not contract into an FMA (one rounding, not two).
#pragma once

#include "epilogue.cuh"

namespace commfuse {

constexpr int kCombineNone = -1;        // no combine: a kernel's input is x itself (p2p_allreduce.cu)
constexpr int kCombineReduction = 0;    // y [t, k, h]
constexpr int kCombineFinalize32 = 1;   // y = rows [R, h], row_index int32 [t, k]
constexpr int kCombineFinalize64 = 2;   // row_index int64

// The callers' weights and indices are read as given (T weights and int64 indices converted on the host
// cost up to three more kernels a call). The index type is the form's, a template parameter (read through
// a branch on a field, the finalize form's cluster-split tail measured ~4% slower on an H200); the weights'
// type is a field (MoeCombineParams::weights_f32, one branch a chunk: level in the reduction form).

// The slots go in chunks whose index, weight and row loads are all issued before the first sum: two memory
// latencies a chunk (the indices, then the rows) instead of one or two a slot. The compiler issues a chunk's loads
// only after the chunk before it is summed (the branch on the weights' type between them), so a chunk is a round
// trip to memory. For any k, kCombineChunk (4), not 8: on an H200, chunks of 8 measured 7-10% slower at 1024
// tokens (k = 2 and 8) and no faster at 1-64 (more registers, the unused slots' predicates). A variant built for one
// k (K <= kSlotChunk) takes the token's slots in one chunk: no predicates, and at few tokens, where a row's time
// is its chain of round trips, k 8 is one round trip for its rows, not two.
constexpr int kCombineChunk = 4;
constexpr int kSlotChunk = 8;
template <int K>
constexpr int kChunk = K > 0 && K <= kSlotChunk ? K : kCombineChunk;

template <int FORM>
struct RowIndex {
  using type = long long;  // kCombineFinalize64
};
template <>
struct RowIndex<kCombineFinalize32> {
  using type = int;
};

// The rows of slots j0 .. j0 + N - 1 of the token whose first slot is slot0: -1 past k or
// for a dropped slot (its step is left out, its row not read); an index outside [-1, rows) sets `bad`.
template <int FORM, int N>
__device__ __forceinline__ void chunk_rows(const MoeCombineParams& p, int k, size_t slot0, int j0, long long (&r)[N],
                                           bool& bad) {
  if constexpr (FORM == kCombineReduction) {
#pragma unroll
    for (int c = 0; c < N; ++c) r[c] = j0 + c < k ? static_cast<long long>(slot0 + j0 + c) : -1;
  } else {
    const auto* index = static_cast<const typename RowIndex<FORM>::type*>(p.row_index) + slot0 + j0;
#pragma unroll
    for (int c = 0; c < N; ++c) r[c] = j0 + c < k ? static_cast<long long>(index[c]) : -1;
#pragma unroll
    for (int c = 0; c < N; ++c) {
      bad |= r[c] < -1 || r[c] >= p.rows;
      if (r[c] >= p.rows) r[c] = -1;
    }
  }
}

// The routing weights of the chunk's kept slots as float32 (a T weight converted exactly), 0 elsewhere: one branch
// on the weights' type a chunk. Kept: with EVERY (a variant built for k, or a guessed chunk) every slot before k
// (n from the chunk's first; a dropped slot's weight is read and not used), loads that wait for nothing; else a slot
// with a row (r >= 0), whose weight load waits for the row index.
template <typename T, bool EVERY, int N, typename Row>
__device__ __forceinline__ void chunk_weights(const MoeCombineParams& p, size_t first, int n, const Row (&r)[N],
                                              float (&w)[N]) {
  if (p.weights_f32) {
    const float* weights = static_cast<const float*>(p.weights) + first;
#pragma unroll
    for (int c = 0; c < N; ++c) w[c] = (EVERY ? c < n : r[c] >= 0) ? weights[c] : 0.0f;
  } else {
    const unsigned short* weights = static_cast<const unsigned short*>(p.weights) + first;
#pragma unroll
    for (int c = 0; c < N; ++c) w[c] = (EVERY ? c < n : r[c] >= 0) ? Pack<T>::from_bits(weights[c]) : 0.0f;
  }
}

// The finalize form's row indices of token `row`'s first chunk of slots (kChunk<K>: all K of a variant built for K,
// the first kCombineChunk for any k) read before pdl_wait (the kernel before may still be writing them), through L2
// only (ld.global.cg: no L1 line that a read after the wait could hit), checked there: -1 where outside [0, rows) or
// past k, so that every guess is a row of y or none. combine_vec loads the guessed rows as soon as the wait is over,
// with the indices themselves, and only if an index differs from its guess checks the indices and loads their rows
// again: the rows wait for no index (one memory round trip fewer at few tokens, and the range checks off the chain
// of dependent instructions), and a guess that the kernel before made stale costs time, not bits.
template <int FORM, int K>
__device__ __forceinline__ void guess_rows(const MoeCombineParams& p, int row, int (&g)[kChunk<K>]) {
  const int k = K > 0 ? K : p.k;
  const auto* index = static_cast<const typename RowIndex<FORM>::type*>(p.row_index) + static_cast<size_t>(row) * k;
#pragma unroll
  for (int c = 0; c < kChunk<K>; ++c) {
    const long long r = K > 0 || c < k ? static_cast<long long>(__ldcg(index + c)) : -1;
    g[c] = r >= 0 && r < p.rows ? static_cast<int>(r) : -1;
  }
}

// The guessed chunk's rows and indices: for a variant built for k long long (int measured 3-7% slower at 1-16 tokens,
// k 8, H100); for any k the rows int (a row index is < 2^31, moe_combine.index_limits) and the indices as read: with
// long long rows those variants spilled 8-28 bytes under the 64 registers of 1024 threads; with int only fp8_block's
// int32 ones spill, 4 bytes (in the cluster-split path: one store before the combine, one load after the sum).
template <int FORM, int K>
struct Guessed {
  using row = long long;
  using given = long long;
};
template <int FORM>
struct Guessed<FORM, 0> {
  using row = int;
  using given = typename RowIndex<FORM>::type;
};

// Vector v of row r of y (row0: y's vector v of row 0; zero for r < 0): a kept row's vector is one 32 x 32 -> 64-bit
// multiply away (r < 2^31: moe_combine.index_limits), not a 64-bit product of the element index.
__device__ __forceinline__ uint4 row_vector(const uint4* row0, unsigned row_vectors, long long r) {
  return r >= 0 ? row0[static_cast<size_t>(static_cast<unsigned>(r)) * row_vectors] : make_uint4(0, 0, 0, 0);
}

// acc += w_c * y_c over the chunk's kept slots (r >= 0), in slot order.
template <typename T, int N, typename Row>
__device__ __forceinline__ void add_chunk(float (&acc)[8], const Row (&r)[N], const float (&w)[N],
                                          const uint4 (&yv)[N]) {
#pragma unroll
  for (int c = 0; c < N; ++c) {
    if (r[c] < 0) continue;
    float y[8];
    unpack8<T>(yv[c], y);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w[c], y[e]));
  }
}

// The combined vector v of token `row`, rounded to T; NaN where the token has a row index outside
// [-1, rows) (that index's row is not read; nothing raises without a synchronisation; the reference
// raises ValueError). The sums stay in slot order.
// K: the slots a token (p.k) where the variant is built for one k, 0 for any. A known k unrolls the chunks and
// drops the slots past k at compile time (their predicates, selects and skipped steps): at few tokens a row is
// one chain of instructions at one or two warps a scheduler, so each one left out is time (commfuse/kernels/
// moe_tail.py's SLOTS). With K 0 `#pragma unroll` leaves the loop as it is (its trip count is not constant).
// GUESS (a finalize form): `guess` holds guess_rows' indices of the token's first chunk, which comes first; the
// chunks after it (for any k, past kCombineChunk slots) go as without a guess.
template <typename T, int FORM, int K = 0, bool GUESS = false>
__device__ __forceinline__ uint4 combine_vec(const MoeCombineParams& p, int row, int v, const int* guess = nullptr) {
  static_assert(!GUESS || FORM != kCombineReduction, "a guess is a finalize form's");
  constexpr int N = kChunk<K>;
  constexpr int G = GUESS ? N : 0;  // the slots guessed
  const int k = K > 0 ? K : p.k;
  const size_t slot0 = static_cast<size_t>(row) * k;
  // The shared expert's vector (or +0.0). For any k loaded and unpacked first (the variants for any k keep their
  // machine code: another order measured 1-2% slower at 1024 tokens); a variant built for k unpacks it at the first
  // sum (unpacked first, the k 8 reduction form spilled 16 bytes under a 64-register bound).
  float acc[8];
  uint4 shared = make_uint4(0, 0, 0, 0);
  if constexpr (K == 0) {
    if (p.shared != nullptr) {
      unpack8<T>(reinterpret_cast<const uint4*>(static_cast<const T*>(p.shared) + static_cast<size_t>(row) * p.h)[v], acc);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    }
  } else if (p.shared != nullptr) {
    shared = reinterpret_cast<const uint4*>(static_cast<const T*>(p.shared) + static_cast<size_t>(row) * p.h)[v];
  }
  bool bad = false;
  const uint4* row0 = static_cast<const uint4*>(p.y) + v;
  const unsigned row_vectors = static_cast<unsigned>(p.h) / kVecElems;
  using Row = typename Guessed<FORM, K>::row;
  using Given = typename Guessed<FORM, K>::given;
#pragma unroll
  for (int j0 = 0; j0 < G; j0 += N) {  // the guessed chunk: one pass (G = N), none without a guess
    // as a loop, with this break, the variants for any k compile to the code measured (bench/journal.md, session 56)
    if (K == 0 && j0 >= k) break;
    Row r[N];  // the rows read, -1 for none
    float w[N];
    uint4 yv[N];
    chunk_weights<T, true, N>(p, slot0 + j0, k - j0, r, w);  // r is not read
    const auto* index = static_cast<const typename RowIndex<FORM>::type*>(p.row_index) + slot0 + j0;
    Given given[N];
#pragma unroll
    for (int c = 0; c < N; ++c) {
      given[c] = K > 0 || j0 + c < k ? static_cast<Given>(index[c]) : Given(-1);
      r[c] = guess[j0 + c];
      yv[c] = row_vector(row0, row_vectors, r[c]);
    }
    bool stale = false;
#pragma unroll
    for (int c = 0; c < N; ++c) stale |= given[c] != r[c];
    if (stale) {  // the kernel before wrote the index after the guess: the index's rows, checked as chunk_rows does
#pragma unroll
      for (int c = 0; c < N; ++c) {
        bad |= given[c] < -1 || given[c] >= p.rows;
        // for any k an int64 index below -1 must not be cast to an int row
        const Row q = K == 0 ? (given[c] < 0 || given[c] >= p.rows ? Row(-1) : static_cast<Row>(given[c]))
                             : (given[c] >= p.rows ? Row(-1) : static_cast<Row>(given[c]));
        if (q != r[c]) {
          r[c] = q;
          yv[c] = row_vector(row0, row_vectors, q);
        }
      }
    }
    if (K > 0) unpack8<T>(shared, acc);
    add_chunk<T, N>(acc, r, w, yv);
  }
  // The bound spelled out rather than `k`: with `k` the looped any-k variant compiled to other code (sm_90).
#pragma unroll
  for (int j0 = G; j0 < (K > 0 ? K : p.k); j0 += N) {
    long long r[N];
    float w[N];
    uint4 yv[N];
    chunk_rows<FORM, N>(p, k, slot0, j0, r, bad);
    chunk_weights<T, (K > 0), N>(p, slot0 + j0, k - j0, r, w);
#pragma unroll
    for (int c = 0; c < N; ++c) yv[c] = row_vector(row0, row_vectors, r[c]);
    if (K > 0 && j0 == 0) unpack8<T>(shared, acc);
    add_chunk<T, N>(acc, r, w, yv);
  }
  if (bad) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __int_as_float(0x7fffffff);
  }
  return make_uint4(Pack<T>::pack(acc[0], acc[1]), Pack<T>::pack(acc[2], acc[3]), Pack<T>::pack(acc[4], acc[5]),
                    Pack<T>::pack(acc[6], acc[7]));
}

}  // namespace commfuse
