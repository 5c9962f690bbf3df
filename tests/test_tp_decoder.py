"""examples/tp_decoder.py at CI size: a tensor-parallel Llama decoder over every rank, unfused and with
commfuse.fusion, eager and compiled (aot_eager on CPU); its checks must pass (bit for bit on CPU)."""
import importlib.util
import os
import sys

import pytest
import torch

mpi = pytest.mark.mpi  # any world size: world 1 exercises the local ops, more ranks the all-reduce tails
HERE = os.path.dirname(os.path.abspath(__file__))


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
])
def test_tp_decoder_tiny(comm, args, tmp_path):
    example = _example()
    res = example.main(["--size", "tiny", "--layers", "2", "--tokens", "8", "--decode-steps", "2", "--repeats", "1",
                        "--quiet", "--json", str(tmp_path / "out.json")] + args)
    assert res["ok"], res["checks"]
    world = torch.distributed.get_world_size()
    for name, check in res["checks"].items():
        if res["device"] == "cpu" and world <= 2:  # gloo's sum is commfuse's bits on 2 ranks only
            assert check["bit_identical"], (name, check)
        # per graph: 2 tails a layer + the first input norm (no add: a local op); a prefill graph, decode graph(s).
        # Each is fused or, with Inductor at world 1 (rewrite="auto"), left to it on evidence.
        matched = check["fused_ops"] + check["left_on_evidence"]
        assert matched >= 2 * (2 * 2 + 1) and matched % (2 * 2 + 1) == 0, (name, check)
    fused = "\n".join(r for reps in res["reports"].values() for r in reps)
    expect = "commfuse::fused_all_reduce" if world > 1 else "commfuse::fused_add_rmsnorm"
    assert expect in fused and "skipped" in fused, fused
    assert set(res["latency_ms"]) >= {"eager/unfused", "eager/fused"}
