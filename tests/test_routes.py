"""commfuse.routes on simulated hardware: argument errors, the fused tail's guards, the collective's choice."""
import dataclasses

import pytest
import torch

from commfuse import routes
from commfuse.kernels.family import Family, Limits
from commfuse.kernels.p2p_allreduce import chunk_rows
from commfuse.p2p import P2PLimits, default_limits
from commfuse.routes import Call, Collective, Machine, TailRoute, TensorMeta
from commfuse.tail import checks
from commfuse.tail.spec import TailSpec

from compare import bits_equal

CUDA = torch.device("cuda", 0)
LIMITS = P2PLimits(64 << 20, (("oneshot", 1 << 20), ("twoshot", 32 << 20)))


def meta(shape, dtype=torch.bfloat16, device=CUDA):
    return TensorMeta(tuple(shape), dtype, device)


def call(t=16, h=4096, dtype=torch.bfloat16, quant=None, device=CUDA, plain=False, x=None, scale="tensor", **spec):
    x = x or meta((t, h), dtype, device)
    if plain:
        return Call("plain", x)
    fmt_scale = TailSpec.of(quant).format.takes_scale
    if scale == "tensor":
        scale = meta((1,), torch.float32, device) if fmt_scale else None
    return Call("fused", x, meta((t, h), dtype, device), meta((h,), dtype, device), scale,
                spec=TailSpec.of(quant, **spec))


def plan(c, mode="fallback", sm=(9, 0), world=2, **kw):
    kw.setdefault("backend", "nccl")
    return routes.plan(c, Machine(mode, sm=sm, world_size=world, **kw))


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fallback_row_fuses_tail_when_guards_hold(quant, dtype):
    p = plan(call(dtype=dtype, quant=quant))
    assert (p.collective, p.tail, p.kernel, p.route) == ("nccl", "fused", "fused_tail", "nccl")


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4", "fp8_block"])
def test_a_post_norm_takes_the_nccl_routes_tail_kernel_not_p2p(quant):
    """A fused call with a post_weight (the call's z): the P2P kernels have no post-norm, so it takes NCCL and the
    fused_tail kernel, saying why; one rank takes the tail kernel on x; off CUDA the separated ops."""
    c = call(quant=quant)
    post = dataclasses.replace(c, z=c.weight)
    assert post.post and not c.post and not dataclasses.replace(c, op="local", z=c.weight).post
    p = plan(post, mode="p2p", limits=LIMITS)
    assert (p.collective, p.tail, p.kernel, p.route) == ("nccl", "fused", "fused_tail", "nccl"), str(p)
    assert "post_weight: the P2P kernels have no post-norm (the NCCL route's tail kernel has)" in p.reasons
    assert plan(c, mode="p2p", limits=LIMITS).collective == "p2p_oneshot"
    assert (plan(post, world=1).route, plan(post, world=1).kernel) == ("identity", "fused_tail")
    cpu = call(quant=quant, device=torch.device("cpu"))
    assert plan(dataclasses.replace(cpu, z=cpu.weight), backend="gloo").tail == "separated"


@pytest.mark.parametrize("kw", [
    dict(quant="fp8_per_token"), dict(quant="fp8_block"), dict(quant="fp8_block", scale_layout="mn_major"),
    dict(quant="fp8_block", scale_ue8m0=True), dict(quant="fp8_block", scale_layout="mn_major", scale_ue8m0=True),
    dict(quant=None, weight_offset=1.0), dict(quant="fp8", weight_offset=1.0), dict(quant="mxfp8"),
    dict(quant="mxfp8", sf_layout="linear"),
])
def test_computed_scale_fp8_and_weight_offset_fuse_on_every_route(kw):
    c = call(**kw)
    assert plan(c).tail == "fused"
    p = plan(c, mode="p2p", limits=LIMITS)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "fused", "p2p_allreduce")


def test_a_strided_tensor_plans_as_a_dense_one():
    """Strides are each rank's own: the plan, whose tail decides the P2P kernel and its limits, must not
    depend on them, or ranks making one call could take different collectives (the launchers read a dense
    copy). What the routes see of a tensor holds no strides."""
    dense = torch.empty(16, 64, dtype=torch.bfloat16)
    for strided in (torch.empty(64, 16, dtype=torch.bfloat16).t(), torch.empty(16, 128, dtype=torch.bfloat16)[:, ::2],
                    torch.empty(16 * 64 + 1, dtype=torch.bfloat16)[1:].view(16, 64)):
        assert TensorMeta.of(strided) == TensorMeta.of(dense)


def test_the_compared_call_holds_the_scales_form_not_the_tails_route():
    """What ranks compare (routes.describe): a scale given as a Python number on one rank and a tensor on
    another differs (it changes the P2P kernel); the tail's route does not (ranks of different SMs each
    pick their own, after the collective)."""
    tensor, number = call(quant="fp8"), call(quant="fp8", scale=None)
    p = plan(tensor)
    assert routes.describe(tensor, p) != routes.describe(number, p)
    assert "scale a Python number" in routes.describe(number, p)
    separated = plan(tensor, sm=(7, 5))
    assert separated.tail != p.tail and routes.describe(tensor, separated) == routes.describe(tensor, p)
    # off P2P, the reasons name the group's own collective
    gloo = plan(call(t=8192, h=4096), mode="p2p", backend="gloo", limits=LIMITS)
    assert gloo.collective == "gloo" and any(r.endswith(": gloo") and "measured" in r for r in gloo.reasons), gloo


def test_fp8_block_needs_whole_blocks():
    p = plan(call(h=4104, quant="fp8_block"))
    assert p.tail == "separated" and any("multiple of 128" in r and "fp8_block" in r for r in p.reasons), p.reasons


@pytest.mark.parametrize("sm", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_nvfp4_fused_on_every_sm_from_8_0(sm):
    assert plan(call(quant="nvfp4"), sm=sm).tail == "fused"


@pytest.mark.parametrize("case, why", [
    (dict(sm=(7, 5)), "SM 7.5"),
    (dict(c=call(dtype=torch.float32)), "float32"),
    (dict(c=call(device=torch.device("cpu")), sm=None, backend="gloo"), "cpu"),
    (dict(c=call(h=4100)), "multiple of 8"),
    (dict(c=call(quant="fp8", scale=None)), "Python float"),
    (dict(fusion=False), "COMMFUSE_DISABLE_FUSION"),
    (dict(c=call(h=1 << 17)), "hidden size 131072"),
])
def test_guard_failure_takes_separated_path_with_reason(case, why):
    c = case.pop("c", call())
    p = plan(c, **case)
    assert (p.tail, p.kernel, p.route) == ("separated", None, "separated")
    assert any(why in r for r in p.reasons), p.reasons


def test_the_first_failing_guard_is_the_reason_in_the_documented_order():
    """guards.md's order: COMMFUSE_DISABLE_FUSION before the device, the device before the SM, the SM before the
    dtype. A call failing several guards is refused for the first."""
    cpu = dict(c=call(device=torch.device("cpu"), dtype=torch.float32), sm=None, backend="gloo")
    for case, first in ((dict(cpu, fusion=False), "COMMFUSE_DISABLE_FUSION=1"), (cpu, "tensors on cpu"),
                        (dict(c=call(dtype=torch.float32), sm=(7, 5)), "SM 7.5 < 8.0")):
        c = case.pop("c")
        p = plan(c, **case)
        tail = [r for r in p.reasons if "P2P" not in r and "topology" not in r]  # the collective's own reasons
        assert p.tail == "separated" and tail[0].startswith(first), p.reasons


def test_a_gpu_newer_than_nvrtc_knows_takes_the_separated_ops(monkeypatch):
    """An SM the loaded NVRTC cannot compile for (a GPU newer than it) is a guard like an old SM: the separated ops,
    with the reason naming NVRTC's version and range, rather than a compile error at the first call."""
    from commfuse.kernels import jit

    monkeypatch.setattr(jit, "supported_archs", lambda: (75, 80, 86, 89, 90, 100, 120))
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (12, 8))
    jit.cannot_target.cache_clear()
    try:
        p = plan(call(quant="nvfp4"), sm=(12, 1))
        assert (p.tail, p.route) == ("separated", "separated"), str(p)
        assert "NVRTC 12.8 cannot compile for sm_121 (it targets sm_75 to sm_120): no fused kernels" in p.reasons
        assert plan(call(quant="nvfp4"), sm=(12, 0)).tail == "fused"
        from commfuse import moe  # the MoE combine kernel neither
        y, w = meta((4, 2, 256)), meta((4, 2), torch.float32)
        why = "combine: NVRTC 12.8 cannot compile for sm_121 (it targets sm_75 to sm_120): no fused kernels"
        assert moe.plan(y, w, Machine("fallback", sm=(12, 1), world_size=2, backend="nccl")) == ("separated", why)
        assert moe.plan(y, w, Machine("fallback", sm=(12, 0), world_size=2, backend="nccl")) == ("kernel", None)
    finally:
        jit.cannot_target.cache_clear()


def test_family_limits_reject_with_the_family_name():
    class Small(Family):
        name = "small"
        limits = Limits(max_tokens=8)

    spec = TailSpec.of("fp8")
    assert Small().rejects(torch.bfloat16, (9, 0), 4096, 8, spec) is None
    assert "9 tokens" in Small().rejects(torch.bfloat16, (9, 0), 4096, 9, spec)
    assert "small: dtype" in Small().rejects(torch.float32, (9, 0), 4096, 1, spec)
    assert "needs SM >= 8.0" in Small().rejects(torch.bfloat16, (7, 0), 4096, 1, spec)


def test_the_tail_kernels_take_up_to_two_to_the_31_minus_128_rows():
    """Rows are blockIdx.x (< 2^31) with up to 127 padding rows of the swizzled scale layout: the fused tail takes
    2^31 - 128 rows, one more goes to the separated ops, saying why (metadata only: nothing is allocated)."""
    most = (1 << 31) - 128
    p = plan(call(t=most, h=8))
    assert (p.tail, p.kernel) == ("fused", "fused_tail"), str(p)
    p = plan(call(t=most + 1, h=8))
    assert p.tail == "separated" and f"fused_tail: {most + 1} tokens > {most}" in p.reasons, str(p)


def test_plain_all_reduce_has_no_tail():
    p = plan(call(plain=True))
    assert (p.collective, p.tail) == ("nccl", "none")


@pytest.mark.parametrize("t, expect", [(1, "p2p_oneshot"), (128, "p2p_oneshot"),
                                       (129, "p2p_twoshot"), (4096, "p2p_twoshot"), (4097, "nccl")])
def test_p2p_algorithm_follows_measured_crossovers(t, expect):
    # bf16 x [t, 4096] is 8 KiB per token: 1 MiB one-shot limit = 128 tokens, 32 MiB = 4096 tokens.
    p = plan(call(t=t), mode="p2p", limits=LIMITS)
    assert p.collective == expect
    assert p.tail == "fused" and p.kernel == ("fused_tail" if expect == "nccl" else "p2p_allreduce")


# A 1 MiB workspace measured ahead of NCCL up to 2 MiB (two pieces); bf16 rows of 4096 are 8 KiB.
OVER = P2PLimits(1 << 20, (("oneshot", 256 << 10), ("twoshot", 2 << 20)), oneshot_bytes=512 << 10)


@pytest.mark.parametrize("strategy", ["auto", "oneshot", "twoshot"])
@pytest.mark.parametrize("c", [call(t=129), call(t=256, quant="nvfp4"), call(t=129, plain=True),
                               call(t=200, quant="nvfp4", sf_layout="linear")],
                         ids=["fused", "nvfp4-swizzled", "plain", "nvfp4-linear"])
def test_message_over_workspace_goes_twoshot_in_pieces(strategy, c):
    p = plan(c, mode="p2p", limits=OVER, strategy=strategy)
    assert p.collective == "p2p_twoshot", str(p)


def test_oneshot_never_exceeds_its_buffers():
    # Crossovers that claim more than the buffers hold (a stale or edited calibration file): two-shot.
    stale = P2PLimits(64 << 20, (("oneshot", 16 << 20), ("twoshot", 32 << 20)), oneshot_bytes=8 << 20)
    assert plan(call(t=1024), mode="p2p", limits=stale).collective == "p2p_oneshot"  # 8 MiB
    assert plan(call(t=1025), mode="p2p", limits=stale).collective == "p2p_twoshot"
    forced = plan(call(t=1025), mode="p2p", limits=stale, strategy="oneshot")
    assert forced.collective == "p2p_twoshot" and any("one-shot buffers" in r for r in forced.reasons)


def test_message_over_the_measured_crossover_goes_to_nccl():
    p = plan(call(t=257), mode="p2p", limits=OVER)
    assert p.collective == "nccl" and "crossover" in " ".join(p.reasons)


@pytest.mark.parametrize("t, h, quant, sf_layout, pieces", [
    (129, 4096, None, "swizzled", 128), (129, 4096, "nvfp4", "swizzled", 128), (129, 4096, "nvfp4", "linear", 128),
    (129, 6144, None, "swizzled", 85), (129, 6144, "nvfp4", "swizzled", 0), (100, 8192, "nvfp4", "swizzled", 0)])
def test_chunk_rows(t, h, quant, sf_layout, pieces):
    assert chunk_rows(h * 2, TailSpec.of(quant, sf_layout=sf_layout), 1 << 20) == pieces
    c = call(t=t, h=h, quant=quant, sf_layout=sf_layout)
    p = plan(c, mode="p2p", limits=OVER, strategy="twoshot")
    if pieces:
        assert (p.collective, p.tail) == ("p2p_twoshot", "fused"), str(p)
    else:  # 128 rows of swizzled NVFP4 scale factors do not fit: the forced P2P all-reduce, its tail separated
        assert (p.collective, p.tail) == ("p2p_twoshot", "separated") and "holds no piece" in " ".join(p.reasons)
        assert "the P2P all-reduce with the tail separated (strategy 'twoshot')" in p.reasons, str(p)
        auto = plan(c, mode="p2p", limits=OVER)  # not forced: NCCL, whose fused_tail takes the tail
        assert (auto.collective, auto.tail, auto.kernel) == ("nccl", "fused", "fused_tail"), str(auto)
    # With the tail separated the P2P kernel is a plain all-reduce: pieces of any 16 bytes fit.
    p = plan(c, mode="p2p", limits=OVER, strategy="twoshot", fusion=False)
    assert (p.collective, p.tail, p.route) == ("p2p_twoshot", "separated", "separated"), str(p)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_tail_no_kernel_fuses_keeps_the_p2p_all_reduce(quant):
    """Rows longer than any kernel's fused tail (h 131072 > 65536): the tail is separated whatever the route, so
    the plan keeps the P2P all-reduce it would take with fusion off, rather than leaving P2P for NCCL."""
    c = call(t=16, h=1 << 17, quant=quant)
    p = plan(c, mode="p2p", limits=LIMITS)
    off = plan(c, mode="p2p", limits=LIMITS, fusion=False)
    assert (p.collective, p.tail, p.route) == (off.collective, "separated", "separated") == \
        ("p2p_twoshot", "separated", "separated"), str(p)
    assert "the P2P all-reduce with the tail separated (nccl cannot fuse the tail either)" in p.reasons, str(p)
    assert plan(c).collective == "nccl" and plan(c).tail == "separated"  # no P2P: NCCL, the tail separated
    # A forced one-shot over its buffers: two-shot, and the reasons say why, as with fusion off.
    small = P2PLimits(64 << 20, (("oneshot", 1 << 20), ("twoshot", 32 << 20)), oneshot_bytes=1 << 20)
    p = plan(c, mode="p2p", limits=small, strategy="oneshot")
    assert (p.collective, p.tail) == ("p2p_twoshot", "separated"), str(p)
    assert "message 4194304 B > one-shot buffers 1048576 B: two-shot" in p.reasons, str(p)


def test_strategy_nccl_forces_fallback_row_on_p2p_machine():
    p = plan(call(), mode="p2p", limits=LIMITS, strategy="nccl")
    assert (p.collective, p.tail, p.kernel) == ("nccl", "fused", "fused_tail")
    assert p.reasons.count("strategy 'nccl': P2P all-reduce not used") == 1, p.reasons


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_nccl_route_without_commfuse_nccl_runs_the_tail_after_torchs_all_reduce(monkeypatch, quant):
    """The NCCL route where commfuse.nccl is not loaded (COMMFUSE_NCCL=0, or after close()): torch's
    all_reduce, then the fused_tail kernel on the sum, with the call's outputs (their specs check out=)."""
    monkeypatch.setattr(routes, "_tail_kernel", lambda c, res: "the fused_tail kernel")
    c = call(quant=quant)
    launcher = routes.ROUTES["nccl"].launcher(c, plan(c), routes.Resources(device=CUDA))
    assert isinstance(launcher, routes._Then) and launcher.tail == "the fused_tail kernel"
    assert launcher.outputs == c.spec.outputs(16, 4096, torch.bfloat16)


def test_p2p_plan_says_what_chose_the_algorithm():
    """A P2P plan's reasons name the crossover the message is within and whether it was measured, or the
    forced strategy; a two-shot one what put it past the one-shot."""
    one = plan(call(t=128), mode="p2p", limits=LIMITS)
    assert one.reasons == (f"message {128 * 8192} B <= the one-shot crossover {1 << 20} B (measured)",), one.reasons
    two = plan(call(t=129), mode="p2p", limits=LIMITS)
    assert two.reasons == (f"message {129 * 8192} B > the one-shot crossover {1 << 20} B, <= the two-shot crossover "
                           f"{32 << 20} B (measured)",), two.reasons
    pieces = plan(call(t=129), mode="p2p", limits=OVER)
    assert pieces.reasons[-1].endswith(f"> the one-shot buffers {512 << 10} B, <= the two-shot crossover {2 << 20} B "
                                       f"(measured), in pieces of the {1 << 20} B workspace"), pieces.reasons
    default = plan(call(t=1), mode="p2p", limits=default_limits(64 << 20, 8 << 20))
    assert default.collective == "p2p_oneshot" and "not calibrated on this machine" in default.reasons[-1]
    forced = plan(call(t=1), mode="p2p", limits=LIMITS, strategy="twoshot")
    assert forced.reasons == ("strategy 'twoshot'",), forced.reasons
    assert "strategy 'twoshot'" in str(forced)


def test_forced_algorithm_wins_over_crossover():
    assert plan(call(t=4096), mode="p2p", limits=LIMITS, strategy="oneshot").collective == "p2p_oneshot"
    assert plan(call(t=1), mode="p2p", limits=LIMITS, strategy="twoshot").collective == "p2p_twoshot"


def test_fusion_disabled_keeps_p2p_collective_but_separates_tail():
    p = plan(call(), mode="p2p", limits=LIMITS, fusion=False)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "separated", "p2p_allreduce")


def test_p2p_world_size_not_supported_goes_to_nccl():
    p = plan(call(), mode="p2p", world=9, limits=LIMITS)
    assert p.collective == "nccl" and any("world size 9" in r for r in p.reasons)
    # as a Communicator of 9 ranks plans it: no workspace was made, and the reason says why
    p = plan(call(), mode="p2p", world=9, limits=None)
    assert p.collective == "nccl" and any(r.startswith("world size 9 > 8") for r in p.reasons), p.reasons


@pytest.mark.parametrize("strategy", ["auto", "oneshot", "twoshot"])
@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4", "fp8_block"])
def test_a_call_of_one_rank_of_an_nccl_group_runs_no_collective(strategy, quant):
    """The sum of one rank is x: a fused call is the fused_tail kernel on x, a plain call a copy of x, no NCCL
    launch, whatever P2P strategy is asked (one rank has no P2P)."""
    p = plan(call(quant=quant), world=1, strategy=strategy, mode_reasons=("one rank",))
    assert (p.collective, p.tail, p.kernel, p.route) == ("none", "fused", "fused_tail", "identity"), str(p)
    assert p.reasons == ("one rank: its all-reduce is x itself, so no collective runs (strategy 'nccl' runs "
                         "NCCL's)",), p.reasons
    p = plan(call(plain=True), world=1, strategy=strategy)
    assert (p.collective, p.tail, p.kernel, p.route) == ("none", "none", None, "identity"), str(p)


def test_one_rank_keeps_nccls_all_reduce_where_forced_and_gloo_on_a_gloo_group():
    for c in (call(quant="fp8"), call(plain=True)):
        assert plan(c, world=1, strategy="nccl").collective == "nccl"
        assert plan(c, world=1, backend="gloo").collective == "gloo"
        assert plan(c, world=2).collective == "nccl"


def test_one_rank_separates_a_tail_the_kernel_cannot_take_without_a_collective():
    """Off the fused kernel (float32, a Python-number scale, CPU tensors) the separated tail runs on x itself:
    the plan's route is the separated one and its collective none, whose launcher is the tail alone."""
    for c, why in ((call(dtype=torch.float32), "float32"), (call(quant="fp8", scale=None), "Python float")):
        p = plan(c, world=1)
        assert (p.collective, p.tail, p.route) == ("none", "separated", "separated"), str(p)
        assert any(why in r for r in p.reasons) and any("no collective runs" in r for r in p.reasons), p.reasons


def test_one_ranks_separated_launcher_runs_the_tail_on_x():
    """What a one-rank fused call off the fused kernel runs, on CPU tensors: the separated tail on x itself,
    bit for bit the reference's tail of the one-rank sum (no collective's launcher before it)."""
    from commfuse import reference

    gen = torch.Generator().manual_seed(26)
    x, residual = (torch.randn(5, 64, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(64, generator=gen).bfloat16()
    fused = Call.of("fused", x, residual, weight, spec=TailSpec.of("fp8_per_token"))
    p = routes.plan(fused, Machine("fallback", "nccl", (9, 0), 1))
    assert (p.collective, p.route) == ("none", "separated"), str(p)
    tail = routes.launcher(fused, p, routes.Resources())(x, residual, weight)
    want = reference.fused_tail(reference.all_reduce_sum([x]), residual, weight, quant="fp8_per_token")
    for name, got in zip(("residual", "norm", "quant", "scale_factors", "scales"), tail):
        assert bits_equal(got, getattr(want, name)), name


def test_topology_reasons_are_carried():
    p = plan(call(), mode="fallback", mode_reasons=("no P2P between ranks 0->1",))
    assert "no P2P between ranks 0->1" in p.reasons and p.tail == "fused"


def test_plan_str_names_route_and_reasons():
    s = str(plan(call(), sm=(7, 0)))
    assert s.startswith("nccl + separated tail") and "SM 7.0" in s


def test_call_pattern_names():
    assert call(plain=True).pattern == "allreduce"
    assert call().pattern == "residual_rmsnorm"
    assert call(quant="nvfp4", return_norm=True).pattern == "residual_rmsnorm_nvfp4_out"


def test_strategies_and_routes_are_entries():
    assert routes.STRATEGIES == ("auto", "oneshot", "twoshot", "nccl")
    kinds = {"identity": routes.IdentityRoute, "p2p_oneshot": routes.P2PRoute, "p2p_twoshot": routes.P2PRoute,
             "nccl": routes.NcclRoute,
             "gloo": routes.GlooRoute, "local": routes.LocalRoute, "gated": routes.GatedRoute,
             "quantize": routes.QuantizeRoute, "separated": routes.SeparatedRoute}
    assert {name: type(route) for name, route in routes.ROUTES.items()} == kinds


def test_ranks_sharing_a_gpu_plan_p2p_over_gloo_and_gloo_fallback():
    """Ranks sharing a GPU: the group's backend is gloo, the topology mode p2p (same-device IPC):
    the P2P kernels run, and the forced fallback row is gloo's sum + the fused tail kernel."""
    limits = P2PLimits(64 << 20, (("oneshot", 512 << 10), ("twoshot", 64 << 20)))
    kw = dict(mode="p2p", backend="gloo", world=4, limits=limits)
    p = plan(call(quant="fp8"), **kw)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "fused", "p2p_allreduce"), str(p)
    p = plan(call(quant="fp8"), **{**kw, "limits": None}, strategy="nccl")
    assert (p.collective, p.tail, p.kernel) == ("gloo", "fused", "fused_tail"), str(p)
    assert plan(call(plain=True), **kw).collective == "p2p_oneshot"


def test_routes_are_typed():
    p = plan(call(quant="fp8"))
    assert isinstance(p.collective, Collective) and isinstance(p.tail, TailRoute)
    assert p.collective is Collective.NCCL and p.tail is TailRoute.FUSED and p.collective.algorithm is None
    assert Collective.P2P_TWOSHOT.algorithm == "twoshot" and str(Collective.P2P_ONESHOT) == "p2p_oneshot"
    assert str(p).startswith(f"nccl + fused tail [{p.kernel}]")
    with pytest.raises(ValueError, match="nccl or gloo"):
        Collective.of_backend("mpi")


@pytest.mark.parametrize("op, guard", [("local", "fused_tail"), ("gated", "gated_rmsnorm")])
def test_local_routes(op, guard):
    x = meta((4, 256))
    spec = TailSpec.of("fp8")
    c = Call(op, x, None, meta((256,)), meta((1,), torch.float32), meta((4, 256)) if op == "gated" else None, spec,
             group_size=64)
    p = routes.plan(c, Machine("local", sm=(9, 0)))
    assert (p.collective, p.tail, p.kernel, p.route) == ("none", "fused", guard, op)
    p = routes.plan(c, Machine("local", sm=(9, 0), fusion=False))
    assert (p.tail, p.route) == ("separated", "separated") and "COMMFUSE_DISABLE_FUSION" in p.reasons[0]
    if op == "gated":
        p = routes.plan(Call(op, x, None, meta((256,)), meta((1,), torch.float32), None, spec, group_size=4),
                        Machine("local", sm=(9, 0)))
        assert p.tail == "separated" and "whole 16-byte vectors" in p.reasons[0]


def test_quantize_route():
    on_gpu = Machine("local", sm=(9, 0))
    scale = meta((1,), torch.float32)
    q = routes.plan(Call("quantize", meta((4, 256)), scale=scale, spec=TailSpec.of("fp8")), on_gpu)
    assert (q.collective, q.tail, q.kernel, q.route, q.reasons) == ("none", "fused", "quantize", "quantize", ())
    q = routes.plan(Call("quantize", meta((4, 16384)), spec=TailSpec.of("fp8_block")), on_gpu)
    assert q.route == "quantize"
    q = routes.plan(Call("quantize", meta((4, 16384 + 128)), spec=TailSpec.of("fp8_block")), on_gpu)
    assert q.route == "separated" and "16384" in q.reasons[0]  # rows live in registers
    q = routes.plan(Call("quantize", meta((4, 256), torch.float32), scale=scale, spec=TailSpec.of("nvfp4")), on_gpu)
    assert q.route == "separated" and "float16 and bfloat16" in q.reasons[0]
    q = routes.plan(Call("quantize", meta((4, 40)), spec=TailSpec.of("mxfp8")), on_gpu)
    assert q.route == "separated" and "multiple of 32" in q.reasons[0]


# ---- argument errors: every one names the argument --------------------------------------------

CPU = torch.device("cpu")


def args(t=4, h=64, dtype=torch.bfloat16, **kw):
    base = dict(x=torch.randn(t, h).to(dtype), residual=torch.randn(t, h).to(dtype),
                weight=torch.randn(h).to(dtype), quant=None, scale=None, sf_layout="swizzled", eps=1e-6)
    base.update(kw)
    return base


def check(x, residual, weight, quant, scale, sf_layout, eps, device=CPU, **spec):
    s = TailSpec.of(quant, sf_layout=sf_layout, eps=eps, **spec)
    checks.tail(x, residual, weight, scale, s, device)


@pytest.mark.parametrize("bad, error, match", [
    (dict(residual=torch.randn(4, 32).bfloat16()), ValueError, "residual must have x's shape"),
    (dict(residual=torch.randn(4, 64)), TypeError, "residual dtype"),
    (dict(weight=torch.randn(32).bfloat16()), ValueError, r"weight must have shape \[64\]"),
    (dict(weight=torch.randn(64).half()), TypeError, "weight dtype"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps=-1e-6), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps must be a number"),
    (dict(quant="int4"), ValueError, "quant must be one of"),
    (dict(quant=4), TypeError, "quant must be None or one of"),
    (dict(sf_layout="tiled"), ValueError, "sf_layout"),
    (dict(quant="fp8"), ValueError, "needs scale"),
    (dict(quant="fp8", scale=torch.ones(2)), ValueError, "scale must have one element"),
    (dict(quant="fp8", scale=torch.ones(1, dtype=torch.float64)), TypeError, "scale must be float32"),
    (dict(quant="fp8", scale=torch.ones(1).to_sparse()), TypeError, "scale must be a dense tensor"),
    (dict(quant="fp8", scale="1.0"), TypeError, "scale must be"),
    (dict(scale=torch.ones(1)), ValueError, "scale is only meaningful"),
    (dict(quant="fp8_per_token", scale=torch.ones(1)), ValueError, "computes its scales"),
    (dict(quant="fp8", sf_layout="linear"), ValueError, "sf_layout='linear' applies to quant 'nvfp4'"),
    (dict(quant="fp8", scale_ue8m0=True), ValueError, "scale_ue8m0=True applies to quant 'fp8_block'"),
    (dict(quant="fp8_per_token", scale_layout="mn_major"), ValueError, "scale_layout='mn_major' applies"),
    (dict(quant="mxfp8", scale=torch.ones(1)), ValueError, "computes its scales"),
    (dict(quant="mxfp8", scale_ue8m0=True), ValueError, "scale_ue8m0=True applies to quant 'fp8_block'"),
    (dict(x=torch.randn(4, 48).bfloat16(), residual=torch.randn(4, 48).bfloat16(),
          weight=torch.randn(48).bfloat16(), quant="mxfp8"), ValueError, "multiple of 32"),
    (dict(x=torch.randn(4, 40).bfloat16(), residual=torch.randn(4, 40).bfloat16(),
          weight=torch.randn(40).bfloat16(), quant="nvfp4", scale=torch.ones(1)), ValueError, "multiple of 16"),
])
def test_bad_arguments_raise_naming_the_argument(bad, error, match):
    with pytest.raises(error, match=match):
        check(**args(**bad))


def test_tensor_on_wrong_device_raises():
    with pytest.raises(ValueError, match="x is on cpu, but this communicator works on cuda:0"):
        check(**args(), device=CUDA)


def test_good_arguments_pass():
    check(**args(quant="nvfp4", scale=torch.ones(1)))
    check(**args(quant="fp8", scale=0.5))
    check(**args(quant="fp8_block", h=256, x=torch.randn(4, 256).bfloat16(), residual=torch.randn(4, 256).bfloat16(),
                 weight=torch.randn(256).bfloat16(), scale_layout="mn_major", scale_ue8m0=True))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.bool])
def test_non_float_inputs_raise_type_error_naming_x(dtype):
    x = torch.zeros(4, 64, dtype=dtype)
    with pytest.raises(TypeError, match=r"x must be float16, bfloat16 or float32"):
        checks.x_hidden(x, CPU)
    with pytest.raises(TypeError, match=r"x must be"):
        checks.tail(x, x, x[0], None, TailSpec(), CPU)
