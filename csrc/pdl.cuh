// Programmatic dependent launch (PDL), for kernels that commfuse/kernels/jit.py launches with the
// programmatic-stream-serialization attribute (SM 9.0 and newer; elsewhere both are no-ops and the
// launch is an ordinary one).
//
// Under PDL the next kernel of the stream may be scheduled once every CTA of this one has called
// pdl_launch_dependents (or exited), so its launch latency hides behind this kernel's run, and
// this kernel may itself start before the previous kernel has finished: pdl_wait() blocks until
// that kernel has completed and its memory is visible. A kernel launched with PDL must therefore
// call pdl_wait() before it writes any global memory or reads any that it uses unchecked (the MoE
// tail's row-index guess, moe.cuh's guess_rows, is read before and checked after).
#pragma once

namespace commfuse {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace commfuse
