"""Seeded inputs of the multi-rank tests (test_communicator.py, test_p2p.py).

Each rank generates every rank's input from one seeded generator (the `gen` fixture, the same on
every rank) and keeps its own slice, so the reference sees exactly the gathered inputs.
"""
import torch
import torch.distributed as dist

# dequant scales for the tails' quant patterns (the computed-scale kinds take none)
SCALES = {None: None, "fp8": 0.02, "nvfp4": 0.004, "fp8_per_token": None, "fp8_block": None, "mxfp8": None}


def rank_inputs(comm, gen, shape, dtype):
    """(this rank's x, every rank's x) of `shape` and `dtype` on comm.device; one row of each is x40,
    so norms and scale factors span a wide range."""
    xs = [torch.randn(shape, generator=gen) for _ in range(comm.world_size)]
    for x in xs:
        x.view(-1, shape[-1])[0] *= 40
    xs = [x.to(dtype).to(comm.device) for x in xs]
    return xs[dist.get_rank(comm.group)], xs


def tail_inputs(comm, gen, t, h, dtype, quant):
    """(residual [t, h], weight [h], scale) of `dtype` on comm.device; scale is a float32 tensor of
    one element for quant "fp8"/"nvfp4", else None."""
    residual = torch.randn(t, h, generator=gen).to(dtype).to(comm.device)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(comm.device)
    scale = SCALES[quant]
    if scale is not None:
        scale = torch.tensor([scale], dtype=torch.float32, device=comm.device)
    return residual, weight, scale
