"""commfuse-bench on the CPU: the harness runs end to end over gloo, writes the documented JSON and a
PNG, and its correctness gate rejects a wrong implementation (no time for it, a "rejected" row).

Not marked mpi: these tests start their own processes (launch/bench.sh runs mpirun), so under
`launch/test.sh N` they run once, on rank 0. The environment of the launching MPI job is removed
from the children (a nested mpirun would otherwise try to join it), and CUDA is hidden so that the
run is the CPU smoke run even on a GPU machine (the GPU numbers come from launch/bench.sh itself).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from commfuse import reference
from commfuse.cli import bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD_FIELDS = {"impl", "pattern", "dtype", "tokens", "hidden", "mode", "us", "us_min", "us_max", "frac_hbm"}
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID")


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_")) and k not in _LAUNCHER_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable,
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


# On a GPU machine launch/bench.sh runs the real benchmark (launch/device.sh, stage bench); the CPU smoke
# runs below would only spend that machine's time. CI (no GPU) runs them.
cpu_smoke = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("COMMFUSE_BENCH_CPU_TEST") != "1",
                               reason="GPU machine: the benchmark itself runs there (launch/bench.sh); "
                                      "set COMMFUSE_BENCH_CPU_TEST=1 to run the CPU smoke test anyway")


def _run(cmd, tmp_path, timeout=240):
    p = subprocess.run(cmd, cwd=tmp_path, env=_child_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited with {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def _load(out: pathlib.Path) -> dict:
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@cpu_smoke
def test_bench_sh_quick_on_cpu_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    p = _run([str(ROOT / "launch" / "bench.sh"), "2", "--quick", "--out", str(out), "--machine", "ci box"], tmp_path)
    assert "NOT GPU numbers" in p.stderr and "CPU/gloo: not GPU numbers" in p.stdout
    doc = _load(out)
    assert doc["machine"] == "ci box" and isinstance(doc["gpu"], str) and doc["gpu"]
    assert doc["world_size"] == 2 and doc["note"] == "CPU/gloo: not GPU numbers"
    assert isinstance(doc["versions"], dict) and doc["versions"]["torch"] == torch.__version__
    assert set(doc["ceilings"]) >= {"hbm_copy_GBps", "p2p_GBps"}
    assert doc["ceilings"]["hbm_copy_GBps"] > 0 and doc["ceilings"]["p2p_GBps"] is None

    records = doc["records"]
    assert records
    for r in records:
        assert set(r) == RECORD_FIELDS, r
        assert r["impl"] in bench.IMPLS and r["pattern"] in bench.PATTERNS and r["dtype"] in bench.DTYPES
        assert r["mode"] == "eager"  # no CUDA graphs on the CPU
        assert isinstance(r["tokens"], int) and isinstance(r["hidden"], int) and r["tokens"] > 0 < r["hidden"]
        assert all(isinstance(r[k], float) for k in ("us", "us_min", "us_max"))
        assert 0 < r["us_min"] <= r["us"] <= r["us_max"]
        if bench.IMPLS[r["impl"]].section == "tail":
            assert isinstance(r["frac_hbm"], float) and r["frac_hbm"] > 0
        else:
            assert r["frac_hbm"] is None
    ran = {(r["impl"], r["pattern"]) for r in records}
    for pattern in bench.QUICK_PATTERNS:
        for impl in ("nccl+eager", "commfuse-fallback", "commfuse-auto"):
            assert (impl, pattern) in ran, (impl, pattern)
        if pattern != "allreduce":
            assert ("tail-eager", pattern) in ran

    for s in doc["skipped"]:
        assert set(s) == {"impl", "pattern", "reason"} and s["reason"]
        assert not s["reason"].startswith(("rejected", "failed")), s  # every built-in row is right
    skipped = {(s["impl"], s["pattern"]) for s in doc["skipped"]}
    assert ("flashinfer", "residual_rmsnorm_fp8") in skipped and ("tail-commfuse", "residual_rmsnorm") in skipped
    assert not skipped & ran

    pngs = list(out.glob("bench-*-eager.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 1000
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BROKEN = r'''
import sys
from commfuse.cli import bench

def prepare(ctx, case):
    good = bench.IMPLS["nccl+eager"].prepare(ctx, case)
    def step(i):
        r = good(i)
        if case.pattern.tail:
            r.residual = r.residual + 1
        else:
            r.a = r.a + 1
        return r
    return step

bench.register(bench.Impl("broken", "collective", prepare, "test only: nccl+eager, off by one"))
bench.register(bench.Impl("broken-baseline", "collective", prepare, "test only: the same, timed anyway",
                          timed_if_wrong=True))
sys.exit(bench.main(sys.argv[1:]))
'''


@cpu_smoke
def test_gate_rejects_a_wrong_implementation(tmp_path):
    """A registered implementation that returns residual + 1 (or sum + 1) gets no time, only a
    rejected row, unless it is marked timed_if_wrong (then its records say "wrong"); a correct one
    next to it is timed. One process, world size 1, gloo."""
    out = tmp_path / "out"
    patterns = "allreduce,residual_rmsnorm,residual_rmsnorm_fp8"
    _run([sys.executable, "-c", BROKEN, "--quick", "--impls", "broken,broken-baseline,nccl+eager", "--patterns",
          patterns, "--shapes", "4x256", "--repeats", "1", "--calls-per-graph", "2", "--out", str(out)], tmp_path)
    doc = _load(out)
    assert doc["world_size"] == 1
    assert not [r for r in doc["records"] if r["impl"] == "broken"]
    assert all(r.get("wrong") is None for r in doc["records"] if r["impl"] == "nccl+eager")
    # A baseline marked timed_if_wrong (the torch.compile rows) is timed, its records say why it is wrong.
    marked = [r for r in doc["records"] if r["impl"] == "broken-baseline"]
    assert {r["pattern"] for r in marked} == set(patterns.split(","))
    assert all(isinstance(r["wrong"], str) and r["wrong"] for r in marked), marked
    assert {r["pattern"] for r in doc["records"] if r["impl"] == "nccl+eager"} == set(patterns.split(","))
    rejected = {s["pattern"]: s["reason"] for s in doc["skipped"] if s["impl"] == "broken"}
    assert set(rejected) == set(patterns.split(","))
    assert all(r.startswith("rejected") for r in rejected.values()), rejected
    assert "residual" in rejected["residual_rmsnorm"] and "all-reduce" in rejected["allreduce"]


def _tail(quant, t=32, h=256, return_norm=False):
    g = torch.Generator().manual_seed(7)
    a, residual = (torch.randn(t, h, generator=g).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    scale = torch.tensor([bench.SCALES[quant]]) if quant else None
    return bench.Result.of_tail(reference.fused_tail(a, residual, weight, 1e-6, quant, scale, return_norm))


def test_verdict_kind_of_agreed_verdicts():
    """Ranks' verdicts joined by agree() keep their kind: any rank raising is a failure (not a wrong
    result), all objecting ranks skipping is a skip; a gate's message is a rejection."""
    assert bench.verdict_kind("skip: no GPU") == "skip"
    assert bench.verdict_kind("rank 0: skip: plan is nccl; rank 1: skip: plan is nccl + fused") == "skip"
    assert bench.verdict_kind("prepare raised RuntimeError: boom") == "failed"
    assert bench.verdict_kind("raised P2PTimeoutError: rank 1 did not arrive") == "failed"
    oom = "rank 0: raised OutOfMemoryError: 1 GiB; rank 1: raised OutOfMemoryError: 2 GiB"
    assert bench.verdict_kind(oom) == "failed"
    assert bench.verdict_kind("rank 0: skip: x; rank 1: prepare raised ValueError: y") == "failed"
    assert bench.verdict_kind("rank 0: skip: x; rank 1: fp8 codes: 2e-2 of codes differ") == "rejected"
    assert bench.verdict_kind("residual: 3 of 8 elements beyond 1 ulp") == "rejected"


def test_check_follows_design_tolerances():
    """The gate's tolerances, without processes: 1 ulp passes, more does not; a rare neighbouring
    FP8 code passes, a code two steps off does not; all-zero NVFP4 output (what a peer's kernel
    writes on a GPU without e2m1 conversion) and unwritten scale factors are rejected."""
    P = bench.PATTERNS
    exp = _tail(None)
    ok = bench.Result(residual=exp.residual.clone(), norm=exp.norm.clone())
    assert bench.check(ok, exp, P["residual_rmsnorm"]) is None
    i = exp.residual.float().abs().argmax()  # a large element: one ulp there is > 0.5
    up = exp.residual.float().flatten()
    up[i] = torch.nextafter(up[i].bfloat16(), torch.tensor(float("inf")).bfloat16()).float()
    ok.residual = up.view(32, 256).bfloat16()
    assert bench.check(ok, exp, P["residual_rmsnorm"]) is None
    ok.residual = (exp.residual.float() + 1).bfloat16()
    assert "residual" in bench.check(ok, exp, P["residual_rmsnorm"])
    ok = bench.Result(residual=exp.residual, norm=None)
    assert "norm" in bench.check(ok, exp, P["residual_rmsnorm"])

    exp = _tail("fp8", t=64)
    codes = exp.quant.view(torch.uint8).clone()
    codes.view(-1)[5] += 1  # one neighbour among 16384 codes: within 1e-3
    res = bench.Result(residual=exp.residual, quant=codes.view(torch.float8_e4m3fn))
    assert bench.check(res, exp, P["residual_rmsnorm_fp8"]) is None
    codes.view(-1)[5] += 1
    assert "more than one step" in bench.check(res, exp, P["residual_rmsnorm_fp8"])
    # The FP8 NaN code is 0x7F: a negative NaN (0xFF) where the oracle has one is wrong.
    codes.view(-1)[5] -= 2
    exp.quant.view(torch.uint8).view(-1)[9] = 0x7F
    codes.view(-1)[9] = 0x7F
    assert bench.check(res, exp, P["residual_rmsnorm_fp8"]) is None
    codes.view(-1)[9] = 0xFF
    assert "more than one step" in bench.check(res, exp, P["residual_rmsnorm_fp8"])

    exp = _tail("nvfp4")
    res = bench.Result(residual=exp.residual, quant=torch.zeros_like(exp.quant), sf=exp.sf.clone())
    assert "nvfp4 codes" in bench.check(res, exp, P["residual_rmsnorm_nvfp4"])
    res = bench.Result(residual=exp.residual, quant=exp.quant, sf=torch.zeros_like(exp.sf))
    assert "scale factors" in bench.check(res, exp, P["residual_rmsnorm_nvfp4"])
    res = bench.Result(residual=exp.residual, quant=exp.quant, sf=exp.sf)
    assert bench.check(res, exp, P["residual_rmsnorm_nvfp4"]) is None


def test_tail_bytes_counts_each_tensor_once():
    P = bench.PATTERNS
    t, h = 128, 4096
    base = 3 * t * h * 2 + h * 2  # read a, residual, weight; write residual (bf16)
    assert bench.tail_bytes(P["residual_rmsnorm"], t, h, 2) == base + t * h * 2
    assert bench.tail_bytes(P["residual_rmsnorm_fp8"], t, h, 2) == base + t * h
    assert bench.tail_bytes(P["residual_rmsnorm_nvfp4_out"], t, h, 2) == base + t * h * 2 + t * h // 2 + t * h // 16


@pytest.mark.parametrize("argv, error", [(["--shapes", "64"], "TOKENSxHIDDEN"), (["--impls", "nope"], "unknown impl")])
def test_bad_options_are_named(argv, error, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert error in capsys.readouterr().err
