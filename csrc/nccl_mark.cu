// The NCCL watchdog's marks around an all-reduce captured in a CUDA graph (commfuse/nccl.py). A replay
// repeats what was captured, host stamps and written numbers included, so the stream counts the
// captured all-reduces it begins itself, in device memory, and publishes that count to the watchdog's
// host-mapped words: BEGUN before the all-reduce, ENDED after it. One thread; its cost is the launch.
#include "commfuse_params.cuh"

namespace commfuse {

__global__ void __launch_bounds__(32) nccl_mark(const __grid_constant__ NcclMarkParams p) {
  if (threadIdx.x != 0) return;
  if (p.ended == nullptr) {
    const unsigned long long begun = *p.count + 1;
    *p.count = begun;
    *p.begun = begun;
  } else {
    *p.ended = *p.count;
  }
  __threadfence_system();  // the host sees the word before any later work of the stream
}

}  // namespace commfuse
