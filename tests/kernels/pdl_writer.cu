// Test kernel for the MoE tail's row-index guess (csrc/moe.cuh's guess_rows): it lets the next kernel of its stream
// start at once (programmatic dependent launch), waits delay_ns, then copies n words from src to dst. The next
// kernel's reads of dst before its griddepcontrol.wait find the old words, its reads after the wait the new ones.
#include "pdl.cuh"

namespace commfuse_test {

// Packed by tests/test_moe.py as "<4Q".
struct WriterParams {
  unsigned* dst;
  const unsigned* src;
  unsigned long long n;         // 32-bit words
  unsigned long long delay_ns;  // from the dependents' launch to the copy
};
static_assert(sizeof(WriterParams) == 32, "layout shared with tests/test_moe.py");

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void write_after_launching_dependents(const __grid_constant__ WriterParams p) {
  commfuse::pdl_wait();
  commfuse::pdl_launch_dependents();
  const unsigned long long start = global_ns();
  while (global_ns() - start < p.delay_ns) __nanosleep(1000);
  for (unsigned long long i = threadIdx.x; i < p.n; i += blockDim.x) p.dst[i] = p.src[i];
}

}  // namespace commfuse_test
