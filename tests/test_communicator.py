"""Communicator on every rank against commfuse.reference applied to all ranks' inputs.

Runs under `mpirun -n N pytest --with-mpi` over whatever backend the machine has (gloo on CPU,
NCCL on GPUs). Each rank generates every rank's input from one seeded generator and keeps its own
slice, so the reference sees exactly the gathered inputs. All collectives of a test happen before
its assertions, so a failing rank cannot leave the others waiting.
"""
import dataclasses
import os
import weakref
import zlib

import pytest
import torch
import torch.distributed as dist

import commfuse.communicator
from commfuse import Communicator, nccl, reference, routes, tolerance
from commfuse.kernels import native, table
from commfuse.reference import Tail

from conftest import error_cycle
from compare import assert_post_residual_close, assert_tail_close, assert_within_ulp, bits_equal, poisoned_runs
from inputs import rank_inputs, tail_inputs

mpi = pytest.mark.mpi(min_size=1)  # one rank too: on one GPU a fused call runs no collective, a plain one NCCL
DTYPES = [torch.bfloat16, torch.float16]
PATTERNS = [  # (quant, return_norm, sf_layout)
    (None, False, "swizzled"),
    ("fp8", False, "swizzled"), ("fp8", True, "swizzled"),
    ("nvfp4", False, "swizzled"), ("nvfp4", True, "swizzled"), ("nvfp4", False, "linear"),
    ("mxfp8", False, "swizzled"), ("mxfp8", True, "linear"),
]


def exact_sum(comm) -> bool:
    """Off NCCL the communicator sums in fp32 in rank order (exact semantics); NCCL sums in T, which
    equals the fp32 sum rounded once only for one or two ranks (a copy, a single addition)."""
    return comm.backend != "nccl" or comm.world_size <= 2


@mpi
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (7, 4096), (2, 3, 2880)])
def test_all_reduce_matches_reference_sum(comm, gen, dtype, shape):
    x, xs = rank_inputs(comm, gen, shape, dtype)
    before = x.clone()
    y = comm.all_reduce(x)
    assert torch.equal(x, before), "all_reduce modified its input"
    expect = reference.all_reduce_sum(xs)
    assert y.shape == x.shape and y.dtype == dtype
    if exact_sum(comm):
        assert torch.equal(y, expect)
    else:
        assert_within_ulp(y, expect, comm.world_size, "all-reduce")


@mpi
@pytest.mark.parametrize("strategy", ["auto", "nccl"])
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, h", [(5, 256), (64, 4096), (3, 2880)])
def test_fused_all_reduce_matches_reference(comm, gen, strategy, quant, return_norm, sf_layout, dtype, t, h):
    c = comm if strategy == "auto" else Communicator(comm.group, strategy=strategy)
    x, xs = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, quant)
    saved = [v.clone() for v in (x, residual, weight)]
    a = c.all_reduce(x)
    runs = poisoned_runs(lambda: c.fused_all_reduce(x, residual, weight, eps=1e-5, quant=quant, scale=scale,
                                                    return_norm=return_norm, sf_layout=sf_layout))
    for f in ("residual", "norm", "quant", "scale_factors", "scales"):
        p, q = (getattr(run, f) for run in runs)
        assert (p is None) == (q is None) and (p is None or bits_equal(p, q)), f"{f}: an element left unwritten"
    r = runs[0]
    for before, after in zip(saved, (x, residual, weight)):
        assert torch.equal(before, after), "fused_all_reduce modified an input"
    # The tail is judged against the reference fed the same all-reduced values; the sum itself
    # is judged by test_all_reduce_matches_reference_sum.
    ref = reference.fused_tail(a, residual, weight, 1e-5, quant, scale, return_norm, sf_layout)
    assert_tail_close(r, ref, quant, sf_layout, exact=r.plan.tail == "separated",
                      norm=reference.fused_tail(a, residual, weight, 1e-5).norm, scale=scale)
    if exact_sum(c):
        full = reference.fused_tail(reference.all_reduce_sum(xs), residual, weight, 1e-5, quant, scale,
                                    return_norm, sf_layout)
        assert torch.equal(r.residual, full.residual)
    if strategy == "nccl":
        assert not r.plan.collective.startswith("p2p")
    if c.device.type == "cuda":
        assert r.plan.tail == "fused", str(r.plan)
    else:
        assert r.plan.tail == "separated" and any("cpu" in s for s in r.plan.reasons)


@mpi
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_per_token"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_a_post_weight_normalises_the_sum_before_the_residual_add(comm, gen, quant, weight_offset):
    """fused_all_reduce(post_weight=) (docs/semantics.md section 2a): the tail of the sum's post-norm, on every
    route (gloo and the separated ops on the CPU: the reference's bits; NCCL and the tail kernel on a GPU: the
    residual within an ulp of the post-normed sum and one of its own, the rest within the tolerances of the
    kernel's own residual), the inputs untouched, the P2P kernels passed over with the reason; post_weight checked
    as weight is, by its name."""
    t, h = 6, 512
    x, xs = rank_inputs(comm, gen, (t, h), torch.bfloat16)
    residual, weight, scale = tail_inputs(comm, gen, t, h, torch.bfloat16, quant)
    post = (1.0 - weight_offset + 0.1 * torch.randn(h, generator=gen)).bfloat16().to(comm.device)
    saved = [v.clone() for v in (x, residual, weight, post)]
    a = comm.all_reduce(x)
    first, second = poisoned_runs(lambda: comm.fused_all_reduce(x, residual, weight, quant=quant, scale=scale,
                                                                return_norm=True, weight_offset=weight_offset,
                                                                post_weight=post))
    for f in ("residual", "norm", "quant", "scale_factors", "scales"):
        assert bits_equal(getattr(first, f), getattr(second, f)), f"{f}: an element left unwritten"
    for before, after in zip(saved, (x, residual, weight, post)):
        assert torch.equal(before, after), "fused_all_reduce modified an input"
    want = reference.fused_tail(a, residual, weight, 1e-6, quant, scale, True, weight_offset=weight_offset,
                                post_weight=post)
    assert not first.plan.collective.startswith("p2p"), str(first.plan)
    if first.plan.tail == "separated":
        assert_tail_close(first, want, quant, exact=True)
    else:
        assert_post_residual_close(first.residual, want.residual, reference.rmsnorm(a, post, 1e-6, weight_offset))
        own = reference.fused_tail(first.residual, None, weight, 1e-6, quant, scale, True, weight_offset=weight_offset)
        got = reference.Tail(None, first.norm, first.quant, first.scale_factors, first.scales)
        assert_tail_close(got, own, quant, scale=scale)
    assert comm.plan(x, residual, weight, quant=quant, scale=scale, post_weight=post).kernel == first.plan.kernel
    with pytest.raises(ValueError, match=r"post_weight must have shape \[512\]"):
        comm.fused_all_reduce(x, residual, weight, post_weight=post[:256])
    with pytest.raises(TypeError, match="post_weight dtype torch.float32 must match x dtype torch.bfloat16"):
        comm.fused_all_reduce(x, residual, weight, post_weight=post.float())


@mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (an NCCL group of one rank)")
def test_one_rank_of_an_nccl_group_launches_no_all_reduce(comm, gen):
    """A Communicator of an NCCL group of one rank (each rank's own): its calls plan no collective and launch no
    NCCL all-reduce (its watchdog counts none), eager and replayed from a CUDA graph; fused calls give the
    reference's tail of x (the residual bit for bit, the codes within their tolerance), out.residual = residual
    updated in place; plain calls a copy of x (a new tensor, or the caller's out); any call with strategy="nccl"
    runs NCCL's all-reduce."""
    if dist.get_backend(comm.group) != "nccl":
        pytest.skip("needs NCCL groups (ranks sharing a GPU run gloo)")
    groups = [dist.new_group([r], backend="nccl") for r in range(dist.get_world_size())]
    c, forced = (Communicator(groups[dist.get_rank()], strategy=s) for s in ("auto", "nccl"))
    c.check_calls = forced.check_calls = False  # the check's gather would not be captured
    words = None if c._nccl is None else c._nccl._progress
    issued = None if words is None else words[nccl.ISSUED]
    x = torch.randn(16, 4096, generator=gen).to(torch.bfloat16).cuda()
    residual, weight, scale = tail_inputs(c, gen, 16, 4096, torch.bfloat16, "fp8")
    p = c.plan(x, residual, weight, quant="fp8", scale=scale)
    assert (p.collective, p.tail, p.kernel, p.route) == ("none", "fused", "fused_tail", "identity"), str(p)
    assert forced.plan(x, residual, weight, quant="fp8", scale=scale).collective == "nccl"
    runs = poisoned_runs(lambda: c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale))
    want = reference.fused_tail(x, residual, weight, quant="fp8", scale=scale)
    for r in runs:
        assert bits_equal(r.residual, want.residual) and r.norm is None
        assert_tail_close(r, want, "fp8", norm=reference.fused_tail(x, residual, weight).norm, scale=scale)
    in_place = residual.clone()
    assert c.fused_all_reduce(x, in_place, weight, out=(in_place, None, None, None, None)).residual is in_place
    assert bits_equal(in_place, want.residual)
    p = c.plan(x)
    assert (p.collective, p.tail, p.kernel, p.route) == ("none", "none", None, "identity"), str(p)
    for y in poisoned_runs(lambda: c.all_reduce(x)):
        assert bits_equal(y, x) and y.data_ptr() != x.data_ptr()
    given = torch.full_like(x, float("nan"))
    assert c.all_reduce(x, out=given) is given and bits_equal(given, x)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        captured = c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale)
        summed = c.all_reduce(x)
    captured.quant.view(torch.uint8).fill_(0xA5)
    summed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(captured.quant, runs[0].quant) and bits_equal(summed, x)
    if words is not None:
        assert words[nccl.ISSUED] == issued, "an NCCL all-reduce ran"
        assert forced.plan(x).collective == "nccl" and bits_equal(forced.all_reduce(x), x)
        assert torch.equal(forced.fused_all_reduce(x, residual, weight).residual, want.residual)
        torch.cuda.synchronize()
        assert words[nccl.ISSUED] == words[nccl.DONE] == issued + 2
    c.close()
    forced.close()


@mpi
def test_fused_all_reduce_flattens_leading_dims(comm, gen):
    x, xs = rank_inputs(comm, gen, (2, 3, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(comm, gen, 6, 64, torch.bfloat16, None)
    r = comm.fused_all_reduce(x, residual.view(2, 3, 64), weight)
    assert r.residual.shape == (6, 64) and r.norm.shape == (6, 64) and r.quant is None
    # the rows in x's order: token (b, s) is row b * 3 + s
    want = reference.fused_tail(comm.all_reduce(x).reshape(6, 64), residual, weight)
    assert_tail_close(r, want, None, exact=exact_sum(comm))


@mpi
def test_separated_tail_for_float32_says_why(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 64), torch.float32)
    residual, weight, _ = tail_inputs(comm, gen, 4, 64, torch.float32, None)
    a = comm.all_reduce(x)
    r = comm.fused_all_reduce(x, residual, weight)
    assert r.plan.tail == "separated" and r.plan.reasons
    assert_tail_close(r, reference.fused_tail(a, residual, weight), None, exact=True)


@mpi
def test_bad_argument_raises_on_every_rank_before_any_collective(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(comm, gen, 4, 64, torch.bfloat16, None)
    with pytest.raises(ValueError, match="needs scale"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8")
    with pytest.raises(ValueError, match="weight must have shape"):
        comm.fused_all_reduce(x, residual, weight[:32])
    # A lazily negated view holds x's memory and means -x: no plan table keys it (on a GPU the native
    # launcher would read x), so a planned signature's call goes to planning, which names it.
    want = comm.fused_all_reduce(x, residual, weight).residual  # planned
    for name in ("x", "residual"):
        args = dict(x=x, residual=residual)
        args[name] = torch._neg_view(args[name])
        with pytest.raises(TypeError, match=f"{name} is a lazily negated view"):
            comm.fused_all_reduce(**args, weight=weight)
    assert comm.all_reduce(x).shape == x.shape  # the group still works afterwards
    with pytest.raises(TypeError, match="x is a lazily negated view"):
        comm.all_reduce(torch._neg_view(x))
    # A zero tensor (forward-mode AD) has no memory: its null pointer would read as no residual given.
    for name in ("x", "residual"):
        args = dict(x=x, residual=residual)
        args[name] = torch._efficientzerotensor(x.shape, dtype=x.dtype, device=x.device)
        with pytest.raises(TypeError, match=f"{name} is a zero tensor without memory"):
            comm.fused_all_reduce(**args, weight=weight)
    assert torch.equal(comm.fused_all_reduce(x, residual, weight).residual, want)
    # A FakeTensor keys as x would but holds no memory (a null pointer to a native launch): refused alike.
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = mode.from_tensor(x)
    with mode, pytest.raises(TypeError, match="x is a FakeTensor"):
        comm.fused_all_reduce(fake, residual, weight)
    with mode, pytest.raises(TypeError, match="x is a FakeTensor"):
        comm.all_reduce(fake)
    # Nor does an eager functional collective's result, until it is waited on.
    import torch.distributed._functional_collectives as funcol

    pending = funcol.all_reduce(x, "sum", comm.group)
    with pytest.raises(TypeError, match="x is an AsyncCollectiveTensor, .*wait_tensor"):
        comm.fused_all_reduce(pending, residual, weight)
    funcol.wait_tensor(pending)
    assert torch.equal(comm.fused_all_reduce(x, residual, weight).residual, want)


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_shapes_raise_instead_of_hanging(comm, gen):
    rank = dist.get_rank(comm.group)
    x = torch.randn(4 + rank, 64, generator=gen).to(comm.device)
    with pytest.raises(ValueError, match="ranks disagree"):
        comm.all_reduce(x)
    residual, weight, _ = tail_inputs(comm, gen, 4, 64, torch.float32, None)
    quant = "fp8" if rank == 0 else None
    with pytest.raises(ValueError, match="ranks disagree"):
        comm.fused_all_reduce(x[:4], residual, weight, quant=quant,
                              scale=torch.ones(1, device=comm.device) if quant else None)


@pytest.mark.mpi(min_size=2)
def test_calls_whose_texts_share_a_crc32_are_told_apart(comm):
    """The exchange compares a 64-bit digest of each call's text: two texts with the same CRC-32 (found by search;
    a CRC-32 would pass them as one call one pair in 2^32) make every rank raise CallMismatchError."""
    a, b = "plain(torch.bfloat16, [29685295, 64]) on gloo", "plain(torch.bfloat16, [32060020, 64]) on gloo"
    assert zlib.crc32(a.encode()) == zlib.crc32(b.encode())
    c = _checked_by(comm, "COMMFUSE_CHECK")
    if c._check_group is None:  # an NCCL group's, made at its first checked call
        c.all_reduce(torch.ones(2, device=c.device))
    text = a if dist.get_rank(c.group) == 0 else b
    with pytest.raises(commfuse.CallMismatchError, match="ranks disagree on the call: rank 0: plain.*29685295"):
        routes.exchange_signature(c._check_group, text, 0)
    routes.exchange_signature(c._check_group, a, 0)  # the same text on every rank passes


@mpi
def test_checked_launchers_do_not_keep_their_communicator(comm, gen):
    """COMMFUSE_CHECK's launchers live in the Communicator's plan table; the C++ table's references are not seen by
    the garbage collector, so a launcher holding its Communicator kept it (and its workspace) for good: they hold a
    proxy. The Communicator goes with its last reference, and its checked calls work while it lives."""
    import gc

    c = _checked_by(comm, "COMMFUSE_CHECK")
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16).to(c.device)
    y, w = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16).to(c.device), torch.rand(4, 2).to(c.device)
    for _ in range(2):  # the second call is served by the plan table's checked launcher
        assert c.all_reduce(x).shape == x.shape
        c.fused_all_reduce(x, x.clone(), x[0])
        c.moe_all_reduce(y, w, x.clone(), x[0])  # the combine, then the dense route: a check of its own
    # Neither a _Checked launcher nor a closure's cell (the MoE launcher's check) holds the Communicator.
    assert not [r for r in gc.get_referrers(c) if type(r).__name__ in ("_Checked", "cell")]
    gone = weakref.ref(c)
    del c
    gc.collect()
    assert gone() is None


@mpi
def test_a_close_whose_workspace_teardown_raises_leaves_no_route_on_it(comm, gen):
    """The workspace's teardown raises (a peer gone in its barrier): the Communicator's planning has forgotten the
    workspace and its limits first, so the next call takes the group's own collective, not a P2P route on a
    workspace being torn down."""
    c = Communicator(comm.group)

    class Failing:
        def close(self):
            raise RuntimeError("the teardown's barrier timed out")

    c.workspace = Failing()
    c._machine = dataclasses.replace(c._machine, limits=object())
    with pytest.raises(RuntimeError, match="teardown's barrier"):
        c.close()
    assert c.workspace is None and c._machine.limits is None and c._resources.workspace is None
    x = torch.randn(4, 64, generator=gen).to(c.device)
    want = x.clone()
    dist.all_reduce(want, group=comm.group)
    torch.testing.assert_close(c.all_reduce(x), want)


MISMATCHES = {  # kind: (rank 0's call, every other rank's) as (shape, dtype, quant)
    "tokens": (((8, 256), torch.bfloat16, None), ((4, 256), torch.bfloat16, None)),
    # 4 KiB travels with the signature, 32 KiB after it (routes.GLOO_INLINE_BYTES: 16 KiB)
    "tokens, one call past the inline size": (((8, 256), torch.bfloat16, None), ((64, 256), torch.bfloat16, None)),
    "same bytes, other shape": (((8, 256), torch.bfloat16, None), ((4, 512), torch.bfloat16, None)),
    "hidden": (((8, 256), torch.bfloat16, None), ((8, 128), torch.bfloat16, None)),
    "dtype": (((8, 256), torch.bfloat16, None), ((8, 256), torch.float16, None)),
    "dtype and hidden, same bytes": (((8, 256), torch.bfloat16, None), ((8, 128), torch.float32, None)),
    "quant": (((8, 256), torch.bfloat16, None), ((8, 256), torch.bfloat16, "fp8")),
    "plain against fused": (((8, 256), torch.bfloat16, "plain"), ((8, 256), torch.bfloat16, None)),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_gloo_route_detects_every_mismatched_call(comm, gen, kind):
    """Without COMMFUSE_CHECK, the gloo route's exchange compares the call's signature first: every
    rank raises, naming every rank's call, and the group still works afterwards."""
    if comm.backend != "gloo":
        pytest.skip(f"a {comm.backend} group: the signature check is the gloo route's")
    # strategy "nccl" keeps ranks sharing a GPU off P2P: every rank's call takes the gloo route, whatever
    # its shape (under "auto" a rank whose call P2P takes would wait in its kernel instead)
    c = Communicator(comm.group, strategy="nccl")
    c.check_calls = False
    rank = dist.get_rank(c.group)
    shape, dtype, quant = MISMATCHES[kind][min(rank, 1)]
    x = torch.randn(*shape, generator=gen).to(dtype).to(c.device)
    assert c.plan(x).collective == "gloo", c.plan(x)
    residual, weight, scale = tail_inputs(c, gen, shape[0], shape[1], dtype, None if quant == "plain" else quant)
    with pytest.raises(commfuse.CallMismatchError, match="ranks disagree on the call") as info:
        if quant == "plain":
            c.all_reduce(x)
        else:
            c.fused_all_reduce(x, residual, weight, quant=quant, scale=scale)
    msg = str(info.value)
    assert all(f"rank {r}:" in msg for r in range(c.world_size)), msg
    (s0, d0, _), (s1, d1, _) = MISMATCHES[kind]
    assert str(list(s0)) in msg and str(list(s1)) in msg and str(d0) in msg and str(d1) in msg, msg
    y = torch.full((2, 64), float(rank + 1), dtype=torch.bfloat16, device=c.device)
    assert torch.equal(c.all_reduce(y).float(), torch.full((2, 64), c.world_size * (c.world_size + 1) / 2, device=c.device))


def _checked_by(comm, check: str, group=None) -> Communicator:
    """A Communicator of `group` (comm's by default) whose calls the ranks compare by `check`: the gloo route's
    exchange (a gloo group, strategy "nccl": off P2P where ranks share a GPU), or COMMFUSE_CHECK's comparison on
    any route."""
    group = comm.group if group is None else group
    if check == "gloo route":
        if comm.backend != "gloo":
            pytest.skip(f"a {comm.backend} group: this check is the gloo route's")
        c = Communicator(group, strategy="nccl")
        c.check_calls = False
    else:
        c = Communicator(group)
        c.check_calls = True
    return c


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
def test_a_post_weight_on_one_rank_only_is_a_mismatch(comm, gen, check):
    """A post weight belongs to the call the ranks compare: where one rank gives it and another not, every rank
    raises naming the post-norm (their sums would be normalised differently, or not at all)."""
    c = _checked_by(comm, check)
    rank = dist.get_rank(c.group)
    x, _ = rank_inputs(c, gen, (4, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, 4, 64, torch.bfloat16, None)
    with pytest.raises(commfuse.CallMismatchError, match="ranks disagree on the call.*post-norm"):
        c.fused_all_reduce(x, residual, weight, post_weight=weight if rank == 0 else None)
    y = torch.ones(2, 64, dtype=torch.bfloat16, device=c.device)
    assert torch.equal(c.all_reduce(y), torch.full_like(y, c.world_size))  # the group still works


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
@pytest.mark.parametrize("name, value", [("weight_offset", 1.0), ("eps", 1e-6)])
def test_tail_numbers_that_differ_in_a_low_bit_are_a_mismatch(comm, gen, check, name, value):
    """eps and weight_offset belong to the call the ranks compare, to the last bit (str() of the spec
    prints them rounded): ranks that differ there would norm one sum differently."""
    c = _checked_by(comm, check)
    rank = dist.get_rank(c.group)
    x, _ = rank_inputs(c, gen, (4, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, 4, 64, torch.bfloat16, None)
    mine = {name: value if rank == 0 else value * (1 + 2 ** -20)}  # apart in float32 too
    with pytest.raises(commfuse.CallMismatchError, match="ranks disagree on the call"):
        c.fused_all_reduce(x, residual, weight, **mine)
    y = torch.ones(2, 64, dtype=torch.bfloat16, device=c.device)
    assert torch.equal(c.all_reduce(y), torch.full_like(y, c.world_size))  # the group still works


@mpi
def test_a_bad_check_timeout_is_named(comm, monkeypatch):
    """COMMFUSE_GLOO_TIMEOUT_S that is no number of seconds raises naming it, on every rank, when the
    Communicator is made (its settings are read and compared there)."""
    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match="COMMFUSE_GLOO_TIMEOUT_S must be a number, got 'abc'"):
        c = Communicator(comm.group)
        c.check_calls = True
        c.all_reduce(torch.ones(2, 8, device=comm.device))


@pytest.mark.mpi(min_size=2)
def test_a_communicator_after_an_uneven_subgroup(comm, gen, monkeypatch):
    """Every rank makes dist.new_group([1]), which only rank 1 then holds: the ranks hold different numbers
    of process groups, which must not keep a Communicator over every rank from making its check group
    (torch names a group made by its own ranks alone from that number)."""
    dist.new_group([1], backend="gloo")
    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "11")  # a check group of its own (one per timeout)
    c = Communicator(comm.group)
    c.check_calls = True  # an NCCL group makes its check group at the first checked call
    x, xs = rank_inputs(c, gen, (3, 64), torch.bfloat16)
    y, want = c.all_reduce(x), reference.all_reduce_sum(xs)
    if exact_sum(c):
        assert torch.equal(y, want)
    else:
        assert_within_ulp(y, want, c.world_size, "all-reduce")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
def test_communicators_of_two_groups_over_the_same_ranks_do_not_pair_their_calls(comm, gen, monkeypatch, check):
    """Two process groups over the same ranks: their Communicators exchange over check groups of their own (those
    of one group share one). Rank 0 calls the first group's Communicator while the others call the second's:
    every rank raises CallTimeoutError, where one shared check group paired the two calls into one exchange and
    returned each rank the other call's sums, silently."""
    ranks = dist.get_process_group_ranks(comm.group)
    groups = [dist.new_group(ranks, backend=comm.backend) for _ in range(2)]
    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "2")
    first, second = (_checked_by(comm, check, g) for g in groups)
    if check == "COMMFUSE_CHECK":  # an NCCL group makes its check group at the first checked call
        for c in (first, second):
            c.all_reduce(torch.ones(2, 8, device=c.device))
    assert first._check_group is not second._check_group
    assert _checked_by(comm, check, groups[0])._check_group is first._check_group  # one group's share it
    x = torch.full((2, 64), float(1 + dist.get_rank(comm.group)), device=comm.device)
    mine = first if dist.get_rank(comm.group) == 0 else second
    with pytest.raises(commfuse.CallTimeoutError, match="not every rank made the call"):
        mine.all_reduce(x)
    dist.barrier(comm.group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
def test_two_communicators_of_one_group_called_in_different_orders_raise(comm, gen, check):
    """Two Communicators of one group share its check group. Rank 0 calls the first then the second, the others
    the second then the first, with inputs of one shape: every rank raises CallMismatchError naming which
    Communicator each rank called. Before, the calls paired and each rank got the other Communicator's sums."""
    first, second = _checked_by(comm, check), _checked_by(comm, check)
    if check == "COMMFUSE_CHECK":  # an NCCL group makes its check group at the first checked call
        for c in (first, second):
            c.all_reduce(torch.ones(2, 8, device=c.device))
    assert first._check_group is second._check_group
    rank = dist.get_rank(comm.group)
    x = torch.full((2, 64), float(1 + rank), device=comm.device)
    order = (first, second) if rank == 0 else (second, first)
    with pytest.raises(commfuse.CallMismatchError, match=r"rank 0: [^;]* on communicator (\d+) of its group, .*; "
                                                          r"rank 1: [^;]* on communicator (?!\1)\d+ of its group"):
        order[0].all_reduce(x)
    for c in (first, second):  # in step again: the same order on every rank
        assert torch.equal(c.all_reduce(x), torch.full_like(x, sum(range(1, comm.world_size + 1))))


@pytest.mark.mpi(min_size=3)
def test_a_subgroups_call_checks_name_the_global_ranks(comm, gen):
    """A subgroup's rank r is another process than the world's rank r: the call checks name both numbers."""
    ranks = dist.get_process_group_ranks(comm.group)[1:]
    # Made by every rank of the world (a Communicator of it would make its check group over its ranks alone, which
    # torch names by how many groups each rank holds: this suite's ranks hold different numbers).
    sub = dist.new_group(ranks, backend="gloo")
    if dist.get_rank(comm.group) == 0:
        return
    with pytest.raises(commfuse.CallMismatchError, match=rf"rank 0 \(global {ranks[0]}\): call 0, 0 bytes; rank 1 "
                                                          rf"\(global {ranks[1]}\): call 1, 0 bytes"):
        routes.exchange_signature(sub, f"call {dist.get_rank(sub)}", 0)


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_whose_texts_do_not_come_raises_the_mismatch_and_retires_the_check_group(comm, monkeypatch):
    """The ranks' texts follow a mismatched digest in a second gather; where that one fails (a peer died or lags
    past the timeout), every rank still raises CallMismatchError with its own call, not gloo's error, and the
    check group is not used again."""
    c = _checked_by(comm, "COMMFUSE_CHECK")
    if c._check_group is None:
        c.all_reduce(torch.ones(2, device=c.device))
    group = c._check_group

    def gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(routes.dist, "all_gather_object", gone)
    text = "plain(a)" if dist.get_rank(c.group) == 0 else "plain(b)"
    with pytest.raises(commfuse.CallMismatchError, match=r"ranks disagree on the call: rank \d+: plain\((a|b)\), 0 "
                                                          r"bytes; the others' calls did not come.*closed by peer"):
        routes.exchange_signature(group, text, 0)
    monkeypatch.undo()
    assert any(g is group for g in routes.BROKEN_CHECK_GROUPS)
    routes.BROKEN_CHECK_GROUPS.remove(group)  # it is whole: only the patched gather failed


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
def test_skipped_call_raises_within_the_check_timeout(comm, gen, monkeypatch, check):
    """Rank 0 calls, the others skip the call: rank 0 raises CallTimeoutError after COMMFUSE_GLOO_TIMEOUT_S,
    not after the process group's timeout, and the group itself stays usable. Two checks bound it: the
    gloo route's exchange, and COMMFUSE_CHECK's comparison (check_calls), which runs over the gloo check
    group on every route, NCCL's included."""
    import time

    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "2")
    c = _checked_by(comm, check)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16).to(c.device)
    if check == "gloo route":
        assert c.plan(x).collective == "gloo", c.plan(x)
    if dist.get_rank(c.group) == 0:
        t0 = time.monotonic()
        with pytest.raises(commfuse.CallTimeoutError, match="not every rank made the call"):
            c.all_reduce(x)
        waited = time.monotonic() - t0
        assert 1.5 < waited < 10, f"raised after {waited:.1f} s"
    dist.barrier(comm.group)  # the communicator's own group has nothing pending
    assert torch.equal(comm.all_reduce(torch.ones(3, device=comm.device)),
                       torch.full((3,), float(comm.world_size), device=comm.device))


@pytest.mark.mpi(min_size=2)
def test_a_fake_tensor_refused_under_its_mode_keeps_the_ranks_in_step(comm, gen):
    """Rank 0 calls with a FakeTensor inside its FakeTensorMode (tracing), its peers with a real x: the refusal's
    collectives run on real tensors, the check group's making included (an NCCL group's Communicator with
    COMMFUSE_CHECK=1 makes it at its first checked call, here by hand on any group: its peers' first checked
    call makes it too), so rank 0 raises TypeError naming x, its peers CallMismatchError, and the next sums are
    right on every rank."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = dist.get_rank(comm.group)
    c = Communicator(comm.group)
    c._check_group = None  # as an NCCL group's Communicator has it before its first checked call
    c.check_calls = True
    x, xs = rank_inputs(c, gen, (4, 64), torch.bfloat16)
    mode = FakeTensorMode()
    if rank == 0:
        fake = mode.from_tensor(x)
        with mode, pytest.raises(TypeError, match="x is a FakeTensor"):
            c.all_reduce(fake)
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0: a call that raised TypeError: x is a FakeTensor"):
            c.all_reduce(x)
    got = c.all_reduce(x)
    want = reference.all_reduce_sum(xs)
    assert bits_equal(got, want) if exact_sum(c) else torch.allclose(got.float(), want.float(), rtol=2e-2)


@pytest.mark.mpi(min_size=2)
def test_a_planned_call_refused_by_its_per_call_checks_leaves_no_reference_cycle(comm, gen):
    """A planned signature's call that its per-call checks refuse (a CPU scale tensor's value, read every call) is
    compared with the peers' calls as a refusal (check_same_call's `refused`), then raised: the frames it passes
    through held it, a reference cycle that kept the call's frames until a garbage collection."""
    c = _checked_by(comm, "COMMFUSE_CHECK")
    if c.device.type != "cpu":
        pytest.skip("a CPU scale tensor's value is read on every call; a CUDA one's is not (no synchronisation)")
    t, h = 4, 256
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    x, xs = rank_inputs(c, gen, (t, h), torch.bfloat16)

    def call(scale):
        return c.fused_all_reduce(x, residual, weight, quant="fp8", scale=torch.tensor([scale])).residual

    call(0.5)  # planned on every rank
    cycle = None
    if dist.get_rank(c.group) == 0:
        with pytest.raises(ValueError, match="scale") as raised:
            call(-1.0)
        cycle = error_cycle(raised.value)
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0"):
            call(0.5)
    want = reference.fused_tail(reference.all_reduce_sum(xs), residual, weight, 1e-6).residual
    assert bits_equal(call(0.5), want) if exact_sum(c) else torch.allclose(call(0.5).float(), want.float(), rtol=2e-2)
    assert cycle is None, cycle


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
@pytest.mark.parametrize("bad", ["a misaligned out", "a sparse x", "a negated x", "a Python-float scale of 0",
                                 "a MoE int16 row_index"])
def test_a_call_whose_planning_raises_on_one_rank_keeps_the_ranks_in_step(comm, gen, check, bad):
    """Rank 0's call raises in planning (a signature it never planned, whose checks read per-call facts; or a
    Python-float scale, which the plan table cannot key: every such call is planned) while its peers' calls
    are good: rank 0 still makes the exchange its peers make, naming its error, so they raise
    CallMismatchError with it, rank 0 raises its own ValueError, and the next calls sum right on every rank.
    Before, the peers' exchange paired with rank 0's next call: wrong sums on every rank, then a timeout."""
    c = _checked_by(comm, check)
    rank = dist.get_rank(c.group)
    t, h = 4, 256
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    steps = [rank_inputs(c, gen, (t, h), torch.bfloat16) for _ in range(3)]

    def call(x, scale=0.5, out=None, index=torch.int32):
        if bad in ("a misaligned out", "a sparse x", "a negated x"):
            return c.all_reduce(x, out=out)
        if bad == "a MoE int16 row_index":  # the finalize form, each token's one row its own
            return c.moe_all_reduce(x, torch.ones(t, 1, device=c.device), residual, weight,
                                    row_index=torch.arange(t, dtype=index).view(t, 1).to(c.device)).residual
        return c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale).residual

    call(steps[0][0])  # planned on every rank
    x, _ = steps[1]
    if rank == 0:
        error, match, bad_call = {  # the sparse and negated x: the table cannot key them, planning names them
            "a misaligned out": (ValueError, "out must be 16-byte aligned", lambda: call(
                x, out=torch.empty(t * h + 8, dtype=torch.bfloat16, device=c.device)[1:1 + t * h].view(t, h))),
            "a sparse x": (TypeError, "x must be a dense tensor, got a torch.sparse_coo one",
                           lambda: call(x.to_sparse())),
            "a negated x": (TypeError, "x is a lazily negated view", lambda: call(torch._neg_view(x))),
            "a MoE int16 row_index": (TypeError, "row_index", lambda: call(x, index=torch.int16)),
            "a Python-float scale of 0": (ValueError, "scale must be", lambda: call(x, scale=0.0)),
        }[bad]
        with pytest.raises(error, match=match) as raised:
            bad_call()
        cycle = error_cycle(raised.value)  # routes.refuse's frame and its caller's held the error: asserted last
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0: a call that raised (Value|Type)Error"):
            call(x)
    for x, xs in (steps[2], steps[0]):
        total = reference.all_reduce_sum(xs)
        plain = bad in ("a misaligned out", "a sparse x", "a negated x")
        want = total if plain else reference.fused_tail(total, residual, weight, 1e-6).residual
        got = call(x)
        assert bits_equal(got, want) if exact_sum(c) else torch.allclose(got.float(), want.float(), rtol=2e-2)
    if rank == 0:
        assert cycle is None, cycle


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", ["a misaligned out", "an out that requires grad", "a CPU scale tensor of 0"])
def test_commfuse_check_compares_what_a_planned_call_would_refuse(comm, gen, bad):
    """COMMFUSE_CHECK on a planned call (a table hit: the signature holds no addresses or values): rank 0's call,
    which its launcher would refuse for its own facts (where its outputs lie, a CPU scale's value), makes every
    rank raise at the comparison, the others CallMismatchError naming the refusal, rather than leave them in
    the collective (on NCCL, until the watchdog aborts the communicator); the next calls sum right."""
    c = _checked_by(comm, "COMMFUSE_CHECK")
    rank = dist.get_rank(c.group)
    t, h = 4, 256
    residual, weight, scale = tail_inputs(c, gen, t, h, torch.bfloat16, "fp8")
    cpu_scale = bad == "a CPU scale tensor of 0"
    if cpu_scale and c.device.type != "cpu":
        pytest.skip("a scale's value is read on the CPU routes only (a GPU one would synchronise every call)")
    steps = [rank_inputs(c, gen, (t, h), torch.bfloat16) for _ in range(3)]

    def call(x, out=None, s=scale):
        if cpu_scale:
            return c.fused_all_reduce(x, residual, weight, quant="fp8", scale=s).residual
        return c.all_reduce(x, out=out)

    def good_out():
        return None if cpu_scale else torch.empty(t, h, dtype=torch.bfloat16, device=c.device)

    call(steps[0][0], good_out())  # planned on every rank
    x, _ = steps[1]
    if rank == 0:
        if bad == "a misaligned out":
            with pytest.raises(ValueError, match="^out must be 16-byte aligned"):
                call(x, torch.empty(t * h + 8, dtype=torch.bfloat16, device=c.device)[1:1 + t * h].view(t, h))
        elif bad == "an out that requires grad":
            with pytest.raises(ValueError, match="^out requires grad"):
                call(x, good_out().requires_grad_())
        else:
            with pytest.raises(ValueError, match="^scale must be positive"):
                call(x, s=torch.zeros(1))
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0: .*refused ValueError"):
            call(x, good_out())
    for x, xs in (steps[2], steps[0]):
        total = reference.all_reduce_sum(xs)
        want = reference.fused_tail(total, residual, weight, 1e-6).residual if cpu_scale else total
        got = call(x, good_out())
        assert bits_equal(got, want) if exact_sum(c) else torch.allclose(got.float(), want.float(), rtol=2e-2)


@pytest.mark.mpi(min_size=2)
def test_a_refused_call_that_a_peer_skipped_says_the_check_timed_out(comm, gen, monkeypatch):
    """COMMFUSE_CHECK: rank 0's planned call would be refused (a misaligned out) while rank 1 skips the call:
    rank 0 raises its own ValueError after COMMFUSE_GLOO_TIMEOUT_S, caused by the CallTimeoutError, so that the
    user learns that the check group is broken from then on."""
    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "2")
    c = _checked_by(comm, "COMMFUSE_CHECK")
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16).to(c.device)
    c.all_reduce(x, out=torch.empty_like(x))  # planned on every rank
    if dist.get_rank(c.group) == 0:
        bad = torch.empty(4 * 64 + 8, dtype=torch.bfloat16, device=c.device)[1:1 + 4 * 64].view(4, 64)
        with pytest.raises(ValueError, match="^out must be 16-byte aligned") as info:
            c.all_reduce(x, out=bad)
        assert isinstance(info.value.__cause__, commfuse.CallTimeoutError), repr(info.value.__cause__)
    dist.barrier(comm.group)  # the communicator's own group has nothing pending


@mpi
def test_outputs_overlapping_an_input_raise_on_every_route(comm, gen):
    """docs/guards.md's one rule, per call: all_reduce's out may not be x; a tail's out.norm may not be x;
    out.residual may be residual itself (in place)."""
    c = Communicator(comm.group)
    c.check_calls = False
    x, _ = rank_inputs(c, gen, (4, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, 4, 64, torch.bfloat16, None)
    with pytest.raises(ValueError, match="out overlaps x"):
        c.all_reduce(x, out=x)
    with pytest.raises(ValueError, match="out.norm overlaps x"):
        c.fused_all_reduce(x, residual, weight, return_norm=True, out=Tail(None, x, None, None, None))
    want = c.fused_all_reduce(x, residual, weight)
    in_place = residual.clone()
    got = c.fused_all_reduce(x, in_place, weight, out=Tail(in_place, None, None, None, None))
    assert got.residual is in_place and torch.equal(in_place, want.residual) and torch.equal(got.norm, want.norm)
    # MN-major scales [3, 2] span their storage's 8 floats (padding rows at 3 and 7, which the kernels write):
    # an x that starts at float 7 overlaps only that padding
    t, h = 3, 256
    store = torch.zeros(1024, device=c.device)
    scales = store.as_strided((t, 2), (1, 4))
    x_in_padding = store.view(torch.bfloat16)[14:14 + t * h].view(t, h).copy_(rank_inputs(c, gen, (t, h), torch.bfloat16)[0])
    before = x_in_padding.clone()
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    out = Tail(None, None, torch.empty(t, h, dtype=torch.float8_e4m3fn, device=c.device), None, scales)
    with pytest.raises(ValueError, match="out.scales overlaps x"):
        c.fused_all_reduce(x_in_padding, residual, weight, quant="fp8_block", scale_layout="mn_major", out=out)
    assert torch.equal(x_in_padding, before)
    # the plan raises on the same arguments as the call
    with pytest.raises(ValueError, match="out.scales overlaps x"):
        c.plan(x_in_padding, residual, weight, quant="fp8_block", scale_layout="mn_major", out=out)
    with pytest.raises(ValueError, match="out overlaps x"):
        c.plan(x, out=x)


@mpi
def test_caller_outputs_that_autograd_or_inference_mode_guard_raise_before_anything_is_written(comm, gen):
    """A caller's output that requires grad (with grad mode on) or is an inference tensor (outside inference
    mode) cannot be written in place by torch, and the kernels would write it behind autograd's back: every
    route raises ValueError naming the field, on first calls and planned ones, before writing anything (here
    the residual, updated in place); under torch.no_grad() an output that requires grad is written, as
    torch's out= allows."""
    c = Communicator(comm.group)
    c.check_calls = False
    t, h = 4, 64
    x, _ = rank_inputs(c, gen, (t, h), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    want = c.fused_all_reduce(x, residual, weight, return_norm=True)
    with torch.inference_mode():
        frozen = torch.empty(t, h, dtype=torch.bfloat16, device=c.device)
    for planned in (False, True):
        if planned:  # the signatures planned (the same outputs given) with outputs that may be written
            r = residual.clone()
            c.fused_all_reduce(x, r, weight, return_norm=True, out=Tail(r, torch.empty_like(residual), None, None, None))
            c.all_reduce(x, out=torch.empty_like(x))
        for norm, field, why in ((torch.empty_like(residual).requires_grad_(), "out.norm", "requires grad"),
                                 (frozen, "out.norm", "is an inference tensor")):
            in_place = residual.clone()
            with pytest.raises(ValueError, match=f"^{field} {why}"):
                c.fused_all_reduce(x, in_place, weight, return_norm=True, out=Tail(in_place, norm, None, None, None))
            assert torch.equal(in_place, residual), "the residual was written by a call that raised"
        with pytest.raises(ValueError, match="^out requires grad"):
            c.all_reduce(x, out=torch.empty_like(x).requires_grad_())
        with pytest.raises(ValueError, match="^out is an inference tensor"):
            c.all_reduce(x, out=frozen)
    norm = torch.empty_like(residual).requires_grad_()
    with torch.no_grad():
        got = c.fused_all_reduce(x, residual.clone(), weight, return_norm=True, out=Tail(None, norm, None, None, None))
    assert got.norm is norm and torch.equal(norm.detach(), want.norm)
    with torch.inference_mode():
        got = c.fused_all_reduce(x, residual.clone(), weight, return_norm=True, out=Tail(None, frozen, None, None, None))
    assert got.norm is frozen and torch.equal(frozen, want.norm)
    # The outputs' version counters move, as torch's out= does: autograd sees the write (a residual saved
    # for backward and updated in place makes backward raise rather than use the new values).
    r, out = residual.clone(), torch.empty_like(x)
    versions = r._version, out._version
    c.fused_all_reduce(x, r, weight, out=Tail(r, None, None, None, None))
    c.all_reduce(x, out=out)
    assert r._version > versions[0] and out._version > versions[1]


@mpi
def test_every_call_checks_where_the_caller_outputs_lie(comm, gen):
    """The plan table keys a call by its outputs' shapes, strides and dtypes, not by their addresses: a later
    call of a planned signature with a misaligned output, or with MN-major scales whose storage lacks room
    for the padding rows, raises as its first call would, on every route, and before anything is written
    (here the residual, which the call would update in place)."""
    c = Communicator(comm.group)
    c.check_calls = False
    t, h = 3, 256
    x, _ = rank_inputs(c, gen, (t, h), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    kw = dict(quant="fp8_block", scale_layout="mn_major")
    want = c.fused_all_reduce(x, residual, weight, **kw)
    shape, strides = want.scales.shape, want.scales.stride()
    room = strides[1] * shape[1]  # 4 rows a column: one of padding

    def call(res, scales):
        q = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=c.device)
        return c.fused_all_reduce(x, res, weight, **kw, out=Tail(res, None, q, None, scales))

    got = call(residual.clone(), torch.full((room,), float("nan"), device=c.device).as_strided(shape, strides))
    assert torch.equal(got.residual, want.residual) and torch.equal(got.scales, want.scales)  # planned
    assert torch.equal(got.quant.view(torch.uint8), want.quant.view(torch.uint8))
    in_place = residual.clone()
    with pytest.raises(ValueError, match="out.scales must be a view of a storage of 8 elements"):
        call(in_place, torch.empty(room - 1, device=c.device).as_strided(shape, strides))
    assert torch.equal(in_place, residual)
    aligned = torch.empty(t, h, dtype=torch.bfloat16, device=c.device)
    c.all_reduce(x, out=aligned)  # planned
    shifted = torch.empty(t * h + 8, dtype=torch.bfloat16, device=c.device)[1:1 + t * h].view(t, h)
    with pytest.raises(ValueError, match="out must be 16-byte aligned"):
        c.all_reduce(x, out=shifted)
    assert torch.equal(c.all_reduce(x, out=aligned), c.all_reduce(x))  # the group still works


@mpi
def test_plan_without_running(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 64), torch.bfloat16)
    residual, weight, scale = tail_inputs(comm, gen, 4, 64, torch.bfloat16, "nvfp4")
    p = comm.plan(x, residual, weight, quant="nvfp4", scale=scale)
    # one rank of an NCCL group has nothing to exchange: no collective
    assert p.collective in ("nccl", "gloo", "none" if comm.world_size == 1 else "gloo") or \
        p.collective.startswith("p2p"), str(p)
    assert p.tail == ("fused" if comm.device.type == "cuda" else "separated")
    # a plain plan (no residual) would ignore any tail argument: each is refused by name, defaults are not
    assert comm.plan(x, eps=1e-6, sf_layout="swizzled", weight_offset=0.0).tail == "none"
    for name, value in (("weight", weight), ("eps", 1e-5), ("quant", "fp8"), ("scale", scale), ("return_norm", True),
                        ("sf_layout", "linear"), ("weight_offset", 1.0), ("scale_layout", "mn_major"),
                        ("scale_ue8m0", True)):
        with pytest.raises(ValueError, match=f"^residual is required when {name} is given$"):
            comm.plan(x, **{name: value})


def test_communicator_needs_initialised_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_distributed"):
        Communicator()


def test_communicator_refuses_a_group_of_another_type(monkeypatch):
    """A group that is not a ProcessGroup (a rank list, a name) is refused naming the argument, before any
    collective (it has none to take part in)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for bad in ("world", 0, [0, 1]):
        with pytest.raises(TypeError, match=f"^group must be a torch.distributed ProcessGroup or None .*got "
                                            f"{type(bad).__name__}$"):
            Communicator(bad)


@pytest.mark.mpi(min_size=2)
def test_a_rank_outside_the_group_is_told_so(comm):
    """torch.distributed.new_group gives the ranks outside a group an int (GroupMember.NON_GROUP_MEMBER): such a
    rank's Communicator was refused as a group "of another type, got int". It says the rank is not a member; the
    group's own rank makes its Communicator."""
    sub = dist.new_group([0], backend="gloo")
    if dist.get_rank() == 0:
        c = Communicator(sub)
        assert c.world_size == 1 and torch.equal(c.all_reduce(torch.ones(2, 8, device=c.device)),
                                                 torch.ones(2, 8, device=c.device))
        c.close()
    else:
        with pytest.raises(ValueError, match=rf"^this rank \({dist.get_rank()}\) is not a member of the group "):
            Communicator(sub)
    dist.barrier()


@mpi
def test_check_calls_takes_a_bool(comm):
    before = comm.check_calls
    for bad in ("0", 1, None):  # bool("0") would turn the checks on
        with pytest.raises(TypeError, match="^check_calls must be a bool"):
            comm.check_calls = bad
    assert comm.check_calls is before


@mpi
def test_unknown_strategy_raises(comm, monkeypatch):
    monkeypatch.delenv("COMMFUSE_STRATEGY", raising=False)  # the env would override the argument
    with pytest.raises(ValueError, match="^strategy must be one of"):
        Communicator(comm.group, strategy="fastest")
    monkeypatch.setenv("COMMFUSE_STRATEGY", "AUTO")  # the variable named, not the argument it overrides
    with pytest.raises(ValueError, match="^COMMFUSE_STRATEGY must be one of .*, got 'AUTO'"):
        Communicator(comm.group)
    monkeypatch.setenv("COMMFUSE_STRATEGY", "nccl")  # a wrong argument is refused even where the variable rules
    with pytest.raises(ValueError, match="^strategy must be one of .*, got 'fastest'"):
        Communicator(comm.group, strategy="fastest")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", ["strategy", "COMMFUSE_GLOO_TIMEOUT_S", "COMMFUSE_NCCL_TIMEOUT_S",
                                 "COMMFUSE_CHECK on one rank", "COMMFUSE_STRATEGY on one rank",
                                 "COMMFUSE_PRETEND_NO_P2P on one rank"])
def test_a_communicator_one_rank_cannot_make_raises_on_every_rank_at_once(comm, gen, monkeypatch, bad):
    """Construction is collective: a rank whose own argument or environment is wrong, or whose settings differ
    from its peers', raises after the ranks compare them, and its peers raise naming it, within the
    construction's first collective. Before, rank 0 raised alone and its peers waited in the next collective
    for the group's timeout, which left the group's connections broken (or, for a bad COMMFUSE_GLOO_TIMEOUT_S,
    the ranks' group counts apart: every later Communicator failed; for a bad COMMFUSE_NCCL_TIMEOUT_S, the peers
    waited in NCCL's initialisation)."""
    rank = dist.get_rank(comm.group)
    for name in ("COMMFUSE_STRATEGY", "COMMFUSE_CHECK", "COMMFUSE_PRETEND_NO_P2P"):
        monkeypatch.delenv(name, raising=False)
    strategy = "auto"
    if rank == 0:
        if bad == "strategy":
            strategy = "fastest"
        elif bad in ("COMMFUSE_GLOO_TIMEOUT_S", "COMMFUSE_NCCL_TIMEOUT_S"):
            monkeypatch.setenv(bad, "10s")
        elif bad == "COMMFUSE_CHECK on one rank":
            monkeypatch.setenv("COMMFUSE_CHECK", "1")
        elif bad == "COMMFUSE_PRETEND_NO_P2P on one rank":
            monkeypatch.setenv("COMMFUSE_PRETEND_NO_P2P", "1")
        else:
            monkeypatch.setenv("COMMFUSE_STRATEGY", "nccl")
    if bad == "COMMFUSE_STRATEGY on one rank":  # the arguments are alike: the message says where it came from
        want = r"ranks disagree on strategy: rank 0: .*'strategy': 'nccl'.* \(strategy from COMMFUSE_STRATEGY\); " \
               r"rank 1: .*'strategy': 'auto'.* \(strategy from the argument\)"
    elif bad.endswith(" on one rank"):  # a boolean variable set on rank 0 alone
        name = bad.split()[0]
        want = rf"ranks disagree on {name}: rank 0: .*'{name}': True.*rank 1: .*'{name}': False"
    elif rank == 0:
        want = "^strategy must be one of" if bad == "strategy" else f"{bad} must be a number"
    else:
        want = r"a rank could not make the Communicator \(rank 0: ValueError: "
    with pytest.raises(ValueError, match=want):
        Communicator(comm.group, strategy=strategy)
    monkeypatch.undo()
    c = Communicator(comm.group)  # the group is whole and every rank in step
    x, xs = rank_inputs(c, gen, (3, 64), torch.bfloat16)
    y, want_sum = c.all_reduce(x), reference.all_reduce_sum(xs)
    assert torch.equal(y, want_sum) if exact_sum(c) else torch.allclose(y.float(), want_sum.float(), rtol=2e-2)


@pytest.mark.mpi(min_size=2)
def test_gloo_check_is_the_one_the_ranks_agreed_on(comm, gen, monkeypatch):
    """COMMFUSE_GLOO_CHECK is read and compared when the Communicator is made; changed later on one rank, it does
    not set that rank's gloo exchanges apart from its peers' (which timed out: CallTimeoutError on one rank, a
    closed connection on the other)."""
    if comm.backend != "gloo":
        pytest.skip(f"a {comm.backend} group: no gloo route")
    monkeypatch.delenv("COMMFUSE_GLOO_CHECK", raising=False)
    c = Communicator(comm.group, strategy="nccl")  # ranks sharing a GPU: the gloo route, off P2P
    c.check_calls = False
    if dist.get_rank(c.group) == 1:
        monkeypatch.setenv("COMMFUSE_GLOO_CHECK", "0")
    for shape in ((3, 64), (5, 32)):  # new signatures, planned after the change
        x, xs = rank_inputs(c, gen, shape, torch.float32)
        assert torch.equal(c.all_reduce(x), reference.all_reduce_sum(xs))


@pytest.mark.mpi(min_size=2)
def test_check_calls_set_apart_on_a_gloo_group_raise_at_the_next_call(comm, gen):
    """check_calls must be set alike on every rank. On a gloo group a rank that compares its call and a peer
    that does not meet in exchanges of one size (COMMFUSE_CHECK's is sized as the gloo route's): both raise
    CallMismatchError, where gloo used to abort the process on the sizes' mismatch; set alike again, the calls
    sum right."""
    if comm.backend != "gloo":
        pytest.skip(f"a {comm.backend} group: nothing compares a rank that checks with one that does not")
    c = Communicator(comm.group, strategy="nccl")  # ranks sharing a GPU: the gloo route, off P2P
    rank = dist.get_rank(c.group)
    x, xs = rank_inputs(c, gen, (3, 64), torch.bfloat16)
    c.check_calls = rank == 0
    with pytest.raises(commfuse.CallMismatchError, match="ranks disagree on the call"):
        c.all_reduce(x)
    for on in (False, True):
        c.check_calls = on
        y, want = c.all_reduce(x), reference.all_reduce_sum(xs)
        assert torch.equal(y, want) if exact_sum(c) else torch.allclose(y.float(), want.float(), rtol=2e-2)


@mpi
def test_env_strategy_overrides_argument(comm, monkeypatch):
    monkeypatch.setenv("COMMFUSE_STRATEGY", "nccl")
    assert Communicator(comm.group, strategy="auto").strategy == "nccl"


@mpi
def test_cached_plans_still_check_every_call(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 64), torch.bfloat16)
    residual, weight, scale = tail_inputs(comm, gen, 4, 64, torch.bfloat16, "fp8")
    good = comm.plan(x, residual, weight, quant="fp8", scale=scale)
    assert comm.plan(x, residual, weight, quant="fp8", scale=scale) == good  # one signature, one plan
    with pytest.raises(TypeError, match="weight dtype"):
        comm.plan(x, residual, weight.half(), quant="fp8", scale=scale)
    with pytest.raises(ValueError, match="eps"):
        comm.plan(x, residual, weight, eps=-1.0, quant="fp8", scale=scale)
    with pytest.raises(TypeError, match="quant must be None or one of"):
        comm.plan(x, residual, weight, quant=["fp8"], scale=scale)
    # A strided view plans as a dense x (a rank's strides are its own; the launchers read a dense copy).
    strided = torch.empty(4, 128, dtype=x.dtype, device=x.device)[:, ::2]
    assert comm.plan(strided, residual, weight, quant="fp8", scale=scale) == good


@mpi
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
def test_caller_owned_outputs_are_written_and_returned(comm, gen, quant, return_norm, sf_layout):
    """out=: every route writes the caller's tensors (poisoned first), returns them, and gives the bits
    of a call with fresh outputs; a second call of the signature reuses the validated plan; out.residual
    may be the residual input itself (updated in place)."""
    t, h, dtype = 7, 256, torch.bfloat16
    x, _ = rank_inputs(comm, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(comm, gen, t, h, dtype, quant)
    kw = dict(eps=1e-5, quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout)
    want = comm.fused_all_reduce(x, residual, weight, **kw)
    out = reference.Tail(*(None if w is None else torch.full_like(w.view(torch.uint8), 0xA5).view(w.dtype)
                           for w in (want.residual, want.norm, want.quant, want.scale_factors)))
    def written(name: str, out, result) -> None:
        """The call returned the caller's tensors, which hold a fresh call's bits; then a new poison."""
        for f in ("residual", "norm", "quant", "scale_factors"):
            mine, w = getattr(out, f), getattr(want, f)
            assert (mine is None) == (w is None), f
            if mine is not None:
                assert getattr(result, f) is mine, f"{name}: {f} is not the caller's tensor"
                assert torch.equal(mine.view(torch.uint8), w.view(torch.uint8)), f"{name}: {f} differs"
                mine.view(torch.uint8).fill_(0x5A)

    got = comm.fused_all_reduce(x, residual, weight, out=out, **kw)
    written("out=Tail", out, got)
    again = comm.fused_all_reduce(x, residual, weight, out=got, **kw)  # a FusedResult as out
    written("out=FusedResult", out, again)
    total = torch.full_like(x, float("nan"))
    plain = comm.all_reduce(x, out=total)
    assert plain is total and torch.equal(total, comm.all_reduce(x))
    in_place = out._replace(residual=residual.clone())
    written("out.residual the residual input", in_place,
            comm.fused_all_reduce(x, in_place.residual, weight, out=in_place, **kw))


@mpi
def test_caller_owned_outputs_are_checked(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 64), torch.bfloat16)
    residual, weight, scale = tail_inputs(comm, gen, 4, 64, torch.bfloat16, "fp8")
    q = torch.empty(4, 64, dtype=torch.float8_e4m3fn, device=comm.device)
    with pytest.raises(ValueError, match="out.norm must be None"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale,
                              out=reference.Tail(torch.empty_like(x), torch.empty_like(x), q, None))
    with pytest.raises(ValueError, match=r"out.quant must have shape \[4, 64\] and dtype torch.float8_e4m3fn"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale,
                              out=reference.Tail(torch.empty_like(x), None, q.view(torch.uint8), None))
    with pytest.raises(TypeError, match="out.residual must be a tensor or None"):
        comm.fused_all_reduce(x, residual, weight, out=reference.Tail(3, torch.empty_like(x), None, None))
    norm = torch.full_like(x, float("nan"))  # a field None is allocated: one rule with the local ops
    r = comm.fused_all_reduce(x, residual, weight, out=reference.Tail(None, norm, None, None))
    fresh = comm.fused_all_reduce(x, residual, weight)
    assert r.norm is norm and torch.equal(norm, fresh.norm)
    assert r.residual is not None and torch.equal(r.residual, fresh.residual)
    with pytest.raises(ValueError, match="contiguous"):
        comm.fused_all_reduce(x, residual, weight,
                              out=reference.Tail(torch.empty(64, 4, dtype=x.dtype, device=x.device).t(),
                                                 torch.empty_like(x), None, None))
    with pytest.raises(ValueError, match="out must have x's shape"):
        comm.all_reduce(x, out=torch.empty(3, 64, dtype=x.dtype, device=x.device))
    assert comm.all_reduce(x).shape == x.shape  # the group still works afterwards


SCALED = [  # (quant, scale_layout, scale_ue8m0, weight_offset)
    ("fp8_per_token", "row", False, 0.0), ("fp8_block", "row", False, 0.0), ("fp8_block", "mn_major", False, 0.0),
    ("fp8_block", "row", True, 0.0), ("fp8_block", "mn_major", True, 1.0), (None, "row", False, 1.0),
    ("fp8", "row", False, 1.0),
]


@mpi
@pytest.mark.parametrize("strategy", ["auto", "nccl"])
@pytest.mark.parametrize("quant, scale_layout, scale_ue8m0, weight_offset", SCALED)
@pytest.mark.parametrize("t, h", [(5, 384), (130, 1024)])
def test_computed_scale_fp8_and_weight_offset_on_every_route(comm, gen, strategy, quant, scale_layout, scale_ue8m0,
                                                             weight_offset, t, h):
    """Per-token and 1x128-block FP8 (computed scales, every layout) and Gemma's (1 + w) on every route:
    against reference.fused_tail of the call's all-reduced values, bit for bit on the separated route,
    within the tail tolerances (MN-major padding must be 0) on the fused ones."""
    c = comm if strategy == "auto" else Communicator(comm.group, strategy=strategy)
    dtype = torch.bfloat16
    x, _ = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, quant if quant == "fp8" else None)
    kw = dict(eps=1e-5, quant=quant, scale=scale, return_norm=True, weight_offset=weight_offset,
              scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    a = c.all_reduce(x)
    r = c.fused_all_reduce(x, residual, weight, **kw)
    ref = reference.fused_tail(a, residual, weight, 1e-5, quant, scale, True, "swizzled", weight_offset, scale_layout,
                               scale_ue8m0)
    if c.device.type != "cuda":
        assert r.plan.tail == "separated" and any("cpu" in s for s in r.plan.reasons), r.plan
        for name in ("residual", "norm", "quant", "scales"):
            got, want = getattr(r, name), getattr(ref, name)
            assert (got is None) == (want is None), name
            if got is not None:
                assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), name
                dense = [v.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8) for v in (got, want)]
                assert torch.equal(*dense), name
    else:
        assert r.plan.tail == "fused", r.plan
        if strategy == "nccl":
            assert not r.plan.collective.startswith("p2p")
        why = tolerance.tail_mismatch(r, ref, quant, "swizzled", scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
        assert why is None, why
    if quant in ("fp8_per_token", "fp8_block"):
        assert r.scales is not None and r.scale_factors is None


@mpi
def test_computed_scale_fp8_arguments_are_checked(comm, gen):
    x, _ = rank_inputs(comm, gen, (4, 200), torch.bfloat16)
    residual, weight, scale = tail_inputs(comm, gen, 4, 200, torch.bfloat16, "fp8")
    with pytest.raises(ValueError, match="multiple of 128"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8_block")
    with pytest.raises(ValueError, match="computes its scales"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8_per_token", scale=scale)
    with pytest.raises(ValueError, match="applies to quant 'fp8_block' only"):
        comm.fused_all_reduce(x, residual, weight, quant="fp8_per_token", scale_layout="mn_major")
    with pytest.raises(ValueError, match="weight_offset must be a finite float32 number"):
        comm.fused_all_reduce(x, residual, weight, weight_offset=float("nan"))
    assert comm.all_reduce(x).shape == x.shape


@mpi
def test_nccl_groups_enqueue_through_commfuse_nccl(comm):
    """On an NCCL group the NCCL route calls ncclAllReduce directly (commfuse.nccl), one communicator
    per group shared by its Communicators."""
    if comm.backend != "nccl":
        assert comm.nccl_binding.startswith("none"), comm.nccl_binding
        pytest.skip("commfuse.nccl serves NCCL groups; this group is " + comm.backend)
    if nccl.available():
        pytest.skip(nccl.available())
    assert comm.nccl_binding.startswith("commfuse.nccl (NCCL "), comm.nccl_binding
    assert Communicator(comm.group, strategy="nccl")._nccl is comm._nccl


@mpi
@pytest.mark.parametrize("missing_on", [None, 0, "last", "env"])
def test_ranks_agree_on_the_nccl_binding(comm, monkeypatch, missing_on):
    """Creating the NCCL communicator is collective: one rank without the library (or with
    COMMFUSE_NCCL=0) keeps every rank on torch.distributed, naming that rank; else all create it."""
    rank, world = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    me = world - 1 if missing_on == "last" else missing_on
    made = []

    class Fake:
        version = "9.9.9"

    monkeypatch.setattr(nccl, "available", lambda: "no libnccl here" if rank == me else None)
    monkeypatch.setattr(nccl, "shared", lambda group, device, renew: made.append(group) or Fake())
    monkeypatch.setattr(nccl, "shared_usable", lambda group, device: False)
    if missing_on == "env":
        monkeypatch.setenv("COMMFUSE_NCCL", "0" if rank == 0 else "1")
    c = object.__new__(Communicator)
    c.group, c.device = comm.group, comm.device
    commfuse.communicator.Communicator._open_nccl(c)
    if missing_on is None:
        assert made == [comm.group] and c.nccl_binding == "commfuse.nccl (NCCL 9.9.9)"
    else:
        who = 0 if missing_on == "env" else me
        why = "COMMFUSE_NCCL=0" if missing_on == "env" else "no libnccl here"
        assert made == [] and c.nccl_binding == f"torch.distributed (rank {who}: {why})", c.nccl_binding


@mpi
@pytest.mark.parametrize("failed_on", [None, 0, "last"])
def test_a_failed_nccl_communicator_is_made_anew_by_every_rank(comm, monkeypatch, failed_on):
    """A group's NCCL communicator that failed on any rank (the watchdog aborted it, a peer's error) is not handed
    to a new Communicator of the group, whose first call would raise for a call it never made: every rank makes
    the group's anew (collective), and the old one stays for the Communicators that hold it."""
    rank, world = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    me = world - 1 if failed_on == "last" else failed_on

    class Fake:
        version = "9.9.9"

        def __init__(self, group, device, failed=False):
            self.group, self.failed = group, failed

    device = torch.device("cuda", 0)  # only its index is read: the key of the process's shared communicators
    old = Fake(comm.group, device, failed=rank == me)
    monkeypatch.setitem(nccl._SHARED, (comm.group, 0), old)
    monkeypatch.setattr(nccl, "NcclComm", Fake)
    monkeypatch.setattr(nccl, "available", lambda: None)
    c = object.__new__(Communicator)
    c.group, c.device = comm.group, device
    commfuse.communicator.Communicator._open_nccl(c)
    if failed_on is None:
        assert c._nccl is old
    else:
        assert c._nccl is not old and not c._nccl.failed and nccl._SHARED[(comm.group, 0)] is c._nccl


@mpi(min_size=2)
def test_a_watchdog_that_does_not_start_on_one_rank_leaves_the_communicator_on_none(comm, monkeypatch):
    """Rank 0's watchdog cannot start (cuMemHostAlloc failing on its host, say); the others have none
    (COMMFUSE_NCCL_TIMEOUT_S=0, each rank's own). Every rank raises, none keeps the communicator, and the
    group's next Communicator makes it on every rank, rather than rank 0 alone meeting its peers' next collective."""
    from test_nccl import InitLib

    def no_watchdog(self, timeout, replays):
        raise RuntimeError("cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")

    rank, world = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    monkeypatch.setattr(nccl.NcclComm, "_watch", no_watchdog)
    monkeypatch.setattr(nccl, "library", lambda: nccl.Nccl(InitLib("ok"), "fake"))
    monkeypatch.setattr(nccl, "available", lambda: None)
    monkeypatch.setattr(nccl, "_SHARED", {})
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "10" if rank == 0 else "0")
    device = torch.device("cuda", 0)
    with pytest.raises(RuntimeError) as raised:
        nccl.shared(comm.group, device)
    if rank == 0:
        assert "cuMemHostAlloc failed" in str(raised.value), raised.value
    else:
        assert "watchdog did not start on rank 0" in str(raised.value), raised.value
    assert not nccl.shared_usable(comm.group, device)
    monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "0")
    c = object.__new__(Communicator)
    c.group, c.device = comm.group, device
    commfuse.communicator.Communicator._open_nccl(c)
    made: list = [None] * world
    dist.all_gather_object(made, c._nccl._handle, group=comm.group)
    assert made == [InitLib.HANDLE] * world


NATIVE_CASES = [  # (quant, return_norm, sf_layout, scale_layout, scale_ue8m0, weight_offset)
    (None, False, "swizzled", "row", False, 0.0), ("fp8", True, "swizzled", "row", False, 1.0),
    ("nvfp4", False, "swizzled", "row", False, 0.0), ("nvfp4", True, "linear", "row", False, 0.0),
    ("fp8_per_token", False, "swizzled", "row", False, 0.0), ("fp8_block", False, "swizzled", "mn_major", True, 0.0),
]


def _storage(v: torch.Tensor) -> torch.Tensor:
    """All of v's storage as a flat tensor (an MN-major view's padding included)."""
    return torch.as_strided(v, (v.untyped_storage().nbytes() // v.element_size(),), (1,))


def _zeros_over_storage(v: torch.Tensor) -> torch.Tensor:
    """Zeros of v's shape and strides over a storage of v's size (caller-owned outputs like v)."""
    return torch.zeros_like(_storage(v)).as_strided(v.shape, v.stride())


def _native_on(comm) -> None:
    if comm.device.type != "cuda":
        pytest.skip("the native hot path launches CUDA kernels: no GPU here")
    if os.environ.get("COMMFUSE_NATIVE") == "0":
        pytest.skip("COMMFUSE_NATIVE=0")
    # Where the extension does not build, the suite would pass on the Python launches alone: say so.
    assert native.unavailable() is None, native.unavailable()


@mpi
@pytest.mark.parametrize("strategy", ["auto", "nccl"])
@pytest.mark.parametrize("quant, return_norm, sf_layout, scale_layout, scale_ue8m0, weight_offset", NATIVE_CASES)
def test_native_launch_gives_the_python_launch_bits(comm, gen, monkeypatch, strategy, quant, return_norm, sf_layout,
                                                    scale_layout, scale_ue8m0, weight_offset):
    """The C++ Launcher and Table of a route (allocating, poisoned, or into caller-owned outputs) write the
    bits that the Python stand-ins (launch.PyLauncher, table.PyTable) write for the same LaunchPlans; the
    plain all-reduce too."""
    _native_on(comm)
    monkeypatch.setenv("COMMFUSE_P2P_CALIBRATE", "0")  # the two communicators plan alike
    c = Communicator(comm.group, strategy=strategy)
    t, h, dtype = 9, 512, torch.bfloat16
    x, _ = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, quant)
    kw = dict(eps=1e-5, quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout, weight_offset=weight_offset,
              scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    runs = poisoned_runs(lambda: (c.fused_all_reduce(x, residual, weight, **kw), c.all_reduce(x)))
    owned = c.fused_all_reduce(x, residual, weight, out=reference.Tail(*(
        None if v is None else _zeros_over_storage(v) for v in (runs[0][0].residual, runs[0][0].norm, runs[0][0].quant,
                                                                 runs[0][0].scale_factors, runs[0][0].scales))), **kw)
    c.close()
    with monkeypatch.context() as m:
        m.setattr(native, "_load", lambda: (None, "this test's Python launch"))
        py = Communicator(comm.group, strategy=strategy)
        assert isinstance(py.table, table.PyTable)
        python = (py.fused_all_reduce(x, residual, weight, **kw), py.all_reduce(x))
        py.close()
    assert type(c.table).__module__ == "commfuse_host"  # the C++ table served the first runs
    assert python[0].plan == runs[0][0].plan, (str(python[0].plan), str(runs[0][0].plan))
    for got in (runs[0], runs[1], (owned, runs[0][1])):
        for name in ("residual", "norm", "quant", "scale_factors", "scales"):
            mine, want = getattr(got[0], name), getattr(python[0], name)
            assert (mine is None) == (want is None), name
            if mine is not None:
                assert mine.shape == want.shape and mine.stride() == want.stride(), name
                assert torch.equal(_storage(mine).view(torch.uint8), _storage(want).view(torch.uint8)), name
        assert torch.equal(got[1], python[1]), "all_reduce"


@mpi
def test_native_launch_checks_the_address_of_caller_outputs(comm, gen):
    """The plan checks out= once per signature; an output of the same shape at a misaligned address
    later is refused by the launcher instead of faulting in the kernel."""
    _native_on(comm)
    t, h, dtype = 4, 256, torch.bfloat16
    x, _ = rank_inputs(comm, gen, (t, h), dtype)
    residual, weight, _ = tail_inputs(comm, gen, t, h, dtype, None)
    good = reference.Tail(torch.empty_like(x), torch.empty_like(x), None, None)
    comm.fused_all_reduce(x, residual, weight, out=good)
    store = torch.empty(t * h + 8, dtype=dtype, device=x.device)
    shifted = store[1:1 + t * h].view(t, h)  # the same shape and strides, 2 bytes off
    with pytest.raises(ValueError, match=r"out.norm must be 16-byte aligned"):
        comm.fused_all_reduce(x, residual, weight, out=reference.Tail(good.residual, shifted, None, None))
    with pytest.raises(ValueError, match=r"out must be (contiguous and )?16-byte aligned"):
        comm.all_reduce(x, out=torch.empty_like(x))  # plan the signature
        comm.all_reduce(x, out=shifted)
    assert comm.all_reduce(x).shape == x.shape  # the group still works afterwards


@mpi
def test_native_table_serves_repeated_signatures(comm, gen, monkeypatch):
    """Without the per-call cross-rank check, a signature seen before is planned and launched by the C++
    table (no Python planning at all) with the bits and the plan of its first call; other shapes,
    dtypes and arguments are not taken for it."""
    _native_on(comm)
    c = Communicator(comm.group)
    c.check_calls = False
    t, h, dtype = 6, 512, torch.bfloat16
    x, _ = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, fp8_scale = tail_inputs(c, gen, t, h, dtype, "fp8")
    nvfp4_scale = tail_inputs(c, gen, t, h, dtype, "nvfp4")[2]
    cases = [dict(), dict(quant="fp8", scale=fp8_scale, return_norm=True), dict(quant="fp8", scale=fp8_scale),
             dict(quant="nvfp4", scale=nvfp4_scale, sf_layout="linear"), dict(quant="nvfp4", scale=nvfp4_scale),
             dict(quant="fp8_block", scale_layout="mn_major", scale_ue8m0=True), dict(quant="fp8_per_token"),
             dict(quant="fp8_per_token", weight_offset=1.0), dict(eps=1e-3)]
    first = [c.fused_all_reduce(x, residual, weight, **kw) for kw in cases]
    first_sum = c.all_reduce(x)
    entries = len(c.table)
    with monkeypatch.context() as m:
        m.setattr(c, "_first", lambda *a, **k: pytest.fail("a repeated signature was planned in Python"))
        again = [c.fused_all_reduce(x, residual, weight, **kw) for kw in cases]
        again_sum = c.all_reduce(x)
    assert entries == len(cases) + 1 and len(c.table) == entries
    for kw, a, b in zip(cases, first, again):
        assert b.plan is a.plan, kw
        # The table fills the result's slots without __init__: the same class, and a complete object.
        assert type(b) is commfuse.communicator.FusedResult and repr(b).startswith("FusedResult(residual="), kw
        for name in ("residual", "norm", "quant", "scale_factors", "scales"):
            u, v = getattr(a, name), getattr(b, name)
            assert (u is None) == (v is None), (kw, name)
            if u is not None:
                assert u.shape == v.shape and u.stride() == v.stride() and u.dtype == v.dtype, (kw, name)
                assert torch.equal(_storage(u).view(torch.uint8), _storage(v).view(torch.uint8)), (kw, name)
    assert torch.equal(first_sum, again_sum)
    # Another row count, dtype or layout is another signature: planned afresh, right shapes.
    longer = torch.cat([x, x])
    r = c.fused_all_reduce(longer, torch.cat([residual, residual]), weight, quant="fp8", scale=fp8_scale)
    assert r.quant.shape == (2 * t, h) and len(c.table) == entries + 1
    half = c.fused_all_reduce(x.half(), residual.half(), weight.half())
    assert half.residual.dtype == torch.float16 and half.plan is not first[0].plan
    assert c.all_reduce(longer).shape == longer.shape
    c.close()


@mpi
def test_fused_all_reduce_needs_a_residual(comm, gen):
    """Without a residual the call's key would be a plain all-reduce's: it is refused, naming it."""
    x, _ = rank_inputs(comm, gen, (4, 64), torch.bfloat16)
    comm.all_reduce(x)  # the plain signature, cached
    with pytest.raises(TypeError, match="residual must be a tensor"):
        comm.fused_all_reduce(x, None, None)


@mpi
def test_plan_then_call_then_close(comm, gen):
    """plan() says the route without planting anything in the table (the first call does); close()
    forgets every plan (their launchers may hold the workspace or commfuse.nccl), and later calls take
    torch.distributed."""
    c = Communicator(comm.group)
    x, xs = rank_inputs(c, gen, (8, 256), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, 8, 256, torch.bfloat16, "fp8")
    p = c.plan(x, residual, weight, quant="fp8", scale=scale)
    assert len(c.table) == 0
    r = c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale)
    assert r.plan == p and c.plan(x, residual, weight, quant="fp8", scale=scale) == p and len(c.table) == 1
    before = c.all_reduce(x)
    c.close()
    assert len(c.table) == 0 and c.workspace is None
    after = c.all_reduce(x)
    if exact_sum(c):
        assert torch.equal(before, after) and torch.equal(after, reference.all_reduce_sum(xs))
    else:
        assert_within_ulp(after, reference.all_reduce_sum(xs), c.world_size, "all-reduce after close")


REFORMED = """
import sys, torch, torch.distributed as dist, commfuse
rank, folder = int(sys.argv[1]), sys.argv[2]
x = torch.full((2, 8), float(rank + 1))
sums, groups = [], []
for world in range(2):  # the same ranks twice: torch names the second world "0" again
    dist.init_process_group("gloo", init_method=f"file://{folder}/store{world}", rank=rank, world_size=2)
    comm = commfuse.Communicator()
    sums.append(comm.all_reduce(x.to(comm.device))[0, 0].item())  # a gloo group works on the GPU where there is one
    groups.append(comm._check_group)
    dist.destroy_process_group()
print(sums, groups[0] is groups[1])
"""


def test_a_world_made_again_gets_its_own_check_group(tmp_path):
    """After destroy_process_group() torch names the next world as the last one: its Communicators must not take
    the old world's check group (whose peers are the old world's: with other members, small all-reduces went
    through it and summed other processes' rows). Two processes of their own, no launcher variables."""
    import subprocess
    import sys

    from commfuse.distributed import _ENV_LAYOUTS

    environ = {k: v for k, v in os.environ.items() if not any(k in layout for layout in _ENV_LAYOUTS)}
    runs = [subprocess.Popen([sys.executable, "-c", REFORMED, str(r), str(tmp_path)], env=environ, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        for run in runs:
            out, err = run.communicate(timeout=240)
            assert run.returncode == 0, err[-3000:]
            assert out.split() == ["[3.0,", "3.0]", "False"], out
    finally:
        for run in runs:
            run.kill()
            run.wait()


EXIT = """
import gc, weakref, torch, torch.distributed as dist, commfuse
from commfuse import communicator
commfuse.init_distributed(backend="gloo")
comm = commfuse.Communicator()
comm.fused_all_reduce(torch.randn(2, 64), torch.randn(2, 64), torch.ones(64))
groups = [weakref.ref(comm.group), weakref.ref(comm._check_group)]
sub = dist.new_group([0], backend="gloo")  # a Communicator of a group the caller destroyed before exit
dropped = commfuse.Communicator(sub)
dropped.all_reduce(torch.randn(2, 8))
dropped_check = weakref.ref(dropped._check_group)
dist.destroy_process_group(sub)
del dropped, sub
gc.collect()
import os
os.environ["COMMFUSE_GLOO_TIMEOUT_S"] = "abc"
try:  # a Communicator whose construction raised, kept alive by the exception
    commfuse.Communicator()
except ValueError as e:
    kept = e
communicator._drop_gloo_groups()  # the exit handlers, in either order
print("dropped's check group destroyed", dropped_check() not in dist.distributed_c10d._world.pg_map)
dist.destroy_process_group()
gc.collect()
print("alive", sum(g() is not None for g in groups))
"""


CYCLE_AT_EXIT = """
import gc, weakref, commfuse, torch.distributed as dist
from commfuse import communicator
gc.disable()  # the garbage collector runs at thresholds of allocations: only at exit here, as after a short run
commfuse.init_distributed(backend="gloo")
class Frame:  # a stand-in for an exception's traceback frame holding a launcher and its gloo group
    pass
held = Frame()
held.cycle, held.group = held, dist.group.WORLD
world = weakref.ref(dist.group.WORLD)
del held
dist.destroy_process_group()  # init_distributed's exit handler, then commfuse's
communicator._drop_gloo_groups()
print("world alive", world() is not None)
"""


def test_gloo_groups_that_reference_cycles_hold_go_at_exit_too():
    """A refused call's exception kept frames holding gloo groups in a reference cycle, which only the interpreter's
    finalization collected, where a gloo group's thread can abort the process ("terminate called without an active
    exception", 11 of 30 runs of a 2-rank script catching a MoE call's RowIndexError). commfuse's exit handler
    collects them while Python still runs. Its own process: world 1, gloo."""
    import subprocess
    import sys

    from processes import single_process_env

    done = subprocess.run([sys.executable, "-c", CYCLE_AT_EXIT], env=single_process_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world alive False" in done.stdout, done.stdout


def test_gloo_groups_are_let_go_of_at_exit():
    """A gloo group alive at interpreter finalization can abort the process after a clean run: at exit commfuse
    keeps none alive (neither the Communicator, which stays in the caller's globals, nor init_distributed's
    exit handler). Its own process: world 1, gloo, no launcher variables."""
    import subprocess
    import sys

    from commfuse.distributed import _ENV_LAYOUTS

    environ = {k: v for k, v in os.environ.items() if not any(k in layout for layout in _ENV_LAYOUTS)}
    done = subprocess.run([sys.executable, "-c", EXIT], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "alive 0" in done.stdout and "dropped's check group destroyed True" in done.stdout, done.stdout
