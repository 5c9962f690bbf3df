"""plan.py on simulated hardware: argument errors, fused-row guards, collective choice."""
import pytest
import torch

from commfuse.plan import (KernelSpec, P2PLimits, Request, TensorMeta, check_arguments, chunk_rows, make_plan,
                           registered_kernels)

CUDA = torch.device("cuda", 0)
TAIL = KernelSpec(name="tail", kind="tail", max_hidden=16384)
P2P = KernelSpec(name="p2p", kind="p2p", plain=True, algorithms=("oneshot", "twoshot"),
                 world_sizes=frozenset({2, 4, 8}))
LIMITS = P2PLimits(workspace_bytes=64 << 20, oneshot_max=1 << 20, twoshot_max=32 << 20)


def meta(shape, dtype=torch.bfloat16, device=CUDA, contiguous=True, last_stride=1):
    return TensorMeta(tuple(shape), dtype, device, contiguous, last_stride)


def request(t=16, h=4096, dtype=torch.bfloat16, quant=None, device=CUDA, plain=False, x=None, **kw):
    x = x or meta((t, h), dtype, device)
    if plain:
        return Request(x)
    fields = dict(residual=meta((t, h), dtype, device), weight=meta((h,), dtype, device),
                  scale=meta((1,), torch.float32, device) if quant else None, quant=quant)
    fields.update(kw)
    return Request(x, **fields)


def plan(req, mode="fallback", sm=(9, 0), world=2, kernels=(TAIL,), **kw):
    kw.setdefault("backend", "nccl")
    return make_plan(req, mode=mode, sm=sm, world_size=world, kernels={k.name: k for k in kernels}, **kw)


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fallback_row_fuses_tail_when_guards_hold(quant, dtype):
    p = plan(request(dtype=dtype, quant=quant))
    assert (p.collective, p.tail, p.kernel) == ("nccl", "fused", "tail")


@pytest.mark.parametrize("kw", [
    dict(quant="fp8_per_token"), dict(quant="fp8_block"), dict(quant="fp8_block", scale_layout="mn_major"),
    dict(quant="fp8_block", scale_ue8m0=True), dict(quant="fp8_block", scale_layout="mn_major", scale_ue8m0=True),
    dict(quant=None, weight_offset=1.0), dict(quant="fp8", scale=meta((1,), torch.float32), weight_offset=1.0),
])
def test_computed_scale_fp8_and_weight_offset_fuse_on_every_route(kw):
    kw.setdefault("scale", None)
    req = request(**kw)
    assert plan(req).tail == "fused"
    p = plan(req, mode="p2p", kernels=(TAIL, P2P), p2p=LIMITS)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "fused", "p2p")
    real = plan(req, kernels=registered_kernels().values())
    assert (real.tail, real.kernel) == ("fused", "fused_tail")


def test_fp8_block_needs_whole_blocks():
    p = plan(request(h=4104, quant="fp8_block", scale=None))
    assert p.tail == "separated" and any("multiple of 128" in r and "fp8_block" in r for r in p.reasons), p.reasons


@pytest.mark.parametrize("sm", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_nvfp4_fused_on_every_sm_from_8_0(sm):
    assert plan(request(quant="nvfp4"), sm=sm).tail == "fused"


@pytest.mark.parametrize("case, why", [
    (dict(sm=(7, 5)), "SM 7.5"),
    (dict(req=request(dtype=torch.float32)), "float32"),
    (dict(req=request(device=torch.device("cpu")), sm=None, backend="gloo"), "cpu"),
    (dict(req=request(h=4100)), "multiple of 8"),
    (dict(req=request(x=meta((16, 4096), last_stride=2))), "stride 2"),
    (dict(req=request(quant="fp8", scale=None)), "Python float"),
    (dict(req=request(quant="fp8", scale=meta((1,), torch.float32, contiguous=False))), "not contiguous"),
    (dict(fusion=False), "COMMFUSE_DISABLE_FUSION"),
    (dict(kernels=()), "no tail kernel"),
    (dict(req=request(h=32768)), "hidden size 32768"),
])
def test_guard_failure_takes_separated_path_with_reason(case, why):
    req = case.pop("req", request())
    p = plan(req, **case)
    assert p.tail == "separated" and p.kernel is None
    assert any(why in r for r in p.reasons), p.reasons


def test_kernel_limits_are_the_registered_ones():
    small = KernelSpec(name="small", kind="tail", max_tokens=8, quants=frozenset({None}))
    assert plan(request(t=8), kernels=(small,)).tail == "fused"
    p = plan(request(t=9), kernels=(small,))
    assert p.tail == "separated" and "9 tokens" in p.reasons[-1]
    p = plan(request(t=8, quant="fp8"), kernels=(small,))
    assert p.tail == "separated" and "quant 'fp8'" in p.reasons[-1]


def test_plain_all_reduce_has_no_tail():
    p = plan(request(plain=True))
    assert (p.collective, p.tail) == ("nccl", "none")


@pytest.mark.parametrize("t, expect", [(1, "p2p_oneshot"), (128, "p2p_oneshot"),
                                       (129, "p2p_twoshot"), (4096, "p2p_twoshot"), (4097, "nccl")])
def test_p2p_algorithm_follows_measured_crossovers(t, expect):
    # bf16 x [t, 4096] is 8 KiB per token: 1 MiB one-shot limit = 128 tokens, 32 MiB = 4096 tokens.
    p = plan(request(t=t), mode="p2p", kernels=(TAIL, P2P), p2p=LIMITS)
    assert p.collective == expect
    assert p.tail == "fused" and p.kernel == ("tail" if expect == "nccl" else "p2p")


# A 1 MiB workspace measured ahead of NCCL up to 2 MiB (two pieces); bf16 rows of 4096 are 8 KiB.
OVER = P2PLimits(workspace_bytes=1 << 20, oneshot_max=256 << 10, twoshot_max=2 << 20, oneshot_bytes=512 << 10)


@pytest.mark.parametrize("strategy", ["auto", "oneshot", "twoshot"])
@pytest.mark.parametrize("req", [request(t=129), request(t=256, quant="nvfp4"), request(t=129, plain=True),
                                 request(t=200, quant="nvfp4", sf_layout="linear")],
                         ids=["fused", "nvfp4-swizzled", "plain", "nvfp4-linear"])
def test_message_over_workspace_goes_twoshot_in_pieces(strategy, req):
    p = plan(req, mode="p2p", kernels=(TAIL, P2P), p2p=OVER, strategy=strategy)
    assert p.collective == "p2p_twoshot", str(p)


def test_oneshot_never_exceeds_its_buffers():
    # Crossovers that claim more than the buffers hold (a stale or edited calibration file): two-shot.
    stale = P2PLimits(workspace_bytes=64 << 20, oneshot_max=16 << 20, twoshot_max=32 << 20, oneshot_bytes=8 << 20)
    assert plan(request(t=1024), mode="p2p", kernels=(TAIL, P2P), p2p=stale).collective == "p2p_oneshot"  # 8 MiB
    assert plan(request(t=1025), mode="p2p", kernels=(TAIL, P2P), p2p=stale).collective == "p2p_twoshot"


def test_message_over_the_measured_crossover_goes_to_nccl():
    p = plan(request(t=257), mode="p2p", kernels=(TAIL, P2P), p2p=OVER)
    assert p.collective == "nccl" and "crossover" in " ".join(p.reasons)


@pytest.mark.parametrize("t, h, quant, sf_layout, pieces", [
    (129, 4096, None, "swizzled", 128), (129, 4096, "nvfp4", "swizzled", 128), (129, 4096, "nvfp4", "linear", 128),
    (129, 6144, None, "swizzled", 85), (129, 6144, "nvfp4", "swizzled", 0), (100, 8192, "nvfp4", "swizzled", 0)])
def test_chunk_rows(t, h, quant, sf_layout, pieces):
    assert chunk_rows(h * 2, quant, sf_layout, 1 << 20) == pieces
    p = plan(request(t=t, h=h, quant=quant, sf_layout=sf_layout), mode="p2p", kernels=(TAIL, P2P),
             p2p=OVER, strategy="twoshot")
    if pieces:
        assert p.collective == "p2p_twoshot", str(p)
    else:  # 128 rows of swizzled NVFP4 scale factors do not fit: no piece, NCCL
        assert p.collective == "nccl" and "holds no piece" in " ".join(p.reasons), str(p)
    # With the tail separated the P2P kernel is a plain all-reduce: pieces of any 16 bytes fit.
    p = plan(request(t=t, h=h, quant=quant, sf_layout=sf_layout), mode="p2p", kernels=(TAIL, P2P),
             p2p=OVER, strategy="twoshot", fusion=False)
    assert (p.collective, p.tail) == ("p2p_twoshot", "separated"), str(p)


def test_strategy_nccl_forces_fallback_row_on_p2p_machine():
    p = plan(request(), mode="p2p", kernels=(TAIL, P2P), p2p=LIMITS, strategy="nccl")
    assert (p.collective, p.tail, p.kernel) == ("nccl", "fused", "tail")
    assert any("strategy 'nccl'" in r for r in p.reasons)


def test_forced_algorithm_wins_over_crossover():
    p = plan(request(t=4096), mode="p2p", kernels=(TAIL, P2P), p2p=LIMITS, strategy="oneshot")
    assert p.collective == "p2p_oneshot"


def test_fusion_disabled_keeps_p2p_collective_but_separates_tail():
    p = plan(request(), mode="p2p", kernels=(TAIL, P2P), p2p=LIMITS, fusion=False)
    assert (p.collective, p.tail) == ("p2p_oneshot", "separated")


def test_p2p_world_size_not_supported_goes_to_nccl():
    p = plan(request(), mode="p2p", world=3, kernels=(TAIL, P2P), p2p=LIMITS)
    assert p.collective == "nccl" and any("world size 3" in r for r in p.reasons)


def test_topology_reasons_are_carried():
    p = plan(request(), mode="fallback", mode_reasons=("no P2P between ranks 0->1",))
    assert "no P2P between ranks 0->1" in p.reasons and p.tail == "fused"


def test_plan_str_names_route_and_reasons():
    s = str(plan(request(), sm=(7, 0)))
    assert s.startswith("nccl + separated tail") and "SM 7.0" in s


def test_request_pattern_names():
    assert request(plain=True).pattern == "allreduce"
    assert request().pattern == "residual_rmsnorm"
    assert request(quant="nvfp4", return_norm=True).pattern == "residual_rmsnorm_nvfp4_out"


# ---- argument errors: every one names the argument --------------------------------------------

CPU = torch.device("cpu")


def args(t=4, h=64, dtype=torch.bfloat16, **kw):
    base = dict(x=torch.randn(t, h).to(dtype), residual=torch.randn(t, h).to(dtype),
                weight=torch.randn(h).to(dtype), eps=1e-6, quant=None, scale=None, sf_layout="swizzled")
    base.update(kw)
    return base


@pytest.mark.parametrize("bad, match", [
    (dict(residual=torch.randn(4, 32).bfloat16()), "residual must have x's shape"),
    (dict(residual=torch.randn(4, 64)), "residual dtype"),
    (dict(weight=torch.randn(32).bfloat16()), r"weight must have shape \[64\]"),
    (dict(weight=torch.randn(64).half()), "weight dtype"),
    (dict(eps=float("nan")), "eps"),
    (dict(eps=-1e-6), "eps"),
    (dict(quant="int4"), "quant must be one of"),
    (dict(sf_layout="tiled"), "sf_layout"),
    (dict(quant="fp8"), "needs scale"),
    (dict(quant="fp8", scale=torch.ones(2)), "scale must have one element"),
    (dict(quant="fp8", scale=torch.ones(1, dtype=torch.float64)), "scale must be float32"),
    (dict(quant="fp8", scale="1.0"), "scale must be"),
    (dict(scale=torch.ones(1)), "scale is only meaningful"),
    (dict(x=torch.randn(4, 40).bfloat16(), residual=torch.randn(4, 40).bfloat16(),
          weight=torch.randn(40).bfloat16(), quant="nvfp4", scale=torch.ones(1)), "multiple of 16"),
])
def test_bad_arguments_raise_naming_the_argument(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_arguments(device=CPU, **args(**bad))


def test_tensor_on_wrong_device_raises():
    a = args()
    with pytest.raises(ValueError, match="x is on cpu, but this communicator works on cuda:0"):
        check_arguments(device=CUDA, **a)


def test_good_arguments_pass():
    check_arguments(device=CPU, **args(quant="nvfp4", scale=torch.ones(1)))
    check_arguments(device=CPU, **args(quant="fp8", scale=0.5))


def test_registry_lists_the_real_kernels():
    import commfuse.communicator  # noqa: F401  (imports the kernel modules, which register)

    kinds = {k.kind for k in registered_kernels().values()}
    assert "tail" in kinds


def test_ranks_sharing_a_gpu_plan_p2p_over_gloo_and_gloo_fallback():
    """Ranks sharing a GPU: the group's backend is gloo, the topology mode p2p (same-device IPC):
    the P2P kernels run, and the forced fallback row is gloo's sum + the fused tail kernel."""
    from commfuse import p2p  # noqa: F401 (registers the P2P kernel)

    limits = P2PLimits(64 << 20, 512 << 10, 64 << 20)
    req = Request(meta((16, 4096)), meta((16, 4096)), meta((4096,)), meta((1,), torch.float32), "fp8")
    kw = dict(mode="p2p", backend="gloo", sm=(9, 0), world_size=4, kernels=registered_kernels(), p2p=limits)
    p = make_plan(req, **kw)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "fused", "p2p_allreduce"), str(p)
    p = make_plan(req, **{**kw, "p2p": None}, strategy="nccl")
    assert (p.collective, p.tail, p.kernel) == ("gloo", "fused", "fused_tail"), str(p)
    assert make_plan(Request(meta((16, 4096))), **kw).collective == "p2p_oneshot"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.bool])
def test_non_float_inputs_raise_type_error_naming_x(dtype):
    x = torch.zeros(4, 64, dtype=dtype)
    with pytest.raises(TypeError, match=r"x must be float16, bfloat16 or float32"):
        check_arguments(x, None, None, 1e-6, None, None, "swizzled", torch.device("cpu"))
    with pytest.raises(TypeError, match=r"x must be"):
        check_arguments(x, x, x[0], 1e-6, None, None, "swizzled", torch.device("cpu"))


def test_routes_are_typed():
    from commfuse.plan import Collective, TailRoute

    p = plan(request(quant="fp8"))
    assert isinstance(p.collective, Collective) and isinstance(p.tail, TailRoute)
    assert p.collective is Collective.NCCL and p.tail is TailRoute.FUSED and p.collective.algorithm is p.algorithm is None
    assert Collective.P2P_TWOSHOT.algorithm == "twoshot" and str(Collective.P2P_ONESHOT) == "p2p_oneshot"
    assert str(p).startswith(f"nccl + fused tail [{p.kernel}]")
    with pytest.raises(ValueError, match="nccl or gloo"):
        Collective.of_backend("mpi")
