// Thread-block clusters (SM 9.0 and newer), for kernels that commfuse/kernels/launch.py's Launch.cluster
// launches in clusters of CTAs: the cluster's shape, and a store into another CTA's shared memory
// (distributed shared memory). Launched without clusters, or built for an older arch, a CTA is a cluster
// of one: cluster_ctas() is 1 and cluster_rank() 0.
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

// The word *slot = v in the shared memory of the cluster's CTA `rank` (slot: this CTA's address of the
// same variable), which must have started (cluster_wait). Visible to that CTA after cluster_sync(), and
// that CTA must not exit before it.
__device__ __forceinline__ void cluster_store(unsigned* slot, unsigned rank, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(slot));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
#else
  *slot = v;
#endif
}

// A CTA may store into another's shared memory only once that CTA runs: every thread of every CTA
// calls cluster_arrive() when it starts, and cluster_wait() before its first cluster_store (the work in
// between overlaps the other CTAs' start). No memory ordering: a start, not data.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// Every thread of every CTA of the cluster arrives; the stores to shared memory before it (any CTA's)
// are visible after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __syncthreads();
#endif
}

constexpr int kMaxClusterCtas = 8;  // the portable cluster size: what commfuse launches at most

__device__ __forceinline__ unsigned word_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned word_of(unsigned v) { return v; }
__device__ __forceinline__ void of_word(unsigned w, float& v) { v = __uint_as_float(w); }
__device__ __forceinline__ void of_word(unsigned w, unsigned& v) { v = w; }

// op(...op(v_0, v_1)..., v_{n-1}) over the cluster's n CTAs, v_r being CTA r's value (every thread of a
// CTA passes it): the same bits in every CTA. Every thread of every CTA calls it, once all have started
// (cluster_wait); it ends with a cluster_sync. slots: this CTA's __shared__ words, kMaxClusterCtas of them,
// for this call only (a second call takes others: a fast CTA's stores would land in a slow one's reads).
// V: float or unsigned (word_of / of_word).
template <typename V, typename Op>
__device__ __forceinline__ V cluster_reduce(V v, unsigned (&slots)[kMaxClusterCtas], Op op) {
  const unsigned n = cluster_ctas();
  if (threadIdx.x < n) cluster_store(&slots[cluster_rank()], threadIdx.x, word_of(v));
  cluster_sync();
  V total, next;
  of_word(slots[0], total);
  for (unsigned r = 1; r < n; ++r) {
    of_word(slots[r], next);
    total = op(total, next);
  }
  return total;
}

}  // namespace commfuse
