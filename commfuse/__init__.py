"""commfuse: fused all-reduce tails for tensor-parallel inference.

    import commfuse
    commfuse.init_distributed()
    comm = commfuse.Communicator()
    r = comm.fused_all_reduce(x, residual, weight, eps=1e-6, quant="nvfp4", scale=scale)

See README.md and docs/semantics.md for the semantics; `commfuse.reference` is the oracle.
"""
from . import norm, ops, reference
from .communicator import Communicator, FusedResult
from .distributed import init_distributed
from .p2p import P2PError, P2PMismatchError, P2PTimeoutError
from .plan import Plan
from .topology import Topology
from .norm import fused_add_rmsnorm, gated_rmsnorm
from . import fusion  # noqa: E402 - the pass imports the ops above

__all__ = ["Communicator", "FusedResult", "P2PError", "P2PMismatchError", "P2PTimeoutError", "Plan", "Topology",
           "init_distributed", "ops", "reference", "norm", "fusion", "fused_add_rmsnorm", "gated_rmsnorm"]
__version__ = "0.1.0"
