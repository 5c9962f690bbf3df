"""Communicator.moe_all_reduce (and its op) on every rank against commfuse.reference: each rank's
expert combine (reference.moe_reduce / moe_finalize), the all-reduce of the combined rows, then the
tail. Each rank generates every rank's inputs from one seeded generator and keeps its own, so the
reference sees exactly the gathered inputs; all collectives of a test come before its assertions."""
import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import ops, reference
from commfuse.kernels import launch
from commfuse.reference import Tail
from commfuse.tail.spec import TailSpec, code

from compare import assert_tail_close, bits_equal
from conftest import error_cycle
from inputs import tail_inputs

mpi = pytest.mark.mpi(min_size=1)
PATTERNS = [(None, False, "swizzled"), ("fp8", True, "swizzled"), ("nvfp4", False, "swizzled"),
            ("nvfp4", True, "linear"), ("fp8_per_token", False, "swizzled")]


def exact_sum(comm) -> bool:
    return comm.backend != "nccl" or comm.world_size <= 2  # as tests/test_communicator.py


def moe_inputs(comm, gen, t, k, h, dtype, form, weights_dtype, with_shared, index_dtype=torch.int32):
    """Every rank's (y, weights, row_index, shared) and this rank's index: y [t, k, h] (reduction) or
    permuted rows [t*k + 3, h] with a row_index of index_dtype that drops one slot (finalize); the padding
    rows and the dropped slot's row hold NaN, which must change nothing."""
    per_rank = []
    for _ in range(comm.world_size):
        w = torch.rand(t, k, generator=gen).to(weights_dtype)
        shared = torch.randn(t, h, generator=gen).to(dtype) if with_shared else None
        if form == "reduction":
            y, idx = torch.randn(t, k, h, generator=gen).to(dtype), None
        else:
            rows = torch.randn(t * k + 3, h, generator=gen)
            idx = torch.randperm(t * k, generator=gen)[: t * k].view(t, k)
            dropped = int(idx[t // 2, k - 1])
            idx[t // 2, k - 1] = -1
            rows[dropped] = float("nan")
            rows[t * k:] = float("nan")
            y, idx = rows.to(dtype), idx.to(index_dtype)
        per_rank.append(tuple(None if v is None else v.to(comm.device) for v in (y, w, idx, shared)))
    return per_rank, dist.get_rank(comm.group)


def combined(y, w, idx, shared):
    return reference.moe_reduce(y, w, shared) if idx is None else reference.moe_finalize(y, idx, w, shared)


@mpi
@pytest.mark.parametrize("form", ["reduction", "finalize"])
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, k, h, weights_fp32, with_shared, index_dtype", [(5, 2, 256, True, False, torch.int32),
                                                                          (3, 8, 128, False, True, torch.int64)])
def test_moe_all_reduce_matches_reference(comm, gen, form, quant, return_norm, sf_layout, dtype, t, k, h,
                                          weights_fp32, with_shared, index_dtype):
    """Every route and format, both forms, float32 and T routing weights, int32 and int64 row indices (the
    kernels read both as given)."""
    per_rank, rank = moe_inputs(comm, gen, t, k, h, dtype, form, torch.float32 if weights_fp32 else dtype,
                                with_shared, index_dtype)
    residual, weight, scale = tail_inputs(comm, gen, t, h, dtype, quant)
    y, w, idx, shared = per_rank[rank]
    saved = [v.clone() for v in (y, w, idx, shared, residual, weight) if v is not None]
    r = comm.moe_all_reduce(y, w, residual, weight, 1e-5, quant, scale, return_norm, sf_layout, row_index=idx,
                            shared=shared)
    a = comm.all_reduce(combined(y, w, idx, shared))
    after = [v for v in (y, w, idx, shared, residual, weight) if v is not None]
    assert all(bits_equal(b, v) for b, v in zip(saved, after)), "moe_all_reduce modified an input"  # NaN rows too
    if comm.device.type == "cuda":  # world 1 and the P2P route: the combine in the kernel that reads the rows
        fused = (comm.world_size == 1 and comm.strategy != "nccl") or r.plan.collective.algorithm is not None
        assert r.plan.combine == ("fused" if fused else "kernel"), str(r.plan)
    else:
        assert r.plan.combine == "separated" and any(s.startswith("combine: tensors on cpu") for s in r.plan.reasons)
    # The tail against the reference fed the same all-reduced sum; the sum against every rank's combine.
    ref = reference.fused_tail(a, residual, weight, 1e-5, quant, scale, return_norm, sf_layout)
    assert_tail_close(r, ref, quant, sf_layout, exact=r.plan.tail == "separated",
                      norm=reference.fused_tail(a, residual, weight, 1e-5).norm, scale=scale)
    if exact_sum(comm):
        full = reference.fused_tail(reference.all_reduce_sum([combined(*p) for p in per_rank]), residual, weight,
                                    1e-5, quant, scale, return_norm, sf_layout)
        assert torch.equal(r.residual, full.residual)
    assert not torch.isnan(r.residual.float()).any(), "a dropped slot's or padding row's NaN reached the sum"


@mpi
def test_moe_plan_and_caller_outputs(comm, gen):
    """out= as for fused_all_reduce: written and returned; an out tensor overlapping y raises on every rank;
    the combine shows in the plan's text."""
    t, k, h = 4, 2, 128
    (per_rank, rank) = moe_inputs(comm, gen, t, k, h, torch.bfloat16, "reduction", torch.float32, False)
    y, w, _, _ = per_rank[rank]
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    plain = comm.moe_all_reduce(y, w, residual, weight)
    out = Tail(torch.full_like(residual, float("nan")), torch.full_like(residual, float("nan")), None, None, None)
    got = comm.moe_all_reduce(y, w, residual, weight, out=out)
    with pytest.raises(ValueError, match="out.norm overlaps y"):
        comm.moe_all_reduce(y, w, residual, weight, out=Tail(None, y.view(-1)[: t * h].view(t, h), None, None, None))
    assert got.residual is out.residual and got.norm is out.norm
    # Against the reference's tail of the group's sum (exact where the sum is: test_moe_matches_reference).
    want = reference.fused_tail(comm.all_reduce(combined(y, w, None, None)), residual, weight, 1e-6)
    for mine in (got, plain):  # the caller's outputs, and the call's own
        assert_tail_close(mine, want, None, exact=mine.plan.tail == "separated")
    assert str(plain.plan).startswith(f"{plain.plan.combine} combine + "), str(plain.plan)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["reduction", "finalize"])
def test_one_ranks_out_overlapping_y_on_a_planned_call_keeps_the_gloo_route_in_step(comm, quiet_comm, gen, form):
    """On the gloo route a rank whose out.norm overlaps its y on a planned signature (the plan table's key holds
    no addresses) raises ValueError after the exchange, as the dense route's checks do: its peers get the right
    sums, nothing of that rank's out is written, and the next call sums right on every rank. Raised before the
    exchange, its peers' exchange would pair with its next call: a sum of two steps' rows. With COMMFUSE_CHECK
    the comparison carries the refusal: the other ranks raise CallMismatchError naming it."""
    if comm.backend != "gloo" or quiet_comm.workspace is not None:
        pytest.skip("the gloo route (a rank raising before an NCCL or P2P collective leaves its peers to the timeout)")
    t, k, h = 4, 2, 64
    for c in (comm, quiet_comm):  # with COMMFUSE_CHECK's comparison, and with the exchange's alone
        residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
        steps = [moe_inputs(c, gen, t, k, h, torch.bfloat16, form, torch.float32, False) for _ in range(3)]
        for step, (per_rank, rank) in enumerate(steps):
            y, w, idx, _ = per_rank[rank]
            norm = torch.full_like(residual, float("nan"))
            if step == 1 and rank == 1:
                norm = y.view(-1)[: t * h].view(t, h)
            before = y.clone()
            want = reference.fused_tail(reference.all_reduce_sum([combined(*r) for r in per_rank]), residual, weight,
                                        1e-6)
            if step == 1 and rank == 1:
                with pytest.raises(ValueError, match="out.norm overlaps y"):
                    c.moe_all_reduce(y, w, residual, weight, row_index=idx, out=Tail(None, norm, None, None, None))
                assert bits_equal(y, before)
                continue
            if step == 1 and c.check_calls:
                with pytest.raises(commfuse.CallMismatchError, match="refused ValueError: out.norm overlaps y"):
                    c.moe_all_reduce(y, w, residual, weight, row_index=idx, out=Tail(None, norm, None, None, None))
                continue
            got = c.moe_all_reduce(y, w, residual, weight, row_index=idx, out=Tail(None, norm, None, None, None))
            assert got.norm is norm and bits_equal(norm, want.norm), f"step {step}"


@pytest.mark.mpi(min_size=2)
def test_a_combine_that_raises_on_one_rank_keeps_the_ranks_in_step(comm, quiet_comm, gen, monkeypatch):
    """A rank whose combine raises (an error no check foresaw, as torch refusing an input) raises it after taking
    part in the call's exchanges as a refusal: its peers raise CallMismatchError naming it, with COMMFUSE_CHECK's
    comparison and with the gloo exchange's alone, and the next call sums right on every rank. Raised before the
    exchange, the peers' exchange paired with that rank's next call: a sum of two steps' rows."""
    if comm.backend != "gloo" or quiet_comm.workspace is not None:
        pytest.skip("the gloo route (a rank raising before an NCCL or P2P collective leaves its peers to the timeout)")
    import commfuse.moe

    t, k, h = 4, 2, 64
    for c in (comm, quiet_comm):
        residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
        for form in ("reduction", "finalize"):
            steps = [moe_inputs(c, gen, t, k, h, torch.bfloat16, form, torch.float32, False) for _ in range(2)]
            for step, (per_rank, rank) in enumerate(steps):
                y, w, idx, _ = per_rank[rank]
                if step == 0:
                    if rank == 1:
                        def fails(*args):
                            raise RuntimeError("combine failed")
                        monkeypatch.setattr(commfuse.moe, "combine", fails)
                        with pytest.raises(RuntimeError, match="^combine failed$"):
                            c.moe_all_reduce(y, w, residual, weight, row_index=idx)
                        monkeypatch.undo()
                    else:
                        with pytest.raises(commfuse.CallMismatchError, match="RuntimeError: combine failed"):
                            c.moe_all_reduce(y, w, residual, weight, row_index=idx)
                    continue
                want = reference.fused_tail(reference.all_reduce_sum([combined(*r) for r in per_rank]), residual,
                                            weight, 1e-6)
                assert bits_equal(c.moe_all_reduce(y, w, residual, weight, row_index=idx).residual, want.residual)


@pytest.mark.mpi(min_size=2)
def test_moe_inputs_from_inference_mode_with_weights_that_require_grad(comm, gen):
    """The ops are outside autograd on every route: an inference-mode y with routing weights that require grad
    (the separated combine used to record them for backward, which torch refuses for inference tensors) sums
    as any inputs, and no output gains a history."""
    t, k, h = 4, 2, 64
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    per_rank, rank = moe_inputs(comm, gen, t, k, h, torch.bfloat16, "reduction", torch.float32, False)
    y, w, _, _ = per_rank[rank]
    with torch.inference_mode():
        frozen = y.clone()
    got = comm.moe_all_reduce(frozen, w.clone().requires_grad_(), residual, weight)
    want = reference.fused_tail(reference.all_reduce_sum([combined(*r) for r in per_rank]), residual, weight, 1e-6)
    assert not got.residual.requires_grad and bits_equal(got.residual, want.residual)


@mpi
def test_moe_disable_fusion_separates_the_combine(comm, gen, monkeypatch):
    """COMMFUSE_DISABLE_FUSION=1 reaches the combine as every tail: reference ops (plan.combine "separated",
    saying why), whose bits equal the reference's and which raise on a row index outside [-1, R) on every
    rank, before the collective."""
    import commfuse

    monkeypatch.setenv("COMMFUSE_DISABLE_FUSION", "1")
    separated = commfuse.Communicator(comm.group)
    t, k, h = 6, 4, 256
    per_rank, rank = moe_inputs(comm, gen, t, k, h, torch.bfloat16, "finalize", torch.float32, True)
    y, w, idx, shared = per_rank[rank]
    residual, weight, scale = tail_inputs(comm, gen, t, h, torch.bfloat16, "fp8")
    r = separated.moe_all_reduce(y, w, residual, weight, 1e-5, "fp8", scale, True, row_index=idx, shared=shared)
    assert (r.plan.combine, r.plan.tail) == ("separated", "separated"), str(r.plan)
    assert "combine: COMMFUSE_DISABLE_FUSION=1: separated ops" in r.plan.reasons, r.plan.reasons
    a = comm.all_reduce(combined(y, w, idx, shared))
    assert_tail_close(r, reference.fused_tail(a, residual, weight, 1e-5, "fp8", scale, True), "fp8", "swizzled",
                      exact=True)
    bad = idx.clone()
    bad[0, 0] = y.shape[0]
    with pytest.raises(ValueError, match="row_index"):
        separated.moe_all_reduce(y, w, residual, weight, 1e-5, "fp8", scale, True, row_index=bad, shared=shared)


def test_moe_plan_names_disable_fusion_first():
    """moe.plan: with fusion disabled the combine is separated for that reason, on any device."""
    from commfuse import moe
    from commfuse.routes import Machine

    y, w = torch.empty(4, 2, 64, dtype=torch.bfloat16), torch.empty(4, 2)  # only their metadata is read
    assert moe.plan(y, w, Machine("local", sm=(9, 0), fusion=False)) == \
        ("separated", "combine: COMMFUSE_DISABLE_FUSION=1: separated ops")
    assert moe.plan(y, w, Machine("local", sm=(9, 0)))[1].startswith("combine: tensors on cpu")


def test_one_rank_forced_to_nccl_keeps_the_combine_out_of_the_tail():
    """strategy="nccl" is the fallback row for a MoE call of one rank too (as for a dense one): the combine, NCCL's
    all-reduce, the tail; without it one kernel may take the call, and at world size 2 none is tried."""
    from commfuse import moe
    from commfuse.routes import Machine

    y, w, residual, weight = torch.empty(4, 2, 64), torch.empty(4, 2), torch.empty(4, 64), torch.empty(64)

    def why(**machine):
        return moe.fused_rejects(y, w, residual, weight, None, TailSpec.of(None),
                                 Machine("fallback", "nccl", (9, 0), **machine))

    assert why(world_size=1, strategy="nccl") == "strategy 'nccl': the combine, NCCL's all-reduce, then the tail"
    assert why(world_size=1).startswith("moe_tail: tensors on cpu")  # the next guard: CUDA tensors
    assert why(world_size=2).startswith("world size 2")


@mpi
@pytest.mark.parametrize("form", ["reduction", "finalize"])
def test_moe_repeated_signature_is_served_from_the_table(comm, gen, monkeypatch, form):
    """A signature's second call is launched from the plan table (no Python checks or planning: they are
    made to fail here) on the one-launch routes: the first call's bits, every output written (poisoned),
    the caller's outputs filled, T weights and int64 indices read as on a miss; an output overlapping
    y still raises, naming it."""
    from commfuse import communicator

    if comm.device.type != "cuda":
        pytest.skip("the one-launch MoE routes need CUDA tensors: on the CPU every call is planned")
    t, k, h = 6, 4, 512
    per_rank, rank = moe_inputs(comm, gen, t, k, h, torch.bfloat16, form, torch.bfloat16, True)
    y, w, idx, shared = per_rank[rank]
    idx = None if idx is None else idx.long()
    residual, weight, scale = tail_inputs(comm, gen, t, h, torch.bfloat16, "nvfp4")

    def call(out=None):
        return comm.moe_all_reduce(y, w, residual, weight, 1e-5, "nvfp4", scale, True, row_index=idx, shared=shared,
                                   out=out)

    first = call()
    if first.plan.combine != "fused":
        pytest.skip(f"this route combines before the collective ({first.plan}): planned every call")
    names = ("residual", "norm", "quant", "scale_factors")
    call(Tail(*(torch.empty_like(getattr(first, n)) for n in names), None))  # the caller-outputs signature's first
    entries = len(comm.table)

    def planned(*args, **kw):
        raise AssertionError("a repeated MoE signature was planned in Python")

    monkeypatch.setattr(communicator.checks, "moe", planned)
    launch.set_poison(0xFF)
    try:
        again = call()
        fill = Tail(*(torch.full_like(getattr(first, n), 7) for n in names), None)
        got = call(fill)
        with pytest.raises(ValueError, match="out.norm overlaps y"):
            call(Tail(fill.residual, y.view(-1)[: t * h].view(t, h), fill.quant, fill.scale_factors, None))
    finally:
        launch.set_poison(None)
    assert len(comm.table) == entries and again.plan is first.plan
    assert all(getattr(got, n) is getattr(fill, n) for n in names)
    for name in names:
        assert bits_equal(getattr(again, name), getattr(first, name)), name
        assert bits_equal(getattr(got, name), getattr(first, name)), name


@mpi
def test_moe_op_kernel_serves_planned_calls_in_cpp(quiet_comm, gen, monkeypatch):
    """On CUDA, torch.ops.commfuse.moe_all_reduce is a C++ kernel: a signature the communicator planned on a
    one-launch route runs without the Python kernel, with the direct call's bits; one not planned yet goes
    to the Python kernel, which plans it."""
    c = quiet_comm
    if c.device.type != "cuda":
        pytest.skip("the C++ op kernels are CUDA kernels: no GPU here")
    t, k, h = 3, 8, 256
    per_rank, rank = moe_inputs(c, gen, t, k, h, torch.bfloat16, "finalize", torch.float32, True)
    y, w, idx, shared = per_rank[rank]
    residual, weight, scale = tail_inputs(c, gen, t, h, torch.bfloat16, "fp8")
    args = (y, w, idx, shared, residual, weight, scale, 1e-5, 0.0, code("fp8", True), c.name)

    class PythonKernelCalled(Exception):
        pass

    def refuse(*a, **kw):
        raise PythonKernelCalled()

    with monkeypatch.context() as m:
        m.setattr(ops, "_moe_all_reduce", refuse)
        with pytest.raises(PythonKernelCalled):
            torch.ops.commfuse.moe_all_reduce(*args)
    first = torch.ops.commfuse.moe_all_reduce(*args)  # the Python kernel plans it
    direct = c.moe_all_reduce(y, w, residual, weight, 1e-5, "fp8", scale, True, row_index=idx, shared=shared)
    if direct.plan.combine != "fused":
        pytest.skip(f"this route combines before the collective ({direct.plan}): the Python kernel plans every call")
    with monkeypatch.context() as m:
        m.setattr(ops, "_moe_all_reduce", refuse)
        again = torch.ops.commfuse.moe_all_reduce(*args)
    assert len(first) == len(again) == 3  # residual, norm, quant
    for u, v, d in zip(first, again, (direct.residual, direct.norm, direct.quant)):
        assert bits_equal(u, v) and bits_equal(v, d)


@mpi
def test_moe_bad_arguments_raise_naming_them(comm, gen):
    """Checked on every rank before any collective: the group still works afterwards."""
    t, k, h = 4, 2, 64
    dev = comm.device
    y = torch.randn(t, k, h, generator=gen).bfloat16().to(dev)
    w = torch.rand(t, k, generator=gen).to(dev)
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    cases = [
        (ValueError, "y must be \\[t, k, h\\]", dict(y=y[:, 0])),
        (ValueError, "weights must have shape \\[t, k\\]", dict(w=w[:, :1])),
        (TypeError, "weights must be float32 or y's dtype", dict(w=w.half())),
        (ValueError, "shared must have shape", dict(shared=residual[:1])),
        (TypeError, "shared dtype", dict(shared=residual.half())),
        (TypeError, "row_index must be int32 or int64", dict(y=y.view(t * k, h), row_index=w)),
        (ValueError, "residual must have shape \\[t, h\\]", dict(residual=residual[:2])),
        (TypeError, "y must be a torch.Tensor", dict(y=[1.0])),
        (TypeError, "residual must be a torch.Tensor", dict(residual=None)),
        (TypeError, "^residual dtype torch.float16 must match y dtype torch.bfloat16", dict(residual=residual.half())),
        (TypeError, "^y must be float16, bfloat16 or float32, got torch.float64", dict(y=y.double())),
    ]
    for err, match, kw in cases:
        args = dict(y=y, w=w, residual=residual, row_index=None, shared=None)
        args.update(kw)
        with pytest.raises(err, match=match):
            comm.moe_all_reduce(args["y"], args["w"], args["residual"], weight, row_index=args["row_index"],
                                shared=args["shared"])
    with pytest.raises(TypeError, match="weight dtype torch.float16 must match residual dtype"):
        comm.moe_all_reduce(y, w, residual, weight.half())
    with pytest.raises(ValueError, match="scale is on meta, but this communicator works on"):  # no x to name
        comm.moe_all_reduce(y, w, residual, weight, quant="fp8", scale=torch.ones(1, device="meta"))
    if dev.type == "cpu":  # the reference reads the indices; the kernel makes the token's row NaN instead
        bad = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 8]], dtype=torch.int32, device=dev)  # row 8 of 8 rows
        with pytest.raises(ValueError, match="row_index must hold rows in \\[-1, 8\\)"):
            comm.moe_all_reduce(y.view(t * k, h), w, residual, weight, row_index=bad)
    ones = torch.ones(2, 64, device=dev)
    assert torch.equal(comm.all_reduce(ones), torch.full((2, 64), float(comm.world_size), device=dev))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["shared", "k", "form", "weights dtype", "fused op", "row index"])
@pytest.mark.parametrize("compared_by", ["COMMFUSE_CHECK", "the gloo exchange"])
def test_moe_calls_that_differ_raise_on_every_rank(comm, quiet_comm, gen, differ, compared_by):
    """Where the ranks compare calls (the gloo route's exchange; COMMFUSE_CHECK's on every route) a MoE call
    whose combine differs on one rank (rank 1) raises CallMismatchError on every rank, naming each rank's
    combine, and so does one rank's row index out of range: in step, so that the next call sums right."""
    if compared_by == "the gloo exchange":
        if comm.backend != "gloo" or quiet_comm.workspace is not None:
            pytest.skip("the gloo route's exchange: a gloo group's, without P2P (whose kernels compare the dense "
                        "message, not the combine)")
        comm = quiet_comm  # no COMMFUSE_CHECK: the exchange alone compares
    elif not comm.check_calls:
        pytest.skip("COMMFUSE_CHECK=0")
    if differ == "row index" and comm.device.type == "cuda":
        pytest.skip("the combine kernel makes the token's row NaN instead of reading the indices")
    t, k, h = 4, 2, 64
    dev = comm.device
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    y = torch.randn(t, k, h, generator=gen).bfloat16().to(dev)
    w = torch.rand(t, k, generator=gen).to(dev)
    kw = {}
    if differ == "row index":  # every rank the finalize form; rank 1's last slot reads row t * k of t * k rows
        y = y.view(t * k, h)
        kw["row_index"] = torch.arange(t * k, dtype=torch.int32, device=dev).view(t, k).flip(0).contiguous()
    if dist.get_rank(comm.group) == 1:
        if differ == "shared":
            kw["shared"] = residual.clone()
        elif differ == "k":
            y, w = y.repeat(1, 2, 1), w.repeat(1, 2)
        elif differ == "form":
            y, kw["row_index"] = y.view(t * k, h), torch.arange(t * k, dtype=torch.int32, device=dev).view(t, k)
        elif differ == "weights dtype":
            w = w.bfloat16()
        elif differ == "row index":
            kw["row_index"][0, 0] = t * k
    with pytest.raises(commfuse.CallMismatchError, match="moe_combine\\(y torch.bfloat16") as raised:
        if differ == "fused op" and dist.get_rank(comm.group) == 1:
            comm.fused_all_reduce(y.sum(1), residual, weight)
        else:
            comm.moe_all_reduce(y, w, residual, weight, **kw)
    cycle = error_cycle(raised.value)  # the MoE launcher's frame held the combine's RowIndexError
    ones = torch.ones(2, 64, device=dev)
    assert torch.equal(comm.all_reduce(ones), torch.full((2, 64), float(comm.world_size), device=dev))
    assert cycle is None, cycle


@mpi
def test_the_separated_combine_reads_the_row_indices_once(comm, gen, monkeypatch):
    """The reference's combine reads the indices to check them (on a GPU a synchronisation): once a call, as
    docs/semantics.md says, not once for the launcher's check and again for the combine's."""
    t, k, h = 3, 2, 64
    y = torch.randn(8, h, generator=gen).bfloat16().to(comm.device)
    w = torch.rand(t, k, generator=gen).to(comm.device)
    idx = torch.randint(-1, 8, (t, k), generator=gen).to(comm.device)
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    first = comm.moe_all_reduce(y, w, residual, weight, row_index=idx)  # planned: the next call is the table's
    if first.plan.combine != "separated":
        pytest.skip(f"the combine runs as a kernel here ({first.plan.combine}), which reads no index on the host")
    reads = []
    read = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(self.shape) or read(self))
    got = comm.moe_all_reduce(y, w, residual, weight, row_index=idx)
    monkeypatch.undo()
    assert len(reads) == 1 and got.plan.combine == "separated", (reads, got.plan)


@pytest.mark.mpi(min_size=2)
def test_moe_row_index_out_of_range_without_the_gloo_check_gives_nan(comm, gen, monkeypatch):
    """COMMFUSE_GLOO_CHECK=0 (no signature in the gloo exchange): a rank whose row index is out of range raises
    ValueError after the exchange, and its NaN rows make its peers' sums NaN rather than a plausible wrong sum."""
    if comm.backend != "gloo" or comm.device.type == "cuda":
        pytest.skip("the gloo route's exchange with the reference's combine (the combine kernel makes the token's "
                    "row NaN instead of reading the indices)")
    import commfuse

    monkeypatch.setenv("COMMFUSE_GLOO_CHECK", "0")
    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    t, k, h = 4, 2, 64
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    y = torch.randn(t * k, h, generator=gen).bfloat16()
    w = torch.rand(t, k, generator=gen)
    index = torch.arange(t * k, dtype=torch.int32).view(t, k)
    if dist.get_rank(c.group) == 1:
        index[2, 1] = t * k
        with pytest.raises(ValueError, match="row_index must hold rows in \\[-1, 8\\)"):
            c.moe_all_reduce(y, w, residual, weight, row_index=index)
    else:
        r = c.moe_all_reduce(y, w, residual, weight, row_index=index)
        assert bool(r.residual.isnan().all()), r.residual


@mpi
@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_compiled_moe_op_matches_eager_call(quiet_comm, gen, quant):
    """The op inside torch.compile (one graph for every token count) gives the Communicator call's bits."""
    c = quiet_comm
    torch._dynamo.reset()

    def layer(y, w, idx, residual, weight, scale):
        return ops.moe_all_reduce(c, y, w, residual, weight, quant=quant, scale=scale, return_norm=True,
                                  row_index=idx)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True,
                             backend="inductor" if c.device.type == "cuda" else "aot_eager")
    for i, t in enumerate((3, 130, 17)):
        per_rank, rank = moe_inputs(c, gen, t, 2, 256, torch.bfloat16, "finalize", torch.float32, False)
        y, w, idx, _ = per_rank[rank]
        residual, weight, scale = tail_inputs(c, gen, t, 256, torch.bfloat16, quant)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(y, w, idx, residual, weight, scale)
        want = c.moe_all_reduce(y, w, residual, weight, quant=quant, scale=scale, return_norm=True, row_index=idx)
        for name in ("residual", "norm", "quant", "scale_factors"):
            assert bits_equal(getattr(got, name), getattr(want, name)), f"t={t}: {name}"


@mpi
@pytest.mark.parametrize("form, quant", [("reduction", None), ("finalize", "fp8"), ("finalize", "nvfp4")])
def test_opcheck_moe_all_reduce(quiet_comm, gen, form, quant):
    """torch.library's checks of the schema and the fake against the kernel (sizes and strides: compiled code
    does not re-check the outputs, commfuse.fusion.lowering)."""
    c = quiet_comm
    per_rank, rank = moe_inputs(c, gen, 5, 2, 128, torch.bfloat16, form, torch.float32, True)
    y, w, idx, shared = per_rank[rank]
    residual, weight, scale = tail_inputs(c, gen, 5, 128, torch.bfloat16, quant)
    torch.library.opcheck(torch.ops.commfuse.moe_all_reduce.default,
                          (y, w, idx, shared, residual, weight, scale, 1e-6, 0.0, code(quant, True), c.name))


def test_kernel_fields_name_the_weights_dtype():
    """The MoE kernels' combine fields: weights_f32 1 for float32 weights, 0 for y's dtype; any other weights
    dtype (which the kernels would misread as T) raises ValueError naming it."""
    from commfuse.kernels import moe_combine

    assert moe_combine.fields(3, 8, 64, 24, torch.float32, torch.bfloat16)[5:] == (3, 8, 64, 24, 1, 0)
    assert moe_combine.fields(3, 8, 64, 0, torch.bfloat16, torch.bfloat16)[5:] == (3, 8, 64, 0, 0, 0)
    with pytest.raises(ValueError, match="torch.float16"):
        moe_combine.fields(3, 8, 64, 0, torch.float16, torch.bfloat16)


def test_moe_op_fake_gives_the_output_shapes():
    """The fake (meta) op: fused_all_reduce's outputs of [t, h], t from the routing weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        rows = torch.empty(40, 256, dtype=torch.bfloat16)
        idx = torch.empty(9, 4, dtype=torch.int32)
        outs = torch.ops.commfuse.moe_all_reduce(rows, torch.empty(9, 4), idx, None,
                                                 torch.empty(9, 256, dtype=torch.bfloat16),
                                                 torch.empty(256, dtype=torch.bfloat16), torch.empty(1), 1e-6, 0.0,
                                                 code("nvfp4", True, "linear"), "commfuse-none")
    assert [tuple(o.shape) for o in outs] == [(9, 256), (9, 256), (9, 128), (9, 16)]
    assert outs[2].dtype == torch.uint8 and outs[3].dtype == torch.float8_e4m3fn


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the combine kernel is a CUDA kernel: no GPU here")


@needs_gpu
@pytest.mark.parametrize("form", ["reduction", "int32", "int64"])
@pytest.mark.parametrize("dtype, weights_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("t, k, h, with_shared", [(1, 2, 4096, False), (37, 8, 7168, True), (300, 4, 2880, True),
                                                   (5, 1, 8, False)])
def test_combine_kernel_gives_the_reference_bits(form, dtype, weights_dtype, t, k, h, with_shared):
    """moe.combine's kernel route against reference.moe_reduce / moe_finalize, bit for bit: NaN in the
    padding rows and in a dropped slot's row, -0.0 products (a -0.0 sum stays -0.0 only with shared -0.0)."""
    from commfuse import moe
    from commfuse.routes import Machine
    from compare import poisoned_runs

    gen = torch.Generator().manual_seed(t * 131 + k * 7 + h)
    w = torch.rand(t, k, generator=gen)
    w[0, 0] = -0.0
    w = w.to(weights_dtype).cuda()
    shared = torch.randn(t, h, generator=gen).to(dtype).cuda() if with_shared else None
    if form == "reduction":
        y, idx = (torch.randn(t, k, h, generator=gen) * 50).to(dtype).cuda(), None
    else:
        rows = torch.randn(t * k + 5, h, generator=gen) * 50
        perm = torch.randperm(t * k, generator=gen).view(t, k)
        rows[int(perm[t - 1, k - 1])] = float("nan")
        perm[t - 1, k - 1] = -1
        rows[t * k:] = float("nan")
        y, idx = rows.to(dtype).cuda(), perm.to(getattr(torch, form)).cuda()
    assert moe.plan(y, w, Machine.local(y.device)) == ("kernel", None)
    want = reference.moe_reduce(y, w, shared) if idx is None else reference.moe_finalize(y, idx, w, shared)
    for got in poisoned_runs(lambda: moe.combine(y, w, idx, shared, "kernel")):
        assert bits_equal(got, want)


@needs_gpu
def test_combine_kernel_makes_a_bad_row_index_nan():
    """A row index outside [-1, R) is read on the device: that token's row is NaN, the others exact."""
    from commfuse import moe

    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(8, 64, generator=gen).bfloat16().cuda()
    w = torch.rand(4, 2, generator=gen).cuda()
    idx = torch.tensor([[0, 1], [2, 3], [4, 8], [6, -2]], dtype=torch.int32).cuda()
    got = moe.combine(rows, w, idx, None, "kernel")
    assert torch.isnan(got[2:].float()).all()
    assert bits_equal(got[:2], reference.moe_finalize(rows, idx[:2], w[:2]))


@mpi
@pytest.mark.parametrize("quant, sf_layout", [("nvfp4", "swizzled"), ("fp8_block", "swizzled"), (None, "swizzled")])
@pytest.mark.parametrize("t", [130, 300])
def test_fused_moe_tail_writes_every_output(comm, gen, quant, sf_layout, t):
    """World 1 on a GPU: the one-kernel MoE tail writes every element of every output (padding rows of the
    swizzled scale layout; 300 tokens: moe_tail.launch_config's wide rule, VPT 1), the same bits over two
    poisons, and the reference's residual."""
    from compare import poisoned_runs

    if comm.device.type != "cuda" or comm.world_size != 1:
        pytest.skip("the fused MoE tail runs at world size 1 on a GPU")
    k, h = 4, 2048
    per_rank, rank = moe_inputs(comm, gen, t, k, h, torch.bfloat16, "finalize", torch.bfloat16, True)
    y, w, idx, shared = per_rank[rank]
    residual, weight, scale = tail_inputs(comm, gen, t, h, torch.bfloat16, quant)
    runs = poisoned_runs(lambda: comm.moe_all_reduce(y, w, residual, weight, quant=quant, scale=scale,
                                                      sf_layout=sf_layout, row_index=idx, shared=shared))
    assert runs[0].plan.combine == "fused", str(runs[0].plan)
    for name in ("residual", "norm", "quant", "scale_factors", "scales"):
        assert bits_equal(getattr(runs[0], name), getattr(runs[1], name)), f"{name}: an element not written"
    want = reference.fused_tail(combined(y, w, idx, shared), residual, weight, 1e-6, quant, scale)
    assert torch.equal(runs[0].residual, want.residual)


@mpi
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [2, 5])  # 2: the variant built for k 2; 5: the one for any k (a bad index in each chunk)
def test_fused_moe_tail_makes_a_bad_row_index_nan(comm, gen, index_dtype, k):
    """World 1 on a GPU: a row index outside [-1, R) (int32 as given; int64 beyond int32's range too) makes
    that token's rows NaN in the one-kernel MoE tail, and the other tokens' outputs the reference's."""
    if comm.device.type != "cuda" or comm.world_size != 1:
        pytest.skip("the fused MoE tail runs at world size 1 on a GPU")
    t, h = 4, 256
    rows = torch.randn(t * k, h, generator=gen).bfloat16().cuda()
    w = torch.rand(t, k, generator=gen).cuda()
    far = 2 ** 33 if index_dtype == torch.int64 else t * k  # int64: wraps to a valid row if cast without a clamp
    idx = torch.arange(t * k).view(t, k).to(index_dtype)
    idx[2, -1], idx[3, 1] = far, -2
    idx = idx.cuda()
    residual, weight, _ = tail_inputs(comm, gen, t, h, torch.bfloat16, None)
    r = comm.moe_all_reduce(rows, w, residual, weight, return_norm=True, row_index=idx)
    assert r.plan.combine == "fused", str(r.plan)
    assert torch.isnan(r.residual[2:].float()).all() and torch.isnan(r.norm[2:].float()).all()
    want = reference.fused_tail(reference.moe_finalize(rows, idx[:2], w[:2]), residual[:2], weight, 1e-6, None, None,
                                True)
    assert bits_equal(r.residual[:2], want.residual)
    torch.testing.assert_close(r.norm[:2].float(), want.norm.float(), rtol=2 ** -7, atol=0)  # the norm: 1 ulp of T


@needs_gpu
@pytest.mark.parametrize("quant, sf_layout, scale_layout", [(None, "swizzled", "row"), ("fp8", "swizzled", "row"),
                                                            ("nvfp4", "swizzled", "row"), ("mxfp8", "linear", "row"),
                                                            ("fp8_per_token", "swizzled", "row"),
                                                            ("fp8_block", "swizzled", "mn_major")])
# h 1152 (144 vectors): split 8 gives slices of 32 vectors, the fifth CTA's of 16 ending the row, the last three
# CTAs none (they take part in the cluster's sums only). k 12: three of the combine's chunks of 4 slots.
# k 1 and 6 (variants built for those k, each one chunk of slots); k 12: the variant for any k.
@pytest.mark.parametrize("t, k, h", [(1, 8, 7168), (7, 2, 4096), (33, 4, 3072), (3, 8, 1152), (2, 12, 2048),
                                     (1, 1, 7168), (4, 6, 2048)])
@pytest.mark.parametrize("form", ["reduction", "int32", "int64"])
def test_moe_tail_split_over_a_cluster_matches_the_reference(quant, sf_layout, scale_layout, t, k, h, form):
    """The world-1 MoE tail with each token's row cut over a cluster of 2, 4 and 8 CTAs, one slice each (SM
    9.0+), both forms: every output written, the scale storage's padding included (poisoned
    outputs); the residual the same bits as one CTA a token (the combine is per element); every output within
    the tolerances of reference.fused_tail of the reference combine (the sum of squares is added in another
    order). The finalize form drops the last token's last slot, whose row and the padding rows hold NaN."""
    from commfuse.kernels import moe_tail, native
    from commfuse.tail.spec import TailSpec
    from compare import poisoned_runs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need SM 9.0+")
    gen = torch.Generator().manual_seed(t * 17 + k + h)
    rows = torch.randn(t * k + 2, h, generator=gen).bfloat16()
    w = torch.rand(t, k, generator=gen).cuda()
    shared = torch.randn(t, h, generator=gen).bfloat16().cuda()
    residual = torch.randn(t, h, generator=gen).bfloat16().cuda()
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().cuda()
    if form == "reduction":
        y, idx, shared = rows[: t * k].view(t, k, h).cuda(), None, None
        combine = reference.moe_reduce(y, w)
    else:
        idx = torch.randperm(t * k, generator=gen).view(t, k)
        rows[int(idx[-1, -1])] = rows[t * k:] = float("nan")
        idx[-1, -1] = -1
        y, idx = rows.cuda(), idx.to(getattr(torch, form)).cuda()
        combine = reference.moe_finalize(y, idx, w, shared)
    scale = torch.tensor([0.05]).cuda() if quant in ("fp8", "nvfp4") else None
    spec = TailSpec.of(quant, return_norm=True, sf_layout=sf_layout, scale_layout=scale_layout)
    dev = torch.cuda.current_device()

    def run(split):
        plan = moe_tail.MOE_TAIL.plan(torch.bfloat16, w.dtype, None if idx is None else idx.dtype, t, k, h,
                                      0 if idx is None else y.shape[0], spec, dev, split=split)
        launch = plan.launches[0]
        assert launch.cluster == split
        # the variant built for k slots where there is one and it fits (k > 4: one CTA an SM, at most 256 threads)
        fits = moe_tail.slot_variant_fits(k, t * split, launch.block, dev)
        slots = k if k in moe_tail.SLOTS and fits else 0
        assert launch.kernel.name.endswith(f", 1, {slots}>"), launch.kernel.name
        return reference.Tail(*native.launcher(plan)(y, residual, weight, scale, None, w, idx, shared))

    ref = reference.fused_tail(combine, residual, weight, 1e-6, quant, scale, True, sf_layout, scale_layout=scale_layout)
    one = run(1)
    assert_tail_close(one, ref, quant, sf_layout, scale=scale)
    for split in (2, 4, 8):
        a, b = poisoned_runs(lambda: run(split))
        for name in ("residual", "norm", "quant", "scale_factors", "scales"):
            assert bits_equal(getattr(a, name), getattr(b, name)), f"split {split}: {name} not written everywhere"
        assert bits_equal(a.residual, one.residual), f"split {split}: the residual differs from unsplit"
        assert_tail_close(a, ref, quant, sf_layout, scale=scale)


@needs_gpu
def test_moe_tail_splits_few_tokens_only():
    """The default split: up to 8 CTAs a token while the t * split CTAs fit the SMs, for tokens of more than
    SPLIT_ELEMENTS expert elements and the VPT 1 variant; 1 otherwise."""
    from commfuse.kernels import moe_tail

    per_token = moe_tail.MOE_TAIL.ctas_per_token
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if torch.cuda.get_device_capability() < (9, 0):
        assert per_token(1, 8, 7168, 1, dev) == 1
        return
    assert per_token(1, 8, 7168, 1, dev) == per_token(1, 2, 7168, 1, dev) == moe_tail.MAX_SPLIT
    assert per_token(1, 8, 7168, 2, dev) == per_token(1, 2, moe_tail.SPLIT_ELEMENTS // 2, 1, dev) == 1
    assert per_token(1, 2, 4096, 1, dev) == moe_tail.MAX_SPLIT  # k 2 x h 4096: faster split since the st.async sum
    assert per_token(sms, 8, 7168, 1, dev) == 1
    for t in range(1, sms):
        s = per_token(t, 8, 7168, 1, dev)
        assert t * s <= sms, (t, s)
        assert s == moe_tail.MAX_SPLIT or t * s * 2 > sms, (t, s)


@needs_gpu
@pytest.mark.parametrize("form", ["int32", "int64"])
# Variants built for k: 1 x 4096 and 16 x 7168 split over clusters, 100 x 2048 one CTA a token (k 6, 256 threads).
# Variants for any k (their first moe.cuh kCombineChunk slots guessed): 64 x 7168 split (k 8, 448 threads a CTA), 256 x
# 4096 (512 threads), 5 x 4096 k 3, 3 x 2048 k 10 (slots past the guessed ones).
@pytest.mark.parametrize("t, k, h", [(1, 8, 4096), (16, 8, 7168), (100, 6, 2048), (64, 8, 7168), (256, 8, 4096),
                                     (5, 3, 4096), (3, 10, 2048)])
def test_moe_tail_reads_the_row_index_that_the_kernel_before_writes(form, t, k, h):
    """The finalize form's VPT 1 variants read the row index (of a variant built for k, all k slots; for any k the
    first ones) before their programmatic-launch wait, as a guess. Here the kernel just before the call
    (tests/kernels/pdl_writer.cu) lets it start, then writes a new index over an old one (another valid one: every
    slot's row differs, a dropped slot becomes kept and a kept one dropped): every guess is stale, and the outputs
    must be those of the new index (reference.fused_tail of reference.moe_finalize), which differ from the old
    one's."""
    import struct
    from pathlib import Path

    from commfuse.kernels import jit, moe_tail

    gen = torch.Generator().manual_seed(t * 31 + k + h)
    n = t * k
    y = torch.randn(n + 3, h, generator=gen).bfloat16().cuda()
    w = torch.rand(t, k, generator=gen).cuda()
    residual = torch.randn(t, h, generator=gen).bfloat16().cuda()
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().cuda()
    old = torch.randperm(n + 3, generator=gen)[:n].view(t, k)
    new = (old + 1) % (n + 3)
    old[0, 0], new[-1, -1] = -1, -1
    old, new = old.to(getattr(torch, form)).cuda(), new.to(getattr(torch, form)).cuda()
    spec = TailSpec.of(None, return_norm=True)
    dev = torch.cuda.current_device()
    plan = moe_tail.MOE_TAIL.plan(torch.bfloat16, w.dtype, new.dtype, t, k, h, y.shape[0], spec, dev)
    vpt = plan.launches[0].kernel.name.rstrip(">").split(", ")[-2]
    if vpt != "1":
        pytest.skip(f"{plan.launches[0].kernel.name}: not a VPT 1 variant on this GPU (no guess)")
    if not plan.launches[0].kernel.pdl:
        pytest.skip("kernels launched without programmatic dependent launch read the index after the kernel before")
    writer = jit.kernel(str(Path(__file__).parent / "kernels" / "pdl_writer.cu"),
                        "commfuse_test::write_after_launching_dependents", pdl=True)
    want = reference.fused_tail(reference.moe_finalize(y, new, w), residual, weight, 1e-6, None, None, True)
    stale = reference.fused_tail(reference.moe_finalize(y, old, w), residual, weight, 1e-6, None, None, True)
    assert not bits_equal(want.residual, stale.residual)
    row_index = old.clone()
    moe_tail.run(y, w, row_index, None, residual, weight, None, spec)  # compiled and loaded: the call below starts
    # within the writer's delay
    torch.cuda.synchronize()
    words = row_index.numel() * row_index.element_size() // 4
    writer.launch((1, 1, 1), (128, 1, 1), struct.pack("<4Q", row_index.data_ptr(), new.data_ptr(), words, 2_000_000))
    got = Tail(*moe_tail.run(y, w, row_index, None, residual, weight, None, spec))
    torch.cuda.synchronize()
    assert bits_equal(row_index, new)
    assert bits_equal(got.residual, want.residual)
    torch.testing.assert_close(got.norm.float(), want.norm.float(), rtol=2 ** -7, atol=0)  # the norm: 1 ulp of T


def test_the_one_launch_routes_cache_stays_bounded():
    """The cache of moe_all_reduce's one-launch routes is keyed by t and the finalize form's rows R, which a
    server varies call by call: it is cleared as the plan table is, instead of growing for the process's life."""
    import types

    from commfuse.communicator import Communicator
    from commfuse.kernels.table import MAX_ENTRIES
    from commfuse.routes import Machine
    from commfuse.tail.spec import TailSpec

    comm = Communicator.__new__(Communicator)  # the cache's facts only: a P2P machine's route, planned on the CPU
    comm._moe_plans, comm.device = {}, torch.device("cpu")
    comm.workspace = types.SimpleNamespace(max_bytes=1 << 26)
    comm._machine = Machine("p2p", "nccl", None, 2)
    h, k, weight = 64, 2, torch.empty(64, dtype=torch.bfloat16)
    for t in range(1, MAX_ENTRIES + 100):
        y, residual = torch.empty(t * k + t % 3, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16)
        comm._moe_one_launch(y, torch.empty(t, k), torch.zeros(t, k, dtype=torch.int32), residual, weight, None,
                             TailSpec.of(None), False, True)
        assert len(comm._moe_plans) <= MAX_ENTRIES
    assert comm._moe_plans  # it does cache
