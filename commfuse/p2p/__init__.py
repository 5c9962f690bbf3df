"""P2P all-reduce over CUDA IPC buffers, with the all-reduce tail fused into the same kernel.

This is the "one node, P2P between every pair" row of docs/design.md. The kernels are in
csrc/p2p_allreduce.cu (its header comment has the device-side details and the memory-ordering
argument). This package, one job a module: workspace.py (the IPC buffers the kernels work in),
calibration.py (where each algorithm wins, measured and cached); the kernels' host half (variants,
launch shapes and LaunchPlans, error codes, call signatures and the exceptions they become) is
commfuse/kernels/p2p_allreduce.py.

Workspace (class Workspace, one per Communicator, created collectively by every rank)
- Per rank ONE device buffer (cuMemAlloc, exported as a CUDA IPC handle; handles all-gathered over
  the group; every peer's buffer mapped once with cuIpcOpenMemHandle):
      half 0 | half 1 | Lamport half 0 | Lamport half 1 | signature slots | flags
  where each half is `world` slots of `slot_bytes` (slot s receives rank s's data) followed by a
  gather region of `slot_bytes` (two-shot's reduced rows); each Lamport half is `world` slots of
  `lamport_bytes` (the one-shot's; all ones when unused); flags is uint64[2 phases][NBLOCKS][world]
  (flags[k][b][s]: the last call in which rank s's CTA b finished two-shot phase k). Calls alternate
  halves by the parity of their epoch (double buffering), so one barrier per phase suffices and a
  Lamport half is reset before it is reused (the argument is in csrc/p2p_allreduce.cu).
  Size: 2 * (world + 1) * max_bytes + 2 * world * lamport_bytes + flags. max_bytes (the largest
  message one launch takes) is the constructor's argument, else COMMFUSE_P2P_WORKSPACE_MB, else
  192 MiB / (world + 1) rounded down to whole MiB: 64 MiB for 2 ranks, 38 MiB for 4, 21 MiB for 8,
  i.e. about 384 MiB of device memory per rank whatever the world size. lamport_bytes (the largest
  one-shot message) is min(max_bytes, ONESHOT_BUDGET / (2 * world)): 8 MiB for 2 ranks, 4 MiB for
  4, 2 MiB for 8 (32 MiB more per rank); one-shot is a latency algorithm, and calibration found
  two-shot ahead from 16 MiB at 2 ranks. Both rounded up to a multiple of 4 KiB.
  A larger message runs two-shot in pieces of whole rows that fit max_bytes, one launch per piece
  (p2p_allreduce.chunk_rows; 128-row multiples for swizzled scale factors): rows are independent, so
  each piece is a complete call of its own, and every launch keeps the protocol below unchanged.
- Per rank, not shared: epochs[NBLOCKS] and a device error word (one small torch tensor), and one
  host-mapped pinned error word (cuMemHostAlloc) that a timed-out kernel writes and the host polls.
- NBLOCKS: the grid of every launch, the same on every rank: min over the ranks of the CTAs it can
  keep resident (resident_ctas: the SMs this process may use, divided among the ranks sharing its
  GPU), at most MAX_BLOCKS, so each CTA b has the same sequence of calls on every rank and all CTAs
  of all ranks are co-resident (one CTA per SM: 256 threads, or up to 1024 threads at <= 64
  registers for the 1- and 2-vector register tails).
- Signature slots: per half, sender and CTA, 16 bytes (Lamport style: all ones when unused): each
  launch's CTA b pushes its call's signature to every peer and checks theirs, so ranks making
  different calls raise P2PMismatchError instead of summing unrelated data (csrc/p2p_allreduce.cu).
- Flags, epochs and error words are zeroed at creation, followed by a barrier before first use.
- close() is collective: synchronise, barrier, unmap the peers' buffers, barrier, free. A workspace
  that is never closed is released by the driver when the process exits (nothing here runs at
  interpreter exit, so exiting cannot hang in a collective or crash in a torn-down context).

Algorithms (both for the plain all-reduce and for every fused pattern; every rank computes every
output, and the sum is fp32 in rank order, rounded to T once: bit-identical on every rank)
- one-shot (Lamport): each rank pushes its whole message into slot[rank] of every peer's Lamport
  half; each rank reads its slots as they fill (an empty word marks data not yet arrived, so there
  is no flag and no barrier), sums them with its own input, resets them to empty and runs the tail
  (csrc/epilogue.cuh) on its rows. Messages up to lamport_bytes (commfuse.routes sends larger ones
  two-shot, also when one-shot is forced).
- two-shot: rows split into `world` contiguous segments. Phase 0 pushes each row to its segment
  owner; barrier; each rank reduces its own segment and pushes the T-rounded sums into every rank's
  gather region; barrier; every rank runs the tail on all rows from its gather region.
  This differs from the textbook "epilogue on own rows, all-gather the outputs" on purpose:
  gathering the one T row of sums moves fewer bytes over NVLink than gathering the 2-4 outputs
  (residual, norm, quant, scale factors), and the outputs stay ordinary torch tensors (no IPC output
  buffers, nothing registered per call). Each rank then runs the tail on every row, which costs HBM
  bandwidth, not NVLink bandwidth, the scarcer of the two.
- plain all-reduce: the same kernels without a tail (QUANT = kQuantPlain); the flattened tensor is cut
  into rows of up to 2048 vectors so that every CTA gets work. Needs numel % 8 == 0 (16-byte
  vectors; P2P_ALLREDUCE.rejects says so, and commfuse.routes then takes NCCL).

Bounded waits and errors: every cross-rank wait gives up after `timeout_s` (COMMFUSE_P2P_TIMEOUT_S,
default 10 s); the kernel records the missing rank in the device and host error words and returns.
`check_error()` (a plain read of pinned host memory: no synchronisation) raises P2PTimeoutError;
the Communicator calls it at the start of every call, and `check()` synchronises first. The error is
sticky: after a timeout the flags and epochs are out of step, so every later kernel on this
workspace returns at once (it reads the device error word) and every later call raises. This also
surfaces a timeout that happened inside a CUDA graph replay.

Launches use programmatic dependent launch on SM 9.0 and newer (see jit.Kernel.launch): the kernel
is scheduled while the previous kernel of the stream finishes, and waits for it on the GPU.

CUDA graphs: the workspace is created (and calibrated) before any capture; a launch bakes in only
pointers that stay valid for the workspace's life, and the epochs live in device memory, so replays
advance them like eager calls. Kernels must be loaded before capture (call once eagerly, or
`warmup`). Calls on one workspace must be stream-ordered (one stream, or ordered by events), as for
NCCL: the double-buffering argument relies on a rank's call E finishing before its call E + 1 starts.

Calibration (strategy "auto", at creation, i.e. before any capture): times one-shot, two-shot and
NCCL plain bf16 all-reduces (NCCL as the NCCL route runs it: commfuse.nccl's ncclAllReduce out of
place, or without it torch's in-place all_reduce of a copy of x) for messages of 4 KiB, 8 KiB, ...
up to max_bytes and at 2 x max_bytes
(two-shot in two pieces there; one-shot up to lamport_bytes). Each timing is
GPU time of back-to-back eager calls held behind a short delay kernel (so Python launch overhead
does not count, as in a CUDA graph replay), best of 3; the MAX over ranks is taken so every rank
decides the same. One-shot's crossover is the largest size up to which one-shot beats NCCL and is no
slower than two-shot at every measured size; two-shot's the largest size above that up to which two-shot
beats NCCL at every measured size (P2PLimits.crossovers).
Between two measured sizes the larger one's decision applies (an algorithm is taken only up to the
largest size at which it was measured to win), and above the largest measured size NCCL is taken (its bandwidth still grows with the size, the pieces' does not). Results are cached as
JSON under COMMFUSE_CACHE_DIR (default ~/.cache/commfuse), keyed by GPU names, world size, the NCCL route's binding and library,
NVLink/P2P matrices, torch/CUDA/NCCL/driver versions, workspace size, grid and kernel source;
rank 0 reads and writes it, every rank takes rank 0's answer. It takes well under 2 s (plus the
first compilation of the plain kernels). COMMFUSE_P2P_CALIBRATE=0 skips it and uses
the crossovers one-shot up to 512 KiB, two-shot up to max_bytes.

Kernel variants: T (fp16, bf16) x QUANT (the plain all-reduce, and every format of the registry,
commfuse.tail.formats) x algorithm, and for the tails up to three row shapes (launch_config): VPT = 1
(rows of up to 8192 elements, 32..1024 threads), VPT = 2 (up to 16384, 1024 threads at most; not for
the formats whose p2p_register_vpts leave it out, which would spill at 64 registers) and the looped
tail (longer rows, 256 threads). This is
fused_tail.launch_config's few-rows rule, taken for every row count: the P2P grid is one CTA per SM
whatever t is, so the reason the local tail takes fewer threads for many rows (several CTAs per SM
overlapping each other) does not apply, and 4 x 256 (its throughput shape) is not built. The world
size is a run-time argument (loops over ranks unrolled to 8 with uniform predicates) rather than a
template argument: tens of dense variants instead of several hundred, so that the CPU build of every variant
for every arch stays quick. The tail's numerics do not depend on these choices beyond the order of
the row's sum of squares (1 ulp of the norm at most, which the tolerances allow); for t < 256 the
P2P tail runs the local tail kernel's configuration, so the two give the same bits.
"""
from .calibration import CalibrationError, P2PLimits, calibration_sizes, default_limits, derive_limits
from .workspace import ALIGN, Workspace, default_max_bytes, layout

__all__ = ["Workspace", "CalibrationError", "P2PLimits", "derive_limits", "default_limits", "calibration_sizes", "default_max_bytes",
           "layout", "ALIGN"]
