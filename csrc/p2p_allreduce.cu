// P2P all-reduce over CUDA IPC buffers, with the all-reduce tail (epilogue.cuh) in the same kernel.
//
// Every rank owns one workspace buffer that every other rank has mapped (commfuse/p2p/workspace.py builds it,
// and its docstring describes the layout and the host side). Ranks PUSH their data into the peers'
// buffers over NVLink (remote stores are posted writes) and READ only their own buffer.
//
// Algorithms (ALGO), per CTA b of a fixed grid of NBLOCKS CTAs (the same on every rank), which owns
// the rows r with r % NBLOCKS == b:
// - one-shot (Lamport): the Lamport region of every buffer is all ones (kEmptyWord) when no call
//   is using it. Each rank pushes its rows, encoded so that no word is empty, into slot[rank] of
//   every peer's Lamport half; then it reads its own slots vector by vector, re-reading a vector
//   until none of its words is empty (the data itself says it has arrived: no flag, no fence, no
//   barrier), sums them with its own x in rank order in fp32, rounds to T once, resets what it
//   read to empty, and runs the tail (or stores the plain sum). Messages up to lamport_bytes.
// - two-shot: rows are split into `world` contiguous segments, segment q owned by rank q. Phase 0
//   pushes each row to its owner's slot[rank]; barrier 0; phase 1 sums the own segment's rows in
//   rank order, rounds to T and pushes the T row into every rank's gather region; barrier 1;
//   phase 2 runs the tail (or copies the plain sum out) for all rows from the local gather region.
// Both sum in rank order in fp32 and round once, so every rank gets bit-identical results, equal to
// reference.all_reduce_sum.
//
// Two-shot barriers are per CTA and cross-rank: CTA b signals phase k of call `epoch` by writing
// `epoch` into flags[k][b][rank] of every peer, and waits until its own flags[k][b][q] reach
// `epoch` for every q. Epochs live in device memory (epochs[b], bumped by the kernel, by both
// algorithms), so a CUDA graph replays correctly: nothing per call is baked into the launch. Epochs and
// flags are 64-bit: a flag keeps the last two-shot call's epoch through any number of one-shot calls.
//
// Why two halves (half = epoch & 1) make a buffer safe to reuse, for both algorithms and any mix
// of them: only the owner of a buffer ever READS it (pushes are remote writes, reads are local),
// and a rank's kernel of call E cannot complete before it has received something every peer's
// kernel of call E sent (one-shot: CTA 0's row 0 holds data of every rank; two-shot: every CTA's
// barriers wait for every peer). So when rank r's kernel of call E writes half (E & 1) of rank q's
// buffer, r's kernel E - 1 has completed (calls on one communicator are stream-ordered on every
// rank), hence q's kernel E - 1 had started, hence q's kernel E - 2 - the last one that read or
// reset that half, by ANY of its CTAs - had completed. Within a call, the rows a CTA reads are
// exactly the rows the same-numbered CTAs of all ranks wrote (rows are assigned by r % NBLOCKS on
// every rank), and distinct CTAs touch disjoint rows. Every CTA takes part in every call (even with
// no rows), so all CTAs of a rank agree on the epoch, hence on the half. Two-shot's gather region
// is written in phase 1 of call E, only after barrier 0 of call E, and read in phase 2 of call E
// (after barrier 1); its previous reader was call E - 2: covered by the argument above. A Lamport
// half is back to empty when the kernel that read it completes (it resets every word it read, and
// nobody else writes there until call E + 2), so the next user finds it empty.
//
// Memory ordering (PTX memory model). Two-shot: data stores, then __syncthreads() (bar.sync:
// CTA-scope synchronisation), then thread q does st.release.sys of the flag to peer q. Release is
// cumulative, so the other threads' stores ordered before it by the barrier are visible to whoever
// acquires the flag. The waiting thread reads its flag with ld.acquire.sys, then __syncthreads()
// orders the CTA's subsequent reads after the acquire. Two-shot workspace reads use ld.global.cg
// (L2, which is where NVLink writes to this GPU land) so no stale L1 line can be read even across
// calls. One-shot: a Lamport vector is read only by the thread that waits for it, with volatile
// loads (never cached in L1, never hoisted out of the loop); it is valid once its four 32-bit words
// are non-empty, since each word is written by one store of one peer (a 16-byte store may arrive
// in pieces, a word does not). The reset is a volatile store after the volatile loads of the same
// address in the same thread, so it lands after them.
//
// Bounded waits: a waiting thread gives up after p.timeout_ns (read from %globaltimer), records
// (1 << 16) | (phase << 8) | missing_rank in the device error word (atomicCAS from 0: the first
// cause wins) and, if it won, in the host-mapped error word the host polls. A two-shot CTA then
// returns without writing its outputs; a one-shot thread stops waiting (for the rest of the call)
// and finishes with undefined outputs. Either way the host raises P2PTimeoutError. A peer whose
// call signature differs (see "call signatures") is recorded the same way with code
// (2 << 16) | rank and both signatures, and the host raises P2PMismatchError. A kernel that finds
// the device error word already set returns at once: after a timeout or a mismatch the flags,
// epochs and Lamport slots are no longer in step, so later launches (e.g. CUDA graph replays) must
// not run.
//
// Early loads: the tail's residual, weight and scale (RowTail::prefetch) are loaded before the
// wait for the peers' data (one-shot) or before the barrier that precedes the rows' sums
// (two-shot), so their latency hides behind the NVLink round trip, and the one-shot loads its
// first row of x before the start-up sync (overlapping the epoch's load). All are inputs of this
// rank's own call (ordered before the kernel by the stream, or by pdl_wait under programmatic
// dependent launch; never written by a peer or by this kernel), so no ordering with the peers is
// needed and the argument above is untouched: the workspace is still written only after the
// start-up sync has fixed the epoch. A CTA's later rows are brought into L2 one row ahead
// (RowTail::prefetch_next): the residual, and in the two-shot's phase 2 the gathered sums, which
// peers wrote; that prefetch is issued after barrier 1's acquire, and it is only a hint that moves
// lines into L2, where the peers' NVLink writes land, so it cannot make a read see older data.
//
// Co-residency: NBLOCKS <= the SM count and __launch_bounds__(kP2PThreads<QUANT, VPT, ALGO, COMBINE>, 1) make
// every CTA fit at once, one CTA per SM: 256 threads, or for the 1- and 2-vector register tails and
// the plain one-shot up to 1024 threads, for which the bound caps registers at 64 per thread
// (65536 / 1024: a whole SM's register file; the build is checked for no spills with ptxas -v),
// and shared memory is < 200 B. CTA b waits for CTA b of the peers only, never for another CTA of its own rank; the
// bounded wait turns any remaining scheduling surprise (e.g. another stream's kernel holding SMs)
// into an error instead of a hang.
#include "epilogue.cuh"
#include "moe.cuh"
#include "pdl.cuh"

namespace commfuse {

constexpr int kCopyUnroll = 4;   // vectors per thread in flight in the copy loops (plain, looped tail)
constexpr int kAlgoOneshot = 0;
constexpr int kAlgoTwoshot = 1;
// Threads per CTA at most (the __launch_bounds__) per variant: the register tails of 1 and 2
// vectors per thread and the plain one-shot run up to 1024 threads (decode rows spread over 32
// warps; the plain one-shot's vectors each awaited by their own thread), which caps them at 64
// registers; the plain two-shot and the looped tail run 256 threads. The MoE variants' register
// tails run up to kMoeThreads: the combine's chunk of row loads in flight does not fit 64 registers
// next to the tail's (ptxas spilled 4-136 bytes in most of them at 1024), it fits 128.
constexpr int kMoeThreads = 512;
template <int QUANT, int VPT, int ALGO, int COMBINE = kCombineNone>
constexpr int kP2PThreads = COMBINE != kCombineNone && (VPT == 1 || VPT == 2) ? kMoeThreads
                            : (QUANT != kQuantPlain && (VPT == 1 || VPT == 2)) ||
                                      (QUANT == kQuantPlain && ALGO == kAlgoOneshot) ? 1024 : 256;
// Ranks whose loads the two-shot's sum_ranks issues at once (see there): fewer in the 64-register
// variants.
template <int QUANT, int VPT>
constexpr int kSumBatch = kP2PThreads<QUANT, VPT, kAlgoTwoshot> > 256 ? (VPT == 1 ? 4 : 2) : kMaxWorld;
// Ranks whose Lamport loads a one-shot register tail has in flight together: 64 registers (1024
// threads) hold the prefetched tail inputs and 2 vectors' loads (a load holds its registers until the
// vector arrived and was added in rank order), so VPT 1 waits 2 ranks at a time, VPT 2 one rank
// at a time for each of its vectors in turn.
template <int VPT>
constexpr int kLamportBatch = VPT == 1 ? 2 : 1;
// Ranks whose loads the plain one-shot's sum has in flight together (what 64 registers hold next
// to the push's 4 vectors in flight).
constexpr int kPlainSumBatch = 4;
// Vectors per thread per step of the copy loops: a register tail's rows have at most
// VPT * blockDim.x vectors, so VPT covers them in one step (and keeps the 64-register variants
// from spilling); the others take kCopyUnroll.
template <int VPT>
constexpr int kCopyStep = VPT > 0 ? VPT : kCopyUnroll;

// The kernel's only parameter is P2PParams (TailParams, then the all-reduce's own fields), declared
// in commfuse/kernels/params.py, which generates its C declaration (commfuse_params.cuh, via epilogue.cuh)
// and packs it on the host.
static_assert(sizeof(P2PParams::peers) / sizeof(void*) == kMaxWorld, "peers[] holds kMaxWorld ranks");

// ------------------------------------------------------------------ memory-model primitives

__device__ __forceinline__ void st_release_sys(unsigned long long* addr, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* addr) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

// Weak loads could be served from a stale L1 line while a peer's store is on its way, and the
// compiler could merge or hoist them out of a polling loop: the Lamport slots are read volatile.
// The stores that reset a slot are volatile too, so they stay after the loads of the same address.
__device__ __forceinline__ uint4 ld_volatile(const uint4* addr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr));
  return v;
}

__device__ __forceinline__ void st_volatile(uint4* addr, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ------------------------------------------------------------------ workspace addressing

// Half (epoch & 1) of rank r's buffer: `world` slots of slot_bytes, then the gather region.
__device__ __forceinline__ char* half_base(const P2PParams& p, int r, unsigned epoch) {
  return static_cast<char*>(p.peers[r]) +
         static_cast<unsigned long long>(epoch & 1u) * static_cast<unsigned long long>(p.world + 1) * p.slot_bytes;
}

__device__ __forceinline__ uint4* slot(const P2PParams& p, int r, int s, unsigned epoch) {
  return reinterpret_cast<uint4*>(half_base(p, r, epoch) + static_cast<unsigned long long>(s) * p.slot_bytes);
}

__device__ __forceinline__ uint4* gather(const P2PParams& p, int r, unsigned epoch) {
  return slot(p, r, p.world, epoch);
}

// Lamport slot s (rank s's data) of half (epoch & 1) of rank r's one-shot region.
__device__ __forceinline__ uint4* lamport_slot(const P2PParams& p, int r, int s, unsigned epoch) {
  return reinterpret_cast<uint4*>(static_cast<char*>(p.peers[r]) + p.lamport_offset +
                                  (static_cast<unsigned long long>(epoch & 1u) * p.world + s) * p.lamport_bytes);
}

// flags[phase][block][sender] of rank r's buffer.
__device__ __forceinline__ unsigned long long* flag(const P2PParams& p, int r, int phase, int block, int sender) {
  auto* flags = reinterpret_cast<unsigned long long*>(static_cast<char*>(p.peers[r]) + p.flags_offset);
  return flags + (static_cast<size_t>(phase) * gridDim.x + block) * p.world + sender;
}

// ------------------------------------------------------------------ errors

// Records a timeout: the first cause on this rank wins the device word, and only its winner
// writes the host word (so no atomic is needed on host memory).
__device__ __noinline__ void report_timeout(const P2PParams& p, int phase, int missing) {
  const int code = kTimeoutCode | (phase << 8) | missing;
  if (atomicCAS(p.dev_error, 0, code) == 0) {
    *p.host_error = code;
    __threadfence_system();
  }
}


// ------------------------------------------------------------------ call signatures
//
// Ranks that disagree on a call (dtype, shape, pattern, algorithm) would sum unrelated data, or
// wait for rows a peer never sends. So every CTA pushes a signature of its call to the same CTA of
// every peer at the start of each launch, beside the data, and checks the peers' ones while it
// waits for their data (one-shot) or for barrier 0 (two-shot): the signature travels with what the
// kernel sends anyway, so a matching call costs one 16-byte store per peer and one local load.
// Signature slots are Lamport slots (empty when unused, reset by their reader, halves alternating
// by epoch parity), so the double-buffering argument above covers them, and a mismatch is found
// even when the peer runs the other algorithm (it never releases the barrier flags).

// A Lamport word that holds no data yet (every signature word has bit 31 clear, so never this).
constexpr unsigned kEmptyWord = 0xFFFFFFFFu;

// Whether any word of v is still empty: 32-bit words are the unit a remote store is seen in, so
// a vector whose four words are all non-empty has fully arrived.
__device__ __forceinline__ bool lamport_empty(const uint4& v) {
  return (v.x == kEmptyWord) | (v.y == kEmptyWord) | (v.z == kEmptyWord) | (v.w == kEmptyWord);
}

template <typename T>
struct DtypeCode;
template <>
struct DtypeCode<__half> {
  static constexpr unsigned value = 0;
};
template <>
struct DtypeCode<__nv_bfloat16> {
  static constexpr unsigned value = 1;
};

// Word 0: 1 << 30 | dtype | (QUANT + 1) << 1 | ALGO << 5 | swizzled scale factors << 6 | norm
// output << 7 | world << 8 | fp8_block scale layout << 12; words 1-3: rows, row_vecs, total_vecs
// (low 31 bits). Decoded by commfuse/kernels/p2p_allreduce.py (describe_signature).
template <typename T, int QUANT, int ALGO>
__device__ __forceinline__ uint4 call_signature(const P2PParams& p) {
  constexpr bool kTail = QUANT != kQuantPlain;
  unsigned kind = (1u << 30) | DtypeCode<T>::value | static_cast<unsigned>(QUANT + 1) << 1 |
                  static_cast<unsigned>(ALGO) << 5 | (kTail && p.tail.sf_swizzled ? 1u << 6 : 0u) |
                  (kTail && p.tail.norm_out != nullptr ? 1u << 7 : 0u) | static_cast<unsigned>(p.world) << 8;
  if constexpr (QUANT == kQuantFp8Block) kind |= static_cast<unsigned>(p.tail.scale_layout) << 12;
  return make_uint4(kind, static_cast<unsigned>(p.rows), static_cast<unsigned>(p.row_vecs),
                    static_cast<unsigned>(p.total_vecs & 0x7fffffffLL));
}

// This CTA's signature slot for `sender` in half (epoch & 1) of rank r's buffer.
__device__ __forceinline__ uint4* sig_slot(const P2PParams& p, int r, int sender, unsigned epoch) {
  return reinterpret_cast<uint4*>(static_cast<char*>(p.peers[r]) + p.sig_offset) +
         (static_cast<size_t>(epoch & 1u) * p.world + sender) * gridDim.x + blockIdx.x;
}

// Threads 0 .. world-2 each push the signature to one peer.
template <typename T, int QUANT, int ALGO>
__device__ __forceinline__ void push_signature(const P2PParams& p, unsigned epoch) {
  if (static_cast<int>(threadIdx.x) < p.world - 1) {
    int q = p.rank + 1 + threadIdx.x;
    if (q >= p.world) q -= p.world;
    *sig_slot(p, q, p.rank, epoch) = call_signature<T, QUANT, ALGO>(p);
  }
}

// The check of peer q's signature of call `epoch` by thread q (q < world, q != rank) of the CTA,
// whose registers must not come out of the 64-register variants' budget: while the thread waits
// anyway (for Lamport data, or a barrier flag) it looks at one word, the signature's total_vecs,
// which settles the case that can stall (a peer sending fewer vectors than this rank waits for);
// at the end of the launch sig_settle compares the whole signature, out of line, and resets the slot.
__device__ __forceinline__ bool sig_owner(const P2PParams& p) {
  return static_cast<int>(threadIdx.x) < p.world && static_cast<int>(threadIdx.x) != p.rank;
}

__device__ __forceinline__ unsigned sig_size_word(const P2PParams& p, unsigned epoch) {
  return *reinterpret_cast<const volatile unsigned*>(&sig_slot(p, p.rank, threadIdx.x, epoch)->w);
}

// Records a mismatch with both signatures (host_error[4..7] the peer's, [8..11] this rank's,
// written before the code the host polls). It takes the error word from a timeout, which a
// mismatch can cause (a wait for data the peer never sends): the host then names the cause.
__device__ __noinline__ void report_mismatch(const P2PParams& p, const uint4 own, const uint4 theirs) {
  const int code = kMismatchCode | static_cast<int>(threadIdx.x);
  int seen = 0;
  int prev;
  while ((prev = atomicCAS(p.dev_error, seen, code)) != seen && (prev >> 16) == (kTimeoutCode >> 16)) seen = prev;
  if (prev == seen) {
    const unsigned words[8] = {theirs.x, theirs.y, theirs.z, theirs.w, own.x, own.y, own.z, own.w};
    for (int i = 0; i < 8; ++i) p.host_error[4 + i] = static_cast<int>(words[i]);
    __threadfence_system();
    *p.host_error = code;
    __threadfence_system();
  }
}

// Thread q's end of the check: waits (bounded) for the signature, compares all of it, and resets
// the slot for the next user of the half. False on a mismatch (reported) or a timeout.
template <typename T, int QUANT, int ALGO>
__device__ __noinline__ bool sig_settle(const P2PParams& p, unsigned epoch) {
  uint4* const src = sig_slot(p, p.rank, threadIdx.x, epoch);
  const unsigned long long start = global_timer_ns();
  uint4 v = ld_volatile(src);
  while (lamport_empty(v)) {
    if (global_timer_ns() - start > p.timeout_ns) {
      report_timeout(p, 0, threadIdx.x);
      return false;
    }
    v = ld_volatile(src);
  }
  st_volatile(src, make_uint4(kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord));
  const uint4 own = call_signature<T, QUANT, ALGO>(p);
  if (v.x == own.x && v.y == own.y && v.z == own.z && v.w == own.w) return true;
  report_mismatch(p, own, v);
  return false;
}

// ------------------------------------------------------------------ barrier

// Cross-rank barrier of this CTA for `phase` of call `epoch`; every thread calls it. Returns false
// (the same in every thread) when a peer did not arrive within the timeout or, in phase 0, when a
// peer's call signature differs (checked while waiting, so a peer running the other algorithm,
// which never releases this flag, is named at once).
template <typename T, int QUANT, int ALGO>
__device__ __forceinline__ bool barrier(const P2PParams& p, int phase, unsigned long long epoch, int* s_fail) {
  __syncthreads();  // every store of this CTA for this phase is issued before the release below
  const int q = threadIdx.x;
  if (q < p.world && q != p.rank) {
    st_release_sys(flag(p, q, phase, blockIdx.x, p.rank), epoch);
    const unsigned long long* mine = flag(p, p.rank, phase, blockIdx.x, q);
    const unsigned long long start = global_timer_ns();
    const unsigned half_epoch = static_cast<unsigned>(epoch);  // what the signature slots take: its parity
    // ">=" as a signed difference: robust should a peer ever be ahead. (It cannot be: it would first have
    // to pass this very barrier, which needs this CTA's flag.) 64 bits, because only two-shot calls write
    // the flags while every call advances the epoch: after 2^31 one-shot calls a 32-bit difference from
    // the last two-shot call's flag would read as "arrived" and the barrier would not wait.
    bool ok = true, sig_done = phase != 0;
    while (static_cast<long long>(ld_acquire_sys(mine) - epoch) < 0) {
      // A peer of the other algorithm never releases this flag, but its signature comes: check it
      // as soon as it is there, and go on waiting for the flag when it matches.
      if (!sig_done && sig_size_word(p, half_epoch) != kEmptyWord) {
        sig_done = true;
        if (!sig_settle<T, QUANT, ALGO>(p, half_epoch)) {
          ok = false;
          break;
        }
      }
      if (global_timer_ns() - start > p.timeout_ns) {
        report_timeout(p, phase, q);
        ok = false;
        break;
      }
    }
    // The flag's acquire made the peer's signature visible: it was stored before the release.
    if (!ok || (!sig_done && !sig_settle<T, QUANT, ALGO>(p, half_epoch))) *s_fail = 1;
  }
  __syncthreads();
  return *s_fail == 0;
}

// ------------------------------------------------------------------ row helpers

// First row r >= lo with r % n == b.
__device__ __forceinline__ int first_row(int lo, int b, int n) { return lo + (b + n - lo % n) % n; }

// First row of rank q's two-shot segment: rows are split into `world` contiguous segments.
__device__ __forceinline__ int segment_begin(const P2PParams& p, int q) {
  return static_cast<int>(static_cast<long long>(p.rows) * q / p.world);
}

__device__ __forceinline__ int segment_owner(const P2PParams& p, int r) {
  int q = 0;
  while (q + 1 < p.world && segment_begin(p, q + 1) <= r) ++q;
  return q;
}

// The d-th destination of a push to every rank: the peers starting after this rank, this rank
// last, so that the ranks do not all write to the same peer at once.
__device__ __forceinline__ int peer_order(const P2PParams& p, int d) {
  const int q = p.rank + 1 + d;
  return q < p.world ? q : q - p.world;
}

__device__ __forceinline__ long long row_first_vec(const P2PParams& p, int r) {
  return static_cast<long long>(r) * p.row_vecs;
}

// Vectors in row r (only a plain all-reduce's last row can be short).
__device__ __forceinline__ int row_len(const P2PParams& p, int r) {
  const long long left = p.total_vecs - row_first_vec(p, r);
  return left < p.row_vecs ? static_cast<int>(left) : p.row_vecs;
}

// The `world` sources of a row: slot s of this rank's half, from vector `first` on. One base
// pointer and the slot stride (not kMaxWorld pointers): fewer registers for the 1024-thread tails.
struct RankRows {
  const char* base;         // slot 0's vector `first`
  unsigned long long step;  // slot_bytes
  int world;
};

__device__ __forceinline__ RankRows rank_rows(const P2PParams& p, unsigned epoch, long long first) {
  return RankRows{reinterpret_cast<const char*>(slot(p, p.rank, 0, epoch) + first), p.slot_bytes, p.world};
}

// The rank-order fp32 sum of reference.all_reduce_sum, one rank's vector at a time (s = 0, 1, ...;
// s >= world adds nothing): rank 0's starts it (which keeps a -0.0 there), the others are added in
// rank order; round_sum rounds to T once.
template <typename T>
__device__ __forceinline__ void add_rank(float (&acc)[8], const uint4& v, int s, int world) {
  if (s == 0) {
    unpack8<T>(v, acc);
  } else if (s < world) {
    float f[8];
    unpack8<T>(v, f);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = __fadd_rn(acc[k], f[k]);
  }
}

template <typename T>
__device__ __forceinline__ uint4 round_sum(const float (&acc)[8]) {
  return make_uint4(Pack<T>::pack(acc[0], acc[1]), Pack<T>::pack(acc[2], acc[3]), Pack<T>::pack(acc[4], acc[5]),
                    Pack<T>::pack(acc[6], acc[7]));
}

// Sum of vector i of the `world` sources in rank order, in fp32, rounded to T once (add_rank).
// The loads go out BATCH ranks at a time, all of a batch in flight together: BATCH = kMaxWorld
// (one round trip for any world) where registers allow; in the 64-register 1024-thread variants
// 4 for VPT 1 and 2 for VPT 2 (kSumBatch: one round trip up to 4 or 2 ranks). The additions are in
// rank order either way.
template <typename T, int BATCH = kMaxWorld>
__device__ __forceinline__ uint4 sum_ranks(const RankRows& src, int i) {
  static_assert(BATCH > 0 && kMaxWorld % BATCH == 0, "whole batches");
  const int world = src.world;
  float acc[8];
#pragma unroll
  for (int s0 = 0; s0 < kMaxWorld; s0 += BATCH) {
    if (s0 < world) {  // uniform: world is a kernel parameter
      uint4 raw[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        if (s0 + j < world) raw[j] = __ldcg(reinterpret_cast<const uint4*>(src.base + (s0 + j) * src.step) + i);
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        add_rank<T>(acc, raw[j], s0 + j, world);
      }
    }
  }
  return round_sum<T>(acc);
}

// ------------------------------------------------------------------ Lamport one-shot

// kEmptyWord (defined above, with the call signatures) marks Lamport data not yet arrived. Pushed
// data never holds it: it is a pair of NaNs (0xFFFF is NaN in fp16 and bf16), which lamport_encode
// replaces by another NaN pair. The sum of a NaN is NaN whatever its bits, and every rank sums the
// same encoded values, so the results keep their semantics and stay bit-identical across ranks.
constexpr unsigned kNaNPair = 0x7FFF7FFFu;

__device__ __forceinline__ unsigned lamport_word(unsigned w) { return w == kEmptyWord ? kNaNPair : w; }

__device__ __forceinline__ uint4 lamport_encode(const uint4& v) {
  return make_uint4(lamport_word(v.x), lamport_word(v.y), lamport_word(v.z), lamport_word(v.w));
}

// One thread's bounded wait for Lamport data, over all the vectors it waits for in a call: the
// clock starts at its first unfinished vector, and once it gave up it waits no more (so a dead
// peer costs one timeout, not one per vector). While it spins it also watches the CTA's failure
// flag and, in the thread owning a peer's signature check, that signature's size word, so a
// mismatched call whose data never comes ends the wait at once instead of at the timeout.
// kWatch = false: the size word is not watched (the 2-vector register tails and the plain one-shot
// have no registers for it): there a peer sending fewer vectors shows as a timeout first, which sig_settle at the end of
// the launch then turns into the mismatch it was.
template <bool kWatch>
struct LamportWait {
  int* s_fail;
  unsigned epoch;
  bool size_open;  // this thread's peer signature's size not yet seen
  unsigned long long start = 0;
  bool failed = false;

  __device__ __forceinline__ LamportWait(const P2PParams& p, unsigned e, int* fail)
      : s_fail(fail), epoch(e), size_open(sig_owner(p)) {}

  // Whether the peer's size word (once it came) disagrees with this call's; raises s_fail then.
  __device__ __forceinline__ bool size_differs(const P2PParams& p) {
    const unsigned w = sig_size_word(p, epoch);
    if (w == kEmptyWord) return false;
    size_open = false;
    if (w == static_cast<unsigned>(p.total_vecs & 0x7fffffffLL)) return false;
    *static_cast<volatile int*>(s_fail) = 1;
    return true;
  }

  // v: a first load of *src (a vector of rank s's data). Re-reads until it has arrived; on timeout
  // records rank s as missing and returns what it read (the host raises; outputs are undefined).
  __device__ __forceinline__ uint4 until_full(const P2PParams& p, const uint4* src, uint4 v, int s) {
    while (lamport_empty(v) && !failed) {
      if (*static_cast<volatile int*>(s_fail) || (kWatch && size_open && size_differs(p))) {
        failed = true;
        break;
      }
      const unsigned long long now = global_timer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > p.timeout_ns) {
        report_timeout(p, 0, s);
        *static_cast<volatile int*>(s_fail) = 1;
        failed = true;
        break;
      }
      v = ld_volatile(src);
    }
    return v;
  }

  // Before a __syncthreads: the size check must not wait behind threads stuck on data that a
  // mismatched peer never sends. Usually done already, while this thread waited for its data.
  __device__ __forceinline__ void settle_size(const P2PParams& p) {
    const unsigned long long t0 = global_timer_ns();
    while (size_open && !failed && !size_differs(p) && size_open) {
      if (*static_cast<volatile int*>(s_fail) || global_timer_ns() - t0 > p.timeout_ns) break;
    }
  }
};

// The one-shot sum of vector i of a row: `own` is this rank's (encoded) value, the peers' are read
// from inbox (slot 0 of this rank's Lamport half at the row's first vector), BATCH ranks at a time
// with all of a batch's loads in flight together, each awaited until it arrived and then reset to
// empty for the call that uses this half next. Returns the rank-order sum (add_rank), rounded to T.
template <typename T, int BATCH, typename Wait>
__device__ __forceinline__ uint4 lamport_sum(const P2PParams& p, uint4* inbox, int i, const uint4& own, Wait& wait) {
  static_assert(BATCH > 0 && kMaxWorld % BATCH == 0, "whole batches");
  const uint4 empty = make_uint4(kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord);
  const auto src = [&p, inbox, i](int s) {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(inbox) + s * p.lamport_bytes) + i;
  };
  float acc[8];
#pragma unroll 1  // batches one after the other: unrolled, their addresses would be hoisted into registers
  for (int s0 = 0; s0 < kMaxWorld; s0 += BATCH) {
    if (s0 < p.world) {  // uniform: world is a kernel parameter
      uint4 raw[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int s = s0 + j;
        raw[j] = s < p.world && s != p.rank ? ld_volatile(src(s)) : own;
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int s = s0 + j;
        if (s < p.world && s != p.rank) {
          raw[j] = wait.until_full(p, src(s), raw[j], s);
          st_volatile(src(s), empty);
        }
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        add_rank<T>(acc, raw[j], s0 + j, p.world);
      }
    }
  }
  return round_sum<T>(acc);
}

// dst(d)[i] = src(i) for i in [0, n) and d in [0, ndst): UNROLL loads per thread in flight,
// then the stores (remote stores are posted: they do not stall the thread). The loop over
// destinations is not unrolled: it keeps the code small, and stores need no latency hiding.
template <int UNROLL, typename Src, typename Dst>
__device__ __forceinline__ void copy_row(int n, Src src, Dst dst, int ndst) {
  for (int base = threadIdx.x; base < n; base += UNROLL * blockDim.x) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * blockDim.x;
      if (i < n) v[u] = src(i);
    }
#pragma unroll 1
    for (int d = 0; d < ndst; ++d) {
      uint4* const row = dst(d);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + u * blockDim.x;
        if (i < n) row[i] = v[u];
      }
    }
  }
}

// dst(d)[i] = v[u] for i = threadIdx.x + u * blockDim.x < n and d in [0, ndst): copy_row's store
// half, for a row already in registers.
template <int N, typename Dst>
__device__ __forceinline__ void store_row(int n, const uint4 (&v)[N], Dst dst, int ndst) {
#pragma unroll 1
  for (int d = 0; d < ndst; ++d) {
    uint4* const row = dst(d);
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int i = threadIdx.x + u * blockDim.x;
      if (i < n) row[i] = v[u];
    }
  }
}

// Brings [p, p + bytes) into L2 without holding registers (prefetch.global.L2, one per 128-byte line,
// spread over the CTA's threads).
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
  const unsigned long long begin = reinterpret_cast<unsigned long long>(p) & ~127ull;
  const unsigned long long end = reinterpret_cast<unsigned long long>(p) + bytes;
  for (unsigned long long a = begin + 128ull * threadIdx.x; a < end; a += 128ull * blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
  }
}

// The tail's inputs that do not depend on the peers: the weight and the residual of the CTA's
// first row (register tails) and the quantizer's scalar. prefetch() is called before a cross-rank
// wait, so that the loads' HBM latency overlaps the NVLink round trip; emit() uses them for the
// row prefetched, and loads residual and weight itself for the CTA's later rows.
template <typename T, int QUANT, int VPT>
struct RowTail {
  static constexpr int kRegs = VPT > 0 ? VPT : 1;
  uint4 x[kRegs];  // residual of row `row` (VPT > 0)
  uint4 w[kRegs];  // weight (VPT > 0)
  float qs = 0.f;  // quant_scalar
  int row = -1;

  __device__ __forceinline__ void prefetch(const P2PParams& p, int r) {
    if constexpr (QUANT != kQuantPlain) {
      if (r >= p.rows) return;  // no rows for this CTA (the same in every thread)
      qs = quant_scalar<QUANT>(p.tail);
      if constexpr (VPT > 0) {
        tail_load_weight<T, VPT>(p.tail, w);
        tail_load_residual<T, VPT>(p.tail, r, x);
        row = r;
      }
    }
  }

  // A CTA's rows follow each other: its next row's residual (and `next_a`, the two-shot's sums of it)
  // goes to L2 while this row waits and runs its tail, instead of an HBM round trip on the critical
  // path after it.
  __device__ __forceinline__ void prefetch_next(const P2PParams& p, int next, const uint4* next_a = nullptr) {
    if constexpr (QUANT != kQuantPlain) {
      if (next >= p.rows) return;
      const long long bytes = static_cast<long long>(p.tail.h) * sizeof(T);
      prefetch_l2(static_cast<const T*>(p.tail.residual_in) + static_cast<size_t>(next) * p.tail.h, bytes);
      if (next_a != nullptr) prefetch_l2(next_a, bytes);
    }
  }

  // Register tails: residual and weight of row r, unless prefetched. For a CTA's later rows they
  // are issued before the sums' loads (the weight again, from L1/L2: holding it across the loop
  // spills in the 64-register variants).
  __device__ __forceinline__ void load(const P2PParams& p, int r) {
    if constexpr (VPT > 0 && QUANT != kQuantPlain) {
      if (r != row) {
        tail_load<T, VPT>(p.tail, r, x, w);
        row = r;
      }
    }
  }

  // Register tails: row r's tail, given its all-reduced values (zero past the row's end); load(r) first.
  __device__ __forceinline__ void emit_row(const P2PParams& p, int r, const uint4 (&a)[kRegs], float* red) {
    tail_row<T, QUANT, VPT>(p.tail, r, a, x, w, qs, red);
  }

  // Row r's all-reduced values `load_a(v)` -> outputs: the plain sum, or the tail of epilogue.cuh.
  template <typename LoadA>
  __device__ __forceinline__ void emit(const P2PParams& p, int r, LoadA load_a, float* red) {
    const long long first = row_first_vec(p, r);
    if constexpr (QUANT == kQuantPlain) {
      uint4* const out = static_cast<uint4*>(p.out) + first;
      copy_row<kCopyUnroll>(row_len(p, r), load_a, [out](int) { return out; }, 1);
    } else if constexpr (VPT > 0) {
      load(p, r);
      const int nv = p.row_vecs;
      uint4 a[VPT];
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        a[i] = v < nv ? load_a(v) : make_uint4(0, 0, 0, 0);
      }
      emit_row(p, r, a, red);
    } else {
      tail_row_looped<T, QUANT, kLoopVectors>(p.tail, r, load_a, qs, red);
    }
  }
};

// This CTA's share of the padding rows [rows, row_slots) (NVFP4 swizzled scale factors, MN-major
// FP8 block scales), whose scale storage must read 0. Every rank writes its own outputs, so every
// rank does this.
template <int QUANT>
__device__ __forceinline__ void zero_padding_rows(const P2PParams& p) {
  for (int r = first_row(p.rows, blockIdx.x, gridDim.x); r < p.row_slots; r += gridDim.x) tail_padding_row<QUANT>(p.tail, r);
}

// ------------------------------------------------------------------ the kernel

// T: __half or __nv_bfloat16. QUANT: kQuantPlain, or epilogue.cuh's kQuantNone/Fp8/Nvfp4/Fp8PerToken/Fp8Block.
// VPT: vectors per thread of the register tail (blockDim.x * VPT * 8 >= h), or 0 for the looped
// tail; 0 for plain. ALGO: kAlgoOneshot or kAlgoTwoshot. COMBINE: kCombineNone (the input is x), or
// the MoE combine's form, kCombineReduction or kCombineFinalize32 / 64 (moe.cuh; a tail only, one launch: row
// r is token r). Grid: the workspace's NBLOCKS CTAs.
template <typename T, int QUANT, int VPT, int ALGO, int COMBINE = kCombineNone>
__global__ void __launch_bounds__(kP2PThreads<QUANT, VPT, ALGO, COMBINE>, 1) p2p_allreduce(const __grid_constant__ P2PParams p) {
  static_assert(ALGO == kAlgoOneshot || ALGO == kAlgoTwoshot, "unknown algorithm");
  static_assert(COMBINE == kCombineNone || ((COMBINE == kCombineReduction || COMBINE == kCombineFinalize32 ||
                                             COMBINE == kCombineFinalize64) &&
                                            QUANT != kQuantPlain), "the MoE combine: a tail's input, two forms");
  static_assert(QUANT == kQuantPlain ? VPT == 0 : VPT == 0 || VPT == 1 || VPT == 2,
                "VPT: 0 for the plain all-reduce and the looped tail, 1 or 2 for the register tails");
  static_assert(kP2PThreads<QUANT, VPT, ALGO, COMBINE> <= 32 * kTailMaxWarps, "red[] has a slot per warp");
  __shared__ float red[kTailMaxWarps];
  __shared__ unsigned long long s_epoch;  // this call's number (p.epochs[b] + 1)
  __shared__ int s_fail;
  const int b = blockIdx.x;
  const int nb = gridDim.x;
  // Row r's input vector i (the row's first at `first`): x's, or with COMBINE the row's expert combine
  // (moe.cuh), computed as the kernel reads its input, so the combined rows never go through memory. The
  // combine is rank-local (before the sum): the protocol is unchanged, the combined vector is what x's
  // would have been. load_encoded: Lamport-encoded, as the one-shot sends it.
  const uint4* x = static_cast<const uint4*>(p.x);
  const auto load_x = [&p, x](int r, long long first) {
    if constexpr (COMBINE == kCombineNone) {
      return [x, first](int i) { return __ldg(x + first + i); };
    } else {
      return [&p, r](int i) { return combine_vec<T, COMBINE>(p.combine, r, i); };
    }
  };
  const auto load_encoded = [&load_x](int r, long long first) {
    return [in = load_x(r, first)](int i) { return lamport_encode(in(i)); };
  };
  pdl_wait();  // x, the epochs and the workspace may be the previous kernel's work
  pdl_launch_dependents();
  // One-shot: the first vector per thread of the CTA's first row of x (this call's input: nothing
  // orders it with the peers) is loaded before the start-up sync, so its latency overlaps the
  // epoch's load. That is the whole row for the 1-vector register tail, and for the plain
  // all-reduce's rows of up to blockDim.x vectors (messages of up to blockDim.x * 8 * 2 B per CTA,
  // where latency matters). Not for VPT 2: its 64 registers do not hold x0 next to the rest.
  constexpr bool kEarlyX = ALGO == kAlgoOneshot && (VPT == 1 || QUANT == kQuantPlain);
  uint4 x0[1];
  if constexpr (kEarlyX) {
    if (b < p.rows) {
      const int i = threadIdx.x;
      x0[0] = i < row_len(p, b) ? lamport_encode(load_x(b, row_first_vec(p, b))(i)) : make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x == 0) {
    s_fail = *static_cast<volatile int*>(p.dev_error) != 0;
    s_epoch = p.epochs[b] + 1;
  }
  __syncthreads();
  if (s_fail) return;  // an earlier timeout or mismatch broke the workspace: do nothing, the host raises
  // Its low word: the parity picks the buffers' half. The two-shot barriers take all 64 bits (s_epoch).
  const unsigned epoch = static_cast<unsigned>(s_epoch);
  push_signature<T, QUANT, ALGO>(p, epoch);

  if constexpr (ALGO == kAlgoOneshot) {
    // Push: this rank's rows, encoded, into slot[rank] of every peer's Lamport half (not its own:
    // its own values come from x).
    for (int r = b; r < p.rows; r += nb) {
      const long long first = row_first_vec(p, r);
      const int n = row_len(p, r);
      const auto dst = [&p, epoch, first](int d) { return lamport_slot(p, peer_order(p, d), p.rank, epoch) + first; };
      if constexpr (kEarlyX) {
        if (r == b && n <= static_cast<int>(blockDim.x)) {  // x0 holds the whole row
          store_row(n, x0, dst, p.world - 1);
          continue;
        }
      }
      copy_row<kCopyStep<VPT>>(n, load_encoded(r, first), dst, p.world - 1);
    }
    RowTail<T, QUANT, VPT> tail;
    tail.prefetch(p, b);  // this CTA's first row: in flight while the peers' data travels
    // Sum every rank's rows as their vectors arrive, and emit.
    LamportWait<VPT == 1 || (VPT == 0 && QUANT != kQuantPlain)> wait(p, epoch, &s_fail);
    for (int r = b; r < p.rows; r += nb) {
      const long long first = row_first_vec(p, r);
      const int n = row_len(p, r);
      uint4* const inbox = lamport_slot(p, p.rank, 0, epoch) + first;
      const auto own = load_encoded(r, first);  // the combine: computed again, its rows now in L1 / L2
      if constexpr (QUANT == kQuantPlain) {
        uint4* const out = static_cast<uint4*>(p.out) + first;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
          const uint4 a = r == b && i == static_cast<int>(threadIdx.x) ? x0[0] : own(i);
          out[i] = lamport_sum<T, kPlainSumBatch>(p, inbox, i, a, wait);
        }
      } else if constexpr (VPT > 0) {
        if constexpr (VPT == 1) tail.prefetch_next(p, r + nb);  // VPT 2: its 64 registers are full
        tail.load(p, r);
        uint4 a[VPT];
#pragma unroll
        for (int u = 0; u < VPT; ++u) {  // own(i) of the first row is an L1 hit (x0's lines)
          const int i = threadIdx.x + u * blockDim.x;
          a[u] = i < n ? lamport_sum<T, kLamportBatch<VPT>>(p, inbox, i, own(i), wait) : make_uint4(0, 0, 0, 0);
        }
        // Before the tail's first __syncthreads: a thread still waiting for a mismatched peer's
        // data that never comes is released by this check, not by the timeout.
        if constexpr (VPT == 1) wait.settle_size(p);  // VPT 2: see LamportWait
        tail.emit_row(p, r, a, red);
      } else {
        const auto sum = [&p, inbox, own, &wait](int i) {
          return lamport_sum<T, kMaxWorld>(p, inbox, i, own(i), wait);
        };
        tail.prefetch_next(p, r + nb);
        wait.settle_size(p);  // the looped tail waits for data between __syncthreads
        tail.emit(p, r, sum, red);
      }
    }
    // Every CTA (those without rows too) reads and resets every slot pushed to it.
    if (sig_owner(p) && !sig_settle<T, QUANT, ALGO>(p, epoch)) s_fail = 1;
  } else {
    // Phase 0 (reduce-scatter, push): each row to its segment owner's slot[rank].
    for (int r = b; r < p.rows; r += nb) {
      const long long first = row_first_vec(p, r);
      uint4* const dst = slot(p, segment_owner(p, r), p.rank, epoch) + first;
      copy_row<kCopyStep<VPT>>(row_len(p, r), load_x(r, first), [dst](int) { return dst; }, 1);
    }
    if (!barrier<T, QUANT, ALGO>(p, 0, s_epoch, &s_fail)) return;
    // Phase 1: reduce the own segment's rows and push the T sums into every rank's gather region.
    const int own_end = segment_begin(p, p.rank + 1);
    for (int r = first_row(segment_begin(p, p.rank), b, nb); r < own_end; r += nb) {
      const long long first = row_first_vec(p, r);
      const RankRows src = rank_rows(p, epoch, first);
      copy_row<kCopyStep<VPT>>(row_len(p, r), [src](int i) { return sum_ranks<T, kSumBatch<QUANT, VPT>>(src, i); },
               [&p, epoch, first](int d) { return gather(p, peer_order(p, d), epoch) + first; }, p.world);
    }
    RowTail<T, QUANT, VPT> tail;
    tail.prefetch(p, b);  // phase 2's first row: in flight during barrier 1
    if (!barrier<T, QUANT, ALGO>(p, 1, s_epoch, &s_fail)) return;
    // Phase 2: every rank's sums are in the local gather region: emit all rows.
    const uint4* g = gather(p, p.rank, epoch);
    for (int r = b; r < p.rows; r += nb) {
      const long long first = row_first_vec(p, r);
      tail.prefetch_next(p, r + nb, g + row_first_vec(p, r + nb));
      tail.emit(p, r, [g, first](int i) { return __ldcg(g + first + i); }, red);
    }
  }
  if constexpr (kScaleFactors<QUANT>) {
    if (p.tail.sf_swizzled) zero_padding_rows<QUANT>(p);
  } else if constexpr (QUANT == kQuantFp8Block) {
    zero_padding_rows<QUANT>(p);
  }
  if (threadIdx.x == 0) p.epochs[b] = s_epoch;
}

// Spins for `ns` nanoseconds (one thread): holds a stream while the host enqueues the calls the
// calibration times, so the measurement is GPU time, not Python launch overhead.
__global__ void p2p_delay(unsigned long long ns) {
  const unsigned long long start = global_timer_ns();
  while (global_timer_ns() - start < ns) {
  }
}

}  // namespace commfuse
