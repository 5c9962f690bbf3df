// Thread-block clusters (SM 9.0 and newer), for kernels that commfuse/kernels/launch.py's Launch.cluster
// launches in clusters of CTAs: the cluster's shape, and a reduction of one word a CTA over the cluster
// through distributed shared memory (cluster_reduce). Launched without clusters, or built for an older
// arch, a CTA is a cluster of one: cluster_ctas() is 1 and cluster_rank() 0.
#pragma once

namespace commfuse {

__device__ __forceinline__ unsigned cluster_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
#else
  return 1;
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

// The cluster's index in the grid: blockIdx.x / cluster_ctas() for the 1-D grids commfuse launches, without the
// division.
__device__ __forceinline__ unsigned cluster_id() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned c;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(c));
  return c;
#else
  return blockIdx.x;
#endif
}

constexpr int kMaxClusterCtas = 8;  // the portable cluster size: what commfuse launches at most

// The words of one cluster_reduce: a slot per CTA, and the mbarrier that counts their bytes in.
struct ClusterExchange {
  unsigned long long arrived;
  unsigned slots[kMaxClusterCtas];
};

// A kernel's cluster reductions, each at most once a kernel (its mbarrier's first phase): the row's sum of
// squares and fp8_per_token's maximum. Namespace scope, so that cluster_arrive can ready them before
// any CTA of the cluster may store into them, wherever in the kernel their reduction is.
enum ClusterExchangeId { kClusterSum = 0, kClusterMax = 1, kClusterExchanges = 2 };
__shared__ ClusterExchange cluster_exchanges[kClusterExchanges];

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The address of the same shared variable in the cluster's CTA `rank`.
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(p)), "r"(rank));
  return remote;
}
#endif

// A CTA may store into another's shared memory only once that CTA runs and has readied its exchanges:
// every thread of every CTA calls cluster_arrive() when it starts, and cluster_wait() before its first
// cluster_reduce (the work in between overlaps the other CTAs' start). The barrier orders only the
// exchanges' initialisation (fence.mbarrier_init), no other memory.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    for (int i = 0; i < kClusterExchanges; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&cluster_exchanges[i].arrived))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned word_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned word_of(unsigned v) { return v; }
__device__ __forceinline__ void of_word(unsigned w, float& v) { v = __uint_as_float(w); }
__device__ __forceinline__ void of_word(unsigned w, unsigned& v) { v = w; }

// op(...op(v_0, v_1)..., v_{n-1}) over the cluster's n CTAs, v_r being CTA r's value (every thread of a
// CTA passes it): the same bits in every CTA. Every thread of every CTA calls it, after cluster_arrive and
// cluster_wait, with exchange ID's cluster_exchanges slot, once a kernel. Threads 0 .. n-1 each send the
// CTA's word into one CTA's slots by st.async, whose mbarrier counts the bytes in; each CTA waits for its
// own n words only, not for every thread of every CTA at a cluster barrier (an H200, one token's MoE tail
// over 8 CTAs: 3.22 us with stores and a cluster barrier, 2.94 with this; the barrier's cost was not its
// release waiting for the row's global stores: with those after it, 3.21). No CTA exits before its n words
// have come, so every store finds its target.
// V: float or unsigned (word_of / of_word).
template <ClusterExchangeId ID, typename V, typename Op>
__device__ __forceinline__ V cluster_reduce(V v, Op op) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ClusterExchange& x = cluster_exchanges[ID];
  const unsigned n = cluster_ctas();
  const unsigned arrived = shared_address(&x.arrived);
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(arrived), "r"(n * 4) : "memory");
  if (threadIdx.x < n)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(
                     cluster_address(&x.slots[cluster_rank()], threadIdx.x)),
                 "r"(word_of(v)), "r"(cluster_address(&x.arrived, threadIdx.x))
                 : "memory");
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(arrived)
        : "memory");
  V total, next;
  of_word(x.slots[0], total);
#pragma unroll
  for (unsigned r = 1; r < kMaxClusterCtas; ++r) {
    if (r < n) {
      of_word(x.slots[r], next);
      total = op(total, next);
    }
  }
  return total;
#else
  return v;  // a CTA is a cluster of one
#endif
}

}  // namespace commfuse
