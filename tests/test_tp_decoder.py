"""examples/tp_decoder.py at CI size: a tensor-parallel Llama decoder over every rank, unfused and with
commfuse.fusion, eager and compiled (aot_eager on CPU), dense or MoE (--moe); its checks must pass (bit for
bit on CPU)."""
import importlib.util
import os
import sys

import pytest
import torch

mpi = pytest.mark.mpi  # any world size: world 1 exercises the local ops, more ranks the all-reduce tails
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(args, tmp_path, example=None):
    example = example or _example()
    return example.main(["--size", "tiny", "--layers", "2", "--tokens", "8", "--decode-steps", "2", "--repeats", "1",
                         "--quiet", "--json", str(tmp_path / "out.json")] + args)


def _example():
    spec = importlib.util.spec_from_file_location("tp_decoder", os.path.join(HERE, "..", "examples", "tp_decoder.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tp_decoder"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@mpi
@pytest.mark.parametrize("args", [
    ["--quant", "fp8", "--compile"],
    ["--quant", "nvfp4", "--collective", "funcol", "--norm", "torch"],
    ["--gated-attn", "--quant", "fp8", "--compile"],
    ["--gated-attn", "--dynamic"],  # the gated norm's sizes read by size(): fused all the same
])
def test_tp_decoder_tiny(comm, args, tmp_path):
    res = _run(args, tmp_path)
    assert res["ok"], res["checks"]
    world = torch.distributed.get_world_size()
    for name, check in res["checks"].items():
        if res["device"] == "cpu" and world <= 2:  # gloo's sum is commfuse's bits on 2 ranks only
            assert check["bit_identical"], (name, check)
        # per graph: 2 tails a layer (3 with --gated-attn: its gated norm, local) + the first input norm (no add:
        # a local op); a prefill graph, decode graph(s). Each is fused or, with Inductor at world 1
        # (rewrite="auto"), left to it on evidence.
        per_graph = (3 if res["gated_attn"] else 2) * 2 + 1
        matched = check["fused_ops"] + check["left_on_evidence"]
        assert matched >= 2 * per_graph and matched % per_graph == 0, (name, check)
    fused = "\n".join(r for reps in res["reports"].values() for r in reps)
    if res["gated_attn"]:  # every layer's, in every graph (with Inductor in its default mode too: evidence.py)
        assert all(r.count("gated_rmsnorm -> commfuse::gated_rmsnorm") == 2 for reps in res["reports"].values()
                   for r in reps), fused
    expect = "commfuse::fused_all_reduce" if world > 1 else "commfuse::fused_add_rmsnorm"
    assert expect in fused and "skipped" in fused, fused
    assert set(res["latency_ms"]) >= {"eager/unfused", "eager/fused"}
    # one round: each step's ratio is that round's fused / unfused time, its interval the ratio itself
    assert set(res["ratios"]) == {"eager/fused"} | ({"compiled/fused"} if "--compile" in args else set())
    for fused, unfused in (("eager/fused", "eager/unfused"), ("compiled/fused", "compiled/unfused"))[:len(res["ratios"])]:
        want = [f / u for f, u in zip(res["rounds_ms"][fused][0], res["rounds_ms"][unfused][0])]
        assert [q["median"] for q in res["ratios"][fused]] == pytest.approx(want, rel=1e-12)
        assert all(q["low"] == q["median"] == q["high"] and q["coverage"] == 0 for q in res["ratios"][fused])
        assert len(want) == len(res["steps"]) == 3


@mpi
@pytest.mark.parametrize("args", [
    ["--moe", "--quant", "fp8", "--compile"],
    ["--moe", "--shared-expert", "--moe-topk", "3", "--collective", "funcol"],
])
def test_tp_moe_decoder_tiny(comm, args, tmp_path):
    """--moe: each layer's MLP a tensor-parallel MoE block; with an all-reduce (world > 1) every layer's combine
    + all-reduce + add + norm is one commfuse::moe_all_reduce, checked bit for bit on CPU (<= 2 ranks) against
    the model with its norms and combines in commfuse's order (the combine: reference.moe_reduce)."""
    res = _run(args, tmp_path)
    assert res["ok"], res["checks"]
    assert res["moe"] and res["config"]["experts"] == 4
    world = torch.distributed.get_world_size()
    for name, check in res["checks"].items():
        if res["device"] == "cpu" and world <= 2:
            assert check["bit_identical"], (name, check)
        matched = check["fused_ops"] + check["left_on_evidence"]  # as the dense model: 2 tails a layer + the first norm
        assert matched >= 2 * (2 * 2 + 1) and matched % (2 * 2 + 1) == 0, (name, check)
        assert check["moe_ops"] and all(m == (2 if world > 1 else 0) for m in check["moe_ops"]), (name, check)
    reps = [r for reps in res["reports"].values() for r in reps]
    if world > 1:  # one per layer in every graph (prefill, decode)
        assert all(r.count("-> commfuse::moe_all_reduce") == 2 for r in reps), reps
        assert all("(y * w.unsqueeze(-1)).sum(dim=1).to(bfloat16)" in r for r in reps), reps
        if "--shared-expert" in args:
            assert all("+ shared (" in r for r in reps), reps
    else:  # no all-reduce in the model: the combine stays, its add + norm are the local op
        # (with Inductor, rewrite="auto" may leave the local ops to it, and the report says so)
        assert not any("moe_all_reduce" in r for r in reps), reps
        assert all("commfuse::fused_add_rmsnorm" in r or "(evidence)" in r for r in reps), reps


def _drop_the_norm_weight(monkeypatch):
    """A wrong fused tail, in the calls the fused graph's ops make: the RMSNorm without its weight."""
    import commfuse

    fused_all_reduce, fused_add_rmsnorm = commfuse.Communicator.fused_all_reduce, commfuse.local.fused_add_rmsnorm
    monkeypatch.setattr(commfuse.Communicator, "fused_all_reduce", lambda self, x, residual, weight, *a, **k:
                        fused_all_reduce(self, x, residual, torch.ones_like(weight), *a, **k))
    monkeypatch.setattr(commfuse.local, "fused_add_rmsnorm", lambda x, residual, weight, *a, **k:
                        fused_add_rmsnorm(x, residual, torch.ones_like(weight), *a, **k))


@mpi
@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_the_first_tail_check_catches_a_wrong_fused_tail(comm, quant, monkeypatch):
    """first_tail_mismatch: the first layer's tail through the fused op's call on the model's own activations,
    within the kernels' tolerances of commfuse.reference when right, and not when the tail drops the norm's weight."""
    example = _example()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = example.Decoder(example.SIZES["tiny"], rank, world, comm.device, torch.bfloat16, quant=quant, max_len=16)
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(5)).to(comm.device)
    with torch.inference_mode():
        assert example.first_tail_mismatch(model, comm, prompt, quant) is None
        _drop_the_norm_weight(monkeypatch)
        why = example.first_tail_mismatch(model, comm, prompt, quant)
    assert why and why.startswith({None: "norm", "fp8": "fp8 codes", "nvfp4": "nvfp4 scale factors"}[quant]), why


@mpi
@pytest.mark.parametrize("wrong", [False, True])
def test_a_wrong_fused_tail_fails_the_check_where_the_logits_are_compared_by_error(comm, wrong, monkeypatch,
                                                                                    tmp_path):
    """Where the logits are compared by relative error (the fused kernels; here the CPU run taken as one), NVFP4's
    tolerance lets a fused tail that drops the norm's weight through (0.24 < 0.4): the first layer's tail, held to
    the kernels' tolerances, fails the check; the right tail passes it."""
    example = _example()
    monkeypatch.setattr(example, "exact_route", lambda *args: False)
    if wrong:
        _drop_the_norm_weight(monkeypatch)
    res = _run(["--quant", "nvfp4"], tmp_path, example)
    c = res["checks"]["eager/fused"]
    assert c["rel_rms_err"] <= c["tol"] == 0.4 and c["fused_ops"] > 0, c  # the logits alone would pass
    assert c["first_tail"]["ok"] != wrong and res["ok"] != wrong, c
    if wrong:
        assert c["first_tail"]["why"].startswith("nvfp4 scale factors"), c


@pytest.mark.parametrize("args, error", [
    (["--repeats", "0"], "--repeats must be at least 1"), (["--tokens", "0"], "--tokens must be at least 1"),
    (["--layers", "0"], "--layers must be at least 1"), (["--experts", "8"], "--experts needs --moe"),
    (["--moe", "--moe-topk", "5"], "1 <= --moe-topk <= --experts, got 5 of 4"),
    (["--moe", "--experts", "0"], "got 2 of 0"), (["--shared-expert"], "--shared-expert needs --moe"),
    (["--tol", "nan"], "--tol must be a finite number > 0"), (["--tol", "inf"], "--tol must be a finite number > 0"),
    (["--tol", "-1"], "--tol must be a finite number > 0"),
])
def test_options_that_would_crash_or_be_ignored_are_refused(args, error, capsys):
    with pytest.raises(SystemExit):
        _example().parse(args)
    assert error in capsys.readouterr().err


def test_compare_fails_on_nan():
    """A NaN in the fused logits is the worst error, not one max() skips: the check fails, exact or not."""
    compare = _example().compare
    want = [torch.randn(2, 8), torch.randn(2, 8)]
    nan = [w.clone() for w in want]
    nan[1][0, 3] = float("nan")
    for exact in (False, True):
        c = compare(nan, want, 0.5, exact)
        assert not c["ok"] and c["rel_rms_err"] == float("inf"), c
    assert compare([w.clone() for w in want], want, 0.5, False)["ok"]
