"""commfuse: fused all-reduce tails for tensor-parallel inference.

    import commfuse
    commfuse.init_distributed()
    comm = commfuse.Communicator()
    r = comm.fused_all_reduce(x, residual, weight, eps=1e-6, quant="nvfp4", scale=scale)

See README.md and docs/semantics.md for the semantics; `commfuse.reference` is the oracle.
"""
from . import reference
from .local import Quantized, fused_add_rmsnorm, gated_rmsnorm, quantize
from . import local, ops  # noqa: E402 - ops' Python kernels call the local ops
from .communicator import Communicator, FusedResult
from .distributed import init_distributed
from .kernels.p2p_allreduce import P2PError, P2PMismatchError, P2PTimeoutError
from .nccl import NcclTimeoutError
from .routes import CallMismatchError, CallTimeoutError, Plan
from .tail.spec import TailSpec
from .topology import Topology
from . import fusion  # noqa: E402 - the pass imports the ops above
from . import sharding

__all__ = ["Communicator", "FusedResult", "P2PError", "P2PMismatchError", "P2PTimeoutError", "CallMismatchError",
           "CallTimeoutError", "NcclTimeoutError", "Plan", "Topology",
           "TailSpec", "Quantized", "init_distributed", "ops", "reference", "local", "fusion", "fused_add_rmsnorm",
           "gated_rmsnorm", "quantize"]
__version__ = "0.1.0"
