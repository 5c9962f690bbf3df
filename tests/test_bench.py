"""commfuse-bench on the CPU: the harness runs end to end over gloo, writes the documented JSON and a
PNG per mode (eager and host), and its correctness gate rejects a wrong implementation (no time for
it, a "rejected" row); the pieces (verdicts, gate, host timing, the table) are checked in-process.

Not marked mpi: these tests start their own processes (launch/bench.sh runs mpirun), so under
`launch/test.sh N` they run once, on rank 0. The environment of the launching MPI job is removed
from the children (a nested mpirun would otherwise try to join it), and CUDA is hidden so that the
run is the CPU smoke run even on a GPU machine (the GPU numbers come from launch/bench.sh itself).
"""
import argparse
import inspect
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest
import torch

from commfuse import reference, tolerance
from commfuse.bench import cases, cli, impls, report, timing
from commfuse.bench.context import Ctx
from commfuse.bench.verdict import OK, Kind, Skip, Verdict, combine

from processes import single_process_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD_FIELDS = {"impl", "pattern", "dtype", "tokens", "hidden", "mode", "us", "us_min", "us_max", "frac_hbm",
                 "frac_link"}


def _child_env() -> dict:
    return single_process_env(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable,
                              PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


# On a GPU machine launch/bench.sh runs the real benchmark (launch/device.sh, stage bench); the CPU smoke
# runs below would only spend that machine's time (and there an mpirun started inside a rank of the
# suite's mpirun finds no rsh agent: the device image has no ssh). CI (no GPU) runs them.
cpu_smoke = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("COMMFUSE_BENCH_CPU_TEST") != "1",
                               reason="GPU machine: the benchmark itself runs there (launch/bench.sh); "
                                      "set COMMFUSE_BENCH_CPU_TEST=1 to run the CPU smoke test anyway")


def _run(cmd, tmp_path, timeout=240):
    p = subprocess.run(cmd, cwd=tmp_path, env=_child_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited with {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def assert_tail_rows_frac_hbm(doc, t, h):
    """Every tail-eager row's frac_hbm is its pattern's tail bytes (bf16) over its time, at the HBM ceiling."""
    for r in doc["records"]:
        if r["impl"] == "tail-eager":
            frac = cases.tail_bytes(cases.PATTERNS[r["pattern"]], t, h, 2) / (r["us"] * 1e-6) \
                / (doc["ceilings"]["hbm_copy_GBps"] * 1e9)
            assert r["frac_hbm"] == pytest.approx(frac, rel=1e-2, abs=1e-4), r


def _load(out: pathlib.Path) -> dict:
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _fake_tree(root: pathlib.Path) -> None:
    """A checkout whose commfuse.bench only records which tree ran it (in --out/tree.txt), and whose
    launch/bench.sh is this one without PYTHONSAFEPATH (as in checkouts from before it)."""
    (root / "launch").mkdir(parents=True)
    script = (ROOT / "launch" / "bench.sh").read_text()
    assert "export PYTHONSAFEPATH=1\n" in script
    (root / "launch" / "bench.sh").write_text(script.replace("export PYTHONSAFEPATH=1\n", ""))
    (root / "commfuse" / "bench").mkdir(parents=True)
    (root / "commfuse" / "__init__.py").write_text("")
    (root / "commfuse" / "bench" / "__init__.py").write_text("")
    (root / "commfuse" / "bench" / "__main__.py").write_text(
        "import pathlib, sys\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'tree.txt').write_text(__file__)\n")


@cpu_smoke
def test_ab_sh_runs_each_tree_with_its_own_commfuse(tmp_path):
    """launch/ab.sh started from this tree's root: the base runs must import the base tree's commfuse,
    not the working directory's (python -m puts it first on sys.path), and the other two this tree's."""
    base = tmp_path / "base"
    _fake_tree(base)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(ROOT / "launch" / "ab.sh"), str(base), "1", str(out), "--help"], cwd=ROOT,
                       env=_child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for half in ("base", "base-2"):  # the order is base, new, new, base
        assert (out / half / "tree.txt").read_text().startswith(str(base)), f"the {half} run ran another tree"
    assert p.stdout.count("usage:") == 2 and not any((out / half / "tree.txt").exists() for half in ("new", "new-2"))


@cpu_smoke
@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH (bench.sh) needs Python 3.11")
def test_bench_sh_ignores_a_commfuse_in_the_working_directory(tmp_path):
    """Run from another checkout's root, launch/bench.sh benchmarks its own tree."""
    _fake_tree(tmp_path / "other")
    p = subprocess.run([str(ROOT / "launch" / "bench.sh"), "1", "--out", str(tmp_path / "out"), "--help"],
                       cwd=tmp_path / "other", env=_child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert not (tmp_path / "out" / "tree.txt").exists()


@cpu_smoke
def test_bench_sh_quick_on_cpu_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    # Host mode only (the CPU drops graph): on the CPU eager mode runs the same loop, and the
    # default modes run in test_gate_rejects_a_wrong_implementation.
    p = _run([str(ROOT / "launch" / "bench.sh"), "2", "--quick", "--modes", "graph,host", "--out", str(out),
              "--machine", "ci box"], tmp_path)
    assert "NOT GPU numbers" in p.stderr and "CPU/gloo: not GPU numbers" in p.stdout
    doc = _load(out)
    assert doc["machine"] == "ci box" and isinstance(doc["gpu"], str) and doc["gpu"]
    assert doc["world_size"] == 2 and doc["note"] == "CPU/gloo: not GPU numbers" and doc["shared_gpu"] is False
    assert isinstance(doc["versions"], dict) and doc["versions"]["torch"] == torch.__version__
    assert set(doc["ceilings"]) >= {"hbm_copy_GBps", "p2p_GBps"}
    assert doc["ceilings"]["hbm_copy_GBps"] > 0 and doc["ceilings"]["p2p_GBps"] is None
    assert doc["config"]["modes"] == ["host"]  # no CUDA graphs on the CPU

    records = doc["records"]
    assert records
    for r in records:
        assert set(r) == RECORD_FIELDS, r
        assert r["impl"] in impls.IMPLS and r["pattern"] in cases.PATTERNS and r["dtype"] in cases.DTYPES
        assert r["mode"] == "host"
        assert isinstance(r["tokens"], int) and isinstance(r["hidden"], int) and r["tokens"] > 0 < r["hidden"]
        assert all(isinstance(r[k], float) for k in ("us", "us_min", "us_max"))
        assert 0 < r["us_min"] <= r["us"] <= r["us_max"]
        assert r["frac_hbm"] is None and r["frac_link"] is None  # host times: no share of a ceiling
    ran = {(r["impl"], r["pattern"]) for r in records}
    for pattern in cases.QUICK_PATTERNS:
        for impl in ("nccl+eager", "commfuse-fallback", "commfuse-auto", "torch-add"):
            assert (impl, pattern) in ran, (impl, pattern)
        if pattern != "allreduce":
            assert ("tail-eager", pattern) in ran
    # One elementwise op costs the host far less than a gloo collective and a tail.
    us = {(r["impl"], r["pattern"], r["tokens"]): r["us"] for r in records}
    auto = [(k, v) for k, v in us.items() if k[0] == "commfuse-auto"]
    assert len(auto) == 2 * len(cases.QUICK_PATTERNS)
    assert all(us[("torch-add",) + k[1:]] < v for k, v in auto), us
    assert "== host: residual_rmsnorm bf16\n" in p.stdout and " x add " in p.stdout

    for s in doc["skipped"]:
        assert set(s) == {"impl", "pattern", "reason"} and s["reason"]
        assert not s["reason"].startswith(("rejected", "failed")), s  # every built-in row is right
    skipped = {(s["impl"], s["pattern"]) for s in doc["skipped"]}
    assert ("flashinfer", "residual_rmsnorm_fp8") in skipped and ("tail-commfuse", "residual_rmsnorm") in skipped
    assert not skipped & ran

    pngs = list(out.glob("bench-*.png"))
    assert [p.name for p in pngs] == ["bench-ci_box-host.png"] and pngs[0].stat().st_size > 1000
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BROKEN = r'''
import sys
from commfuse.bench import cli, impls

def prepare(ctx, case):
    good = impls.IMPLS["nccl+eager"].prepare(ctx, case)
    def step(i):
        r = good.result(good.call(i))
        if case.pattern.tail:
            r.residual = r.residual + 1
        else:
            r.a = r.a + 1
        return r
    return impls.Step(step)

impls.register(impls.Impl("broken", "collective", prepare, "test only: nccl+eager, off by one"))
impls.register(impls.Impl("broken-baseline", "collective", prepare, "test only: the same, timed anyway",
                          timed_if_wrong=True))
sys.exit(cli.main(sys.argv[1:]))
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
    assert doc["world_size"] == 1 and doc["config"]["modes"] == ["eager"]  # the default graph,eager on the CPU
    assert not [r for r in doc["records"] if r["impl"] == "broken"]
    assert all(r.get("wrong") is None for r in doc["records"] if r["impl"] == "nccl+eager")
    # A baseline marked timed_if_wrong (the torch.compile rows) is timed, its records say why it is wrong.
    marked = [r for r in doc["records"] if r["impl"] == "broken-baseline"]
    assert {r["pattern"] for r in marked} == set(patterns.split(","))
    assert all(isinstance(r["wrong"], str) and r["wrong"] for r in marked), marked
    assert {r["pattern"] for r in doc["records"] if r["impl"] == "nccl+eager"} == set(patterns.split(","))
    rejected = {s["pattern"]: s["reason"] for s in doc["skipped"] if s["impl"] == "broken"}
    assert set(rejected) == set(patterns.split(","))
    assert all(r.startswith("rejected (bf16 4x256): ") for r in rejected.values()), rejected
    assert "residual" in rejected["residual_rmsnorm"] and "all-reduce" in rejected["allreduce"]


WRONG_COMMFUSE = r'''
import os, sys
import torch
import commfuse
from commfuse.bench import cli

real, first, calls = commfuse.Communicator.fused_all_reduce, {}, {}

def fused_all_reduce(self, x, residual, weight, *args, out=None, **kw):
    wrong = os.environ["WRONG"]
    if wrong == "out" and out is not None:
        return out  # writes nothing into the caller's outputs
    if wrong == "out after the gate" and out is not None:
        calls["out"] = calls.get("out", 0) + 1
        if calls["out"] > 2:
            return out  # right on the gate's two calls, then writes nothing into the caller's outputs
    key = (tuple(x.shape), out is not None)
    if wrong == "stale" and key in first:
        return first[key][0]  # the first call's outputs again
    r = real(self, x, residual, weight, *args, out=out, **kw)
    calls[key] = n = calls.get(key, 0) + 1
    if (wrong == "later" and n > 1  # right at a signature's first call only
            or wrong == "other set" and key in first and x.data_ptr() != first[key][1]  # right on one input set
            or wrong == "third" and n > 2):  # right on the gate's two calls only
        r.residual.add_(1)
    if wrong == "rounded":
        r.residual.view(torch.int16).add_(1)  # one ulp off: the tolerance's, not commfuse's bits
    first.setdefault(key, (r, x.data_ptr()))
    return r

commfuse.Communicator.fused_all_reduce = fused_all_reduce
sys.exit(cli.main(sys.argv[1:]))
'''


BOTH = {"commfuse-auto", "commfuse-auto-out"}


@cpu_smoke
@pytest.mark.parametrize("wrong, rejected, where", [
    ("out", {"commfuse-auto-out"}, ""), ("later", BOTH, "checked call 2 (input set 1)"),
    ("stale", BOTH, "checked call 2 (input set 1)"),
    ("other set", BOTH, "checked call 2 (input set 1)"), ("third", BOTH, "the last timed call (eager)"),
    ("out after the gate", {"commfuse-auto-out"}, "the last timed call (eager)"), ("rounded", BOTH, "residual: ")])
def test_gate_checks_caller_outputs_and_calls_from_the_plan_table(tmp_path, wrong, rejected, where):
    """A row whose out= path writes nothing (its outputs are poisoned before each checked call); whose calls after
    a signature's first (those the plan table launches, as the timed ones) are wrong, or return the first call's
    outputs again, or are right on the first input set only (the second checked call reads another); which is
    right on the gate's calls and wrong on later ones (the last timed call is checked too); whose out= path
    writes nothing after the gate's calls (poisoned again before the timed calls: the last one reads set 1, as
    the gate's second call did, whose outputs would still be there); or whose residual is one ulp off
    (commfuse's rows are held to its bits): each is rejected, and commfuse-bench exits 1."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", WRONG_COMMFUSE, "--quick", "--impls", "commfuse-auto,commfuse-auto-out",
                        "--patterns", "residual_rmsnorm_fp8", "--shapes", "4x256", "--repeats", "1",
                        "--calls-per-graph", "2", "--out", str(out)], cwd=tmp_path, env={**_child_env(), "WRONG": wrong},
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr[-3000:]
    doc = _load(out)
    assert {r["impl"] for r in doc["records"]} == BOTH - rejected
    reasons = {s["impl"]: s["reason"] for s in doc["skipped"]}
    assert set(reasons) == rejected, reasons
    assert all(where in r for r in reasons.values()), reasons


COMPUTED = ("residual_rmsnorm_fp8_per_token", "residual_rmsnorm_fp8_block", "residual_rmsnorm_fp8_block_ue8m0")
NEW_PATTERNS = COMPUTED + ("residual_gemma_rmsnorm_fp8",)

SCALES_OFF = r'''
import sys
from commfuse.bench import cli, impls
from commfuse.bench.verdict import Skip

def prepare(ctx, case):
    if case.pattern.quant not in ("fp8_per_token", "fp8_block"):
        raise Skip("no computed scales")
    good = impls.IMPLS["commfuse-auto"].prepare(ctx, case)
    def step(i):
        r = good.result(good.call(i))
        r.scales = r.scales.clone()
        r.scales.view(-1)[0] *= 4  # a scale (or UE8M0 exponents) far from the oracle's
        return r
    return impls.Step(step)

impls.register(impls.Impl("scales-off", "collective", prepare, "test only: commfuse-auto, one scale off"))
sys.exit(cli.main(sys.argv[1:]))
'''


@cpu_smoke
def test_computed_scale_patterns_run_every_cpu_row(tmp_path):
    """The computed-scale and Gemma patterns (not in the default list) through the CLI at world size 1:
    every row that runs on the CPU (the commfuse rows take the separated route: exact) passes the gate
    and is timed, FlashInfer skips with its reason, tail rows' frac_hbm counts the scales; a commfuse
    row with one scale off is rejected."""
    out = tmp_path / "out"
    rows = "nccl+eager,commfuse-fallback,commfuse-auto,commfuse-auto-out,commfuse-ops,tail-eager,flashinfer"
    _run([sys.executable, "-c", SCALES_OFF, "--impls", rows + ",scales-off", "--patterns", ",".join(NEW_PATTERNS),
          "--shapes", "5x256", "--dtypes", "bf16", "--modes", "eager", "--repeats", "1", "--calls-per-graph", "2", "--out", str(out)],
         tmp_path)
    doc = _load(out)
    ran = {(r["impl"], r["pattern"]) for r in doc["records"]}
    timed = set(rows.split(",")) - {"flashinfer"}
    assert ran == {(i, p) for i in timed for p in NEW_PATTERNS}, ran
    assert all("wrong" not in r for r in doc["records"])
    assert_tail_rows_frac_hbm(doc, 5, 256)
    skipped = {(s["impl"], s["pattern"]): s["reason"] for s in doc["skipped"]}
    assert {p for i, p in skipped if i == "flashinfer"} == set(NEW_PATTERNS)
    rejected = {p: why for (i, p), why in skipped.items() if i == "scales-off" and p in COMPUTED}
    assert set(rejected) == set(COMPUTED), skipped
    assert all(why.startswith("rejected (bf16 5x256): ") and "scales" in why for why in rejected.values()), rejected


def _tail(quant, t=32, h=256, return_norm=False):
    g = torch.Generator().manual_seed(7)
    a, residual = (torch.randn(t, h, generator=g).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    scale = torch.tensor([cases.SCALES[quant]]) if quant else None
    return cases.Result.of_tail(reference.fused_tail(a, residual, weight, 1e-6, quant, scale, return_norm))


def test_combine_keeps_the_worst_kind_of_the_ranks_verdicts():
    """Ranks' verdicts combined into one: OK only when every rank is OK; any rank failing (raising)
    is a failure, not a wrong result; a wrong result on one rank is a rejection even if the others
    skipped; all objecting ranks skipping is a skip. The reason names the objecting ranks unless
    every rank said the same."""
    skip_x, skip_y = Verdict(Kind.SKIP, "x"), Verdict(Kind.SKIP, "y")
    wrong = Verdict(Kind.REJECTED, "fp8 codes: 2e-2 of codes differ")
    boom = Verdict(Kind.FAILED, "prepare raised ValueError: boom")
    assert combine([OK, OK]) is OK and combine([]) is OK
    assert combine([skip_x]) == skip_x and combine([skip_x, skip_x, skip_x]) == skip_x
    assert combine([skip_x, skip_y]) == Verdict(Kind.SKIP, "rank 0: x; rank 1: y")
    assert combine([OK, skip_x]) == Verdict(Kind.SKIP, "rank 1: x")
    assert combine([skip_x, wrong]) == Verdict(Kind.REJECTED, f"rank 0: skip: x; rank 1: {wrong.reason}")
    assert combine([wrong, OK, boom]) == Verdict(Kind.FAILED, f"rank 0: rejected: {wrong.reason}; rank 2: {boom.reason}")
    oom = [Verdict(Kind.FAILED, "raised OutOfMemoryError: 1 GiB"), Verdict(Kind.FAILED, "raised OutOfMemoryError: 2 GiB")]
    assert combine(oom) == Verdict(Kind.FAILED, "rank 0: raised OutOfMemoryError: 1 GiB; rank 1: raised OutOfMemoryError: 2 GiB")


def _args(**kw):
    base = dict(seed=0, eps=1e-6, quick=True, compile_all=False, warmup=1, repeats=3, calls_per_graph=4,
                shape_list=[(4, 256)])
    return argparse.Namespace(**{**base, **kw})


def _ctx(world=1, backend="gloo", **kw):
    return Ctx(_args(**kw), rank=0, world=world, backend=backend, device=torch.device("cpu"))


class _GpuCtx(Ctx):
    """A Ctx that takes the GPU code paths while its tensors stay on the CPU."""
    cuda = True


def test_a_row_that_skips_the_exchange_on_later_sets_is_rejected():
    """Every input set holds different inputs on each rank, dense and MoE: a row right on set 0 that then
    returns world x (its own rows, a peer's buffer never read) fails the gate's second call and the
    check after the timing (cli.checked_after's set)."""
    for name in ("residual_rmsnorm", "moe_k2_residual_rmsnorm", "moe_finalize_k2_residual_rmsnorm"):
        p = cases.PATTERNS[name]
        ranks = [cases.make_case(Ctx(_args(), rank=r, world=2, backend="gloo", device=torch.device("cpu")), p,
                                 "bf16", 4, 256) for r in (0, 1)]
        case, impl = ranks[0], impls.IMPLS["nccl+eager"]
        assert len(case.sets) >= 2
        for i in range(1, len(case.sets)):
            assert not torch.equal(case.input_set(i)[0], ranks[1].input_set(i)[0]), (name, i)
            assert torch.equal(case.input_set(i)[1], ranks[1].input_set(i)[1]), (name, i)  # one residual

        def lonely(i):  # the exchange on set 0 only (the peer's x drawn alike), then its own rows doubled
            x, residual = case.input_set(i)
            a = x + ranks[1].input_set(i)[0] if i % len(case.sets) == 0 else x * 2
            return cases.Result.of_tail(reference.fused_tail(a, residual, *case.tail_args()))
        verdict, _ = cases.gate(_ctx(), impls.Step(lonely, checked_calls=2), lambda r, i: impl.mismatch(case, r, i))
        assert verdict.kind is Kind.REJECTED and verdict.reason.startswith("checked call 2"), (name, verdict)
        for i in range(1, len(case.sets)):
            assert impl.mismatch(case, lonely(i), i), (name, i)


def test_torch_add_is_gated_against_its_own_definition():
    """torch-add's one call is x + residual rounded once (exact), and the gate says so; the same
    step off by one ulp somewhere, or raising, is rejected or failed. Its outputs rotate with the
    input sets and do not accumulate between calls."""
    ctx = _ctx()
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 4, 256)
    add = impls.IMPLS["torch-add"]
    step = add.prepare(ctx, case)
    assert step.no_graph is None
    verdict, res = cases.gate(ctx, step, lambda r, i: add.mismatch(case, r, i))
    assert verdict is OK
    x, residual = case.sets[0]
    assert torch.equal(res.a, (x.float() + residual.float()).bfloat16())
    step.call(0)
    assert torch.equal(step.call(0).a, (x.float() + residual.float()).bfloat16())  # no state between calls

    def off(i):
        r = step.call(i)
        r.a.view(-1)[3] = torch.nextafter(r.a.view(-1)[3], torch.tensor(float("inf")).bfloat16())
        return r
    verdict, _ = cases.gate(ctx, impls.Step(off), lambda r, i: add.mismatch(case, r, i))
    assert verdict.kind is Kind.REJECTED and "x + residual" in verdict.reason
    verdict, _ = cases.gate(ctx, impls.Step(lambda i: 1 / 0), lambda r, i: add.mismatch(case, r, i))
    assert verdict == Verdict(Kind.FAILED, "the checked call raised ZeroDivisionError: division by zero")
    # Judged by the oracle instead, its output (no tail) is not even comparable: a rejection.
    verdict, _ = cases.gate(ctx, step, lambda r, i: impls.IMPLS["tail-eager"].mismatch(case, r, i))
    assert verdict.kind is Kind.REJECTED and "not comparable with the oracle" in verdict.reason


def test_the_largest_shapes_still_get_a_second_input_set():
    """However large a set (here 64 MiB, twice the CPU's stand-in last-level cache), a case rotates among two:
    a row whose every call after the first returns the first call's outputs (no work) is rejected by the gate's
    second call, which reads set 1, rather than passing on set 0 again; a right one passes."""
    ctx = _ctx()
    assert cases._input_sets(ctx, 1, 8, torch.bfloat16, per_set=1 << 40) == 2
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 1024, 16384)
    assert len(case.sets) == 2 and not torch.equal(case.sets[0][0], case.sets[1][0])
    impl = impls.IMPLS["tail-eager"]
    good, first = impl.prepare(ctx, case), []

    def stale(i):
        if not first:
            first.append(good.result(good.call(i)))
        return first[0]
    verdict, _ = cases.gate(ctx, impls.Step(stale, checked_calls=2), lambda r, i: impl.mismatch(case, r, i))
    assert verdict.kind is Kind.REJECTED and verdict.reason.startswith("checked call 2"), verdict
    verdict, _ = cases.gate(ctx, impls.Step(good.call, result=good.result, checked_calls=2), lambda r, i: impl.mismatch(case, r, i))
    assert verdict is OK


def test_host_mode_times_the_loop_alone(monkeypatch):
    """Host mode: per call, K calls' wall time with the GPU synchronised before the clock starts and
    after it stops, outside the timed region: a 20 ms synchronize shows in no repeat. A row that
    cannot be captured skips graph mode without running."""
    log = []

    def slow_sync():
        log.append("S")
        time.sleep(0.02)
    monkeypatch.setattr(torch.cuda, "synchronize", slow_sync)
    ctx = _GpuCtx(_args(warmup=2, repeats=2, calls_per_graph=3), 0, 1, "nccl", torch.device("cpu"))
    step = impls.Step(lambda i: log.append(i))
    times, verdict, _, index = timing.time_step(ctx, step, "host", 2)
    assert verdict is OK and len(times) == 2
    assert all(0 < t < 2000 for t in times), times  # 20 ms / 3 calls would be 6667 us per call
    # warm-up, then per repeat: align's synchronize, the one before the clock, 3 calls (the rotation over the
    # input sets going on), the one after.
    assert log == [0, 1] + ["S", "S", 2, 3, 4, "S"] + ["S", "S", 5, 6, 7, "S"] and index == 7

    log.clear()
    step = impls.Step(lambda i: time.sleep(0.004), no_graph=impls.GLOO_NO_GRAPH)
    times, verdict, _, _ = timing.time_step(ctx, step, "host", 2)
    assert verdict is OK and all(t >= 4000 for t in times)  # per call, not per loop
    times, verdict, _, _ = timing.time_step(ctx, step, "graph", 2)
    assert times is None and verdict == Verdict(Kind.SKIP, "graph mode: gloo collectives cannot be captured in a CUDA graph")


def test_host_mode_on_the_cpu():
    ctx = _ctx(warmup=0, repeats=3, calls_per_graph=5)
    calls = []
    times, verdict, _, _ = timing.time_step(ctx, impls.Step(calls.append), "host", 4)
    assert verdict is OK and len(times) == 3 and calls == list(range(15))


def test_caller_owned_outputs_are_poisoned_before_the_timed_calls():
    """Each mode's timed calls start from poisoned outputs: Step.poison runs after the warm-up, before the first
    timed call, so what the gate's or the warm-up's calls wrote cannot pass for the timed calls' outputs."""
    ctx = _ctx(warmup=2, repeats=2, calls_per_graph=3)
    log = []
    step = impls.Step(log.append, poison=lambda: log.append("poison"))
    for mode in ("eager", "host"):
        log.clear()
        times, verdict, _, _ = timing.time_step(ctx, step, mode, 3)
        assert verdict is OK and log == [0, 1, "poison"] + list(range(2, 8)), (mode, log)


@pytest.mark.parametrize("calls_per_graph", [1, 2, 3])
def test_the_check_after_the_timing_reads_another_set_than_the_gates_first(calls_per_graph):
    """A row right on input set 0 only (every later call returns set 0's outputs): the gate's one checked call
    passes, and the check after the timing rejects it whatever the call count. The timed calls went back to set 0
    each repeat, and the check read set (K - 1) % n: set 0 again for K = 1, or for an odd K over two sets."""
    ctx = _ctx(warmup=1, repeats=2, calls_per_graph=calls_per_graph)
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 4, 256)
    impl = impls.IMPLS["tail-eager"]
    good = impl.prepare(ctx, case)
    first = good.result(good.call(0))
    read = []

    def lazy(i):
        read.append(i % len(case.sets))
        return first
    step = impls.Step(lazy)
    mismatch = lambda r, i: impl.mismatch(case, r, i)  # noqa: E731
    assert cases.gate(ctx, step, mismatch)[0] is OK
    times, verdict, last, index = timing.time_step(ctx, step, "host", len(case.sets))
    assert verdict is OK and index % len(case.sets) != 0 and set(read[1:]) != {0}
    verdict = cli.checked_after(ctx, case, step, "host", last, index, mismatch)
    assert verdict.kind is Kind.REJECTED and verdict.reason.startswith("the last timed call (host)"), verdict


def test_a_gate_of_two_calls_stops_on_every_rank_where_one_rejects_the_first(monkeypatch):
    """The ranks agree on the first checked call's verdict before the second (a collective): a rank that rejected
    it alone returned while its peers went on into the second call, and they waited there for the timeout."""
    ctx = _ctx(world=2)
    agreed = []

    def peers_reject(world, verdict):  # this rank's call was right; a peer's was not
        agreed.append(verdict)
        return Verdict(Kind.REJECTED, "rank 1: rejected")
    monkeypatch.setattr(cases, "agree", peers_reject)
    calls = []
    verdict, _ = cases.gate(ctx, impls.Step(lambda i: calls.append(i) or i, checked_calls=2), lambda r, i: None)
    assert calls == [0] and agreed == [OK] and verdict == Verdict(Kind.REJECTED, "rank 1: rejected")


def test_torch_adds_outputs_are_poisoned():
    """torch-add writes outputs of its own (one a set): poisoned before its timed calls like commfuse's, so a call
    that wrote nothing does not pass on the gate's or the warm-up's sums."""
    ctx = _ctx()
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 4, 256)
    step = impls.IMPLS["torch-add"].prepare(ctx, case)
    outs = [step.call(i).a for i in range(len(case.sets))]
    assert step.poison is not None
    step.poison()
    assert all(bool(o.isnan().all()) for o in outs)


def test_flashinfer_outputs_are_poisoned_before_the_timed_calls():
    """FlashInfer's output buffers (the harness's) are poisoned before each mode's timed calls as before the gate's
    call: a stand-in that writes them on its first call only is rejected by the check after the timing, also where
    the last timed call reads the gate's input set (K = 1), whose outputs would otherwise still be there."""
    calls = []

    def fuse(allreduce_in, residual_in, residual_out, norm_out, rms_gamma, rms_eps):
        calls.append(allreduce_in)
        if len(calls) == 1:
            tail = reference.fused_tail(allreduce_in, residual_in, rms_gamma, rms_eps)
            residual_out.copy_(tail.residual)
            norm_out.copy_(tail.norm)

    args = cli.parse_args(["--impls", "flashinfer", "--patterns", "residual_rmsnorm", "--shapes", "4x256", "--dtypes",
                           "bf16", "--modes", "eager,host", "--repeats", "1", "--calls-per-graph", "1",
                           "--warmup", "1"])
    ctx = Ctx(args, 0, 1, "gloo", torch.device("cpu"))
    ctx.cache["flashinfer"] = {"fuse": fuse, "patterns": types.SimpleNamespace(kARResidualRMSNorm=1), "version": "test",
                               "params": inspect.signature(fuse).parameters, "swizzled": 0}
    ctx.cache["flashinfer_ws"] = (None, torch.zeros(1))
    records, skipped, status = cli.run_cases(ctx, {"hbm_copy_GBps": None, "p2p_GBps": None})
    assert len(calls) == 1 + 2 * (1 + 1)  # the gate's call; per mode one warm-up and one timed call
    assert not records and status == {("flashinfer", "residual_rmsnorm", "bf16", 4, 256, m): Kind.REJECTED
                                      for m in ("eager", "host")}
    assert [s["reason"].split(": ")[1] for s in skipped] == [f"the last timed call ({m})" for m in ("eager", "host")]


def test_rows_cope_with_ranks_sharing_a_gpu(monkeypatch):
    """gloo with CUDA inputs: the nccl+* rows skip graph mode (gloo cannot be captured), FlashInfer's dense
    rows skip, and a commfuse whose Communicator takes another device's tensors skips (remembered)."""
    ctx = _ctx()
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 4, 256)
    assert impls.IMPLS["nccl+eager"].prepare(ctx, case).no_graph == impls.GLOO_NO_GRAPH
    assert impls.IMPLS["nccl+eager"].prepare(_ctx(backend="nccl"), case).no_graph is None

    shared = _GpuCtx(_args(), 0, 2, "gloo", torch.device("cpu"))
    assert shared.shared_gpu and not _GpuCtx(_args(), 0, 2, "nccl", torch.device("cpu")).shared_gpu
    with pytest.raises(Skip, match="^its all-reduce fusion hangs on ranks sharing a GPU "):
        impls.IMPLS["flashinfer"].prepare(shared, case)

    made = []
    monkeypatch.setattr(impls, "Communicator", lambda strategy: made.append(strategy) or types.SimpleNamespace(
        device=torch.device("cuda", 0), backend="gloo", check_calls=True))
    for _ in range(2):
        with pytest.raises(Skip, match=r"over gloo works on cuda:0 tensors, the inputs are on cpu"):
            impls.IMPLS["commfuse-auto"].prepare(ctx, case)
    assert made == ["auto"]


def test_a_communicator_that_raises_fails_commfuses_rows(monkeypatch):
    """An error in making the Communicator is commfuse's: its rows FAIL (not "-", not applicable), every case
    saying why, with one attempt at making it a strategy; a baseline next to them runs."""
    made = []

    def broken(strategy):
        made.append(strategy)
        raise RuntimeError("bug in Communicator.__init__")
    monkeypatch.setattr(impls, "Communicator", broken)
    args = cli.parse_args(["--impls", "commfuse-fallback,commfuse-auto,tail-eager", "--patterns", "residual_rmsnorm",
                           "--shapes", "4x256,8x256", "--dtypes", "bf16", "--modes", "eager", "--repeats", "1",
                           "--calls-per-graph", "1", "--warmup", "0"])
    records, skipped, status = cli.run_cases(Ctx(args, 0, 1, "gloo", torch.device("cpu")),
                                             {"hbm_copy_GBps": None, "p2p_GBps": None})
    assert made == ["nccl", "auto"]
    assert {(r["impl"], r["tokens"]) for r in records} == {("tail-eager", 4), ("tail-eager", 8)}
    assert status == {(i, "residual_rmsnorm", "bf16", t, 256, "eager"): Kind.FAILED
                      for i in ("commfuse-fallback", "commfuse-auto") for t in (4, 8)}
    why = "prepare raised RuntimeError: Communicator(strategy='auto') raised RuntimeError: bug in Communicator.__init__"
    assert {s["reason"] for s in skipped if s["impl"] == "commfuse-auto"} == {
        f"failed (bf16 {t}x256): {why}" for t in (4, 8)}


def _rec(impl, us, mode, t=4, pattern="residual_rmsnorm"):
    return {"impl": impl, "pattern": pattern, "dtype": "bf16", "tokens": t, "hidden": 256, "mode": mode,
            "us": us, "us_min": us, "us_max": us, "frac_hbm": None, "frac_link": None}


def test_host_table_gives_commfuse_rows_their_ratio_to_torch_add():
    args = cli.parse_args(["--modes", "eager,host", "--shapes", "4x256,8x256", "--dtypes", "bf16", "--patterns",
                           "residual_rmsnorm", "--impls", "nccl+eager,commfuse-auto,commfuse-p2p,torch-add"])
    records = [_rec("torch-add", 2.0, "host"), _rec("commfuse-auto", 5.0, "host"), _rec("nccl+eager", 7.0, "host"),
               _rec("torch-add", 4.0, "host", t=8), _rec("commfuse-auto", 6.0, "host", t=8),
               _rec("torch-add", 1.0, "eager"), _rec("commfuse-auto", 3.0, "eager")]
    doc = {"machine": "m", "gpu": "g", "world_size": 2, "backend": "gloo", "date": "d", "versions": {},
           "ceilings": {"hbm_copy_GBps": None, "p2p_GBps": None}, "records": records, "skipped": [], "plans": [],
           "shared_gpu": True}
    status = {("commfuse-p2p", "residual_rmsnorm", "bf16", t, 256, m): Kind.SKIP for t in (4, 8) for m in ("eager", "host")}
    text = report.format_table(doc, status, args)
    blocks = {b.split("\n")[0]: b.split("\n")[1:] for b in text.split("\n== ")[1:]}
    eager = blocks["eager: residual_rmsnorm bf16 -- ranks share GPUs: correctness mode, not speed numbers"]
    host = blocks["host: residual_rmsnorm bf16"]
    assert eager[0].split() == ["tokens", "x", "hidden", "torch-add", "nccl+eager", "commfuse-auto", "commfuse-p2p"]
    # commfuse-p2p has no time anywhere: no ratio column for it.
    assert host[0].split() == ["tokens", "x", "hidden", "torch-add", "nccl+eager", "commfuse-auto", "x", "add",
                               "commfuse-p2p"]
    assert host[1].split() == ["4", "x", "256", "2.0", "7.0", "5.0", "2.50", "-"]
    assert host[2].split() == ["8", "x", "256", "4.0", "6.0", "1.50", "-"]


def test_host_records_get_no_share_of_a_ceiling():
    """frac_hbm (and frac_link) are the graph and eager records': a host record's time is the host's work on the
    launches, so it gets none, and the host table's title names no ceiling; the eager record of the same tail
    gets its bytes over its time at the HBM ceiling."""
    args = cli.parse_args(["--impls", "tail-eager,torch-add", "--patterns", "residual_rmsnorm_fp8", "--shapes",
                           "64x512", "--dtypes", "bf16", "--modes", "eager,host", "--repeats", "1",
                           "--calls-per-graph", "2", "--warmup", "0"])
    ceilings = {"hbm_copy_GBps": 10.0, "p2p_GBps": 400.0}
    records, _, status = cli.run_cases(Ctx(args, 0, 1, "gloo", torch.device("cpu")), ceilings)
    frac = {(r["impl"], r["mode"]): (r["frac_hbm"], r["frac_link"]) for r in records}
    assert frac[("tail-eager", "host")] == frac[("torch-add", "host")] == frac[("torch-add", "eager")] == (None, None)
    eager = next(r for r in records if (r["impl"], r["mode"]) == ("tail-eager", "eager"))
    bytes_ = cases.tail_bytes(cases.PATTERNS["residual_rmsnorm_fp8"], 64, 512, 2)
    # frac_hbm is recorded to 4 decimals (half a unit off at most), from the time before its rounding to 3.
    assert eager["frac_hbm"] == pytest.approx(bytes_ / (eager["us"] * 1e-6) / 10e9, rel=1e-3, abs=6e-5)
    doc = {"machine": "m", "gpu": "g", "world_size": 1, "backend": "gloo", "date": "d", "versions": {},
           "ceilings": ceilings, "records": records, "skipped": [], "plans": []}
    titles = [b.split("\n")[0] for b in report.format_table(doc, status, args).split("\n== ")[1:]]
    assert titles == ["eager: residual_rmsnorm_fp8 bf16, tail only (no collective), % of HBM copy ceiling",
                      "host: residual_rmsnorm_fp8 bf16, tail only (no collective)"], titles


def test_collective_rows_get_their_bus_bandwidth_against_the_link():
    """frac_link: a collective row's bus bandwidth (2 (n-1)/n x the all-reduced bytes / time) over the P2P
    copy ceiling, on 2+ ranks with a measured link only; frac_hbm stays the tail rows'; the table shows it."""
    pattern = cases.PATTERNS["residual_rmsnorm"]
    ceilings = {"hbm_copy_GBps": 4000.0, "p2p_GBps": 400.0}
    t, h = 1024, 8192  # 16 MiB of bf16: on 4 ranks 25.2 MB of bus traffic
    assert cli.fractions("collective", pattern, t, h, 2, 4, 100.0, ceilings) == \
        (None, round(1.5 * t * h * 2 / 100e-6 / 400e9, 4))
    assert cli.fractions("collective", pattern, t, h, 2, 2, 200.0, ceilings)[1] == round(t * h * 2 / 200e-6 / 400e9, 4)
    assert cli.fractions("collective", pattern, t, h, 2, 1, 100.0, ceilings) == (None, None)  # no all-reduce
    assert cli.fractions("collective", pattern, t, h, 2, 2, 100.0, {**ceilings, "p2p_GBps": None}) == (None, None)
    frac_hbm, frac_link = cli.fractions("tail", pattern, t, h, 2, 2, 20.0, ceilings)
    assert frac_link is None and frac_hbm == round(cases.tail_bytes(pattern, t, h, 2) / 20e-6 / 4000e9, 4)

    args = cli.parse_args(["--modes", "graph", "--shapes", "4x256", "--dtypes", "bf16", "--patterns", "residual_rmsnorm",
                           "--impls", "commfuse-auto,torch-add"])
    rec = {**_rec("commfuse-auto", 5.0, "graph"), "frac_link": 0.4321}
    doc = {"machine": "m", "gpu": "g", "world_size": 2, "backend": "nccl", "date": "d", "versions": {},
           "ceilings": ceilings, "records": [_rec("torch-add", 2.0, "graph"), rec], "skipped": [], "plans": []}
    text = report.format_table(doc, {}, args)
    block = text.split("\n== ")[1].split("\n")
    assert block[0] == "graph: residual_rmsnorm bf16, % of the P2P copy ceiling in bus bandwidth"
    assert block[2].split() == ["4", "x", "256", "2.0", "5.0", "(43%)"]


def test_check_follows_the_tolerances():
    """The gate's tolerances, without processes: 1 ulp passes, more does not; a rare neighbouring
    FP8 code passes, a code two steps off does not; all-zero NVFP4 output (what a peer's kernel
    writes on a GPU without e2m1 conversion) and unwritten scale factors are rejected."""
    P, check, Result = cases.PATTERNS, cases.check, cases.Result
    exp = _tail(None)
    ok = Result(residual=exp.residual.clone(), norm=exp.norm.clone())
    assert check(ok, exp, P["residual_rmsnorm"]) is None
    i = exp.residual.float().abs().argmax()  # a large element: one ulp there is > 0.5
    up = exp.residual.float().flatten()
    up[i] = torch.nextafter(up[i].bfloat16(), torch.tensor(float("inf")).bfloat16()).float()
    ok.residual = up.view(32, 256).bfloat16()
    assert check(ok, exp, P["residual_rmsnorm"]) is None
    ok.residual = (exp.residual.float() + 1).bfloat16()
    assert "residual" in check(ok, exp, P["residual_rmsnorm"])
    ok = Result(residual=exp.residual, norm=None)
    assert "norm" in check(ok, exp, P["residual_rmsnorm"])

    exp = _tail("fp8", t=64)
    codes = exp.quant.view(torch.uint8).clone()
    codes.view(-1)[5] += 1  # one neighbour among 16384 codes: within 1e-3
    res = Result(residual=exp.residual, quant=codes.view(torch.float8_e4m3fn))
    assert check(res, exp, P["residual_rmsnorm_fp8"]) is None
    codes.view(-1)[5] += 1
    assert "more than one step" in check(res, exp, P["residual_rmsnorm_fp8"])
    # The FP8 NaN code is 0x7F: a negative NaN (0xFF) where the oracle has one is wrong.
    codes.view(-1)[5] -= 2
    exp.quant.view(torch.uint8).view(-1)[9] = 0x7F
    codes.view(-1)[9] = 0x7F
    assert check(res, exp, P["residual_rmsnorm_fp8"]) is None
    codes.view(-1)[9] = 0xFF
    assert "more than one step" in check(res, exp, P["residual_rmsnorm_fp8"])
    # Neighbours are allowed in at most 1e-3 of the codes: 16 of 16384 pass, 20 do not.
    codes.copy_(exp.quant.view(torch.uint8))
    finite = ((codes.view(-1) & 0x7F) < 0x70).nonzero().flatten()  # +1 stays a finite neighbour
    codes.view(-1)[finite[:16]] += 1
    assert check(res, exp, P["residual_rmsnorm_fp8"]) is None
    codes.view(-1)[finite[16:20]] += 1
    assert "20 of 16384 codes differ (at most 0.001" in check(res, exp, P["residual_rmsnorm_fp8"])

    exp = _tail("nvfp4")
    res = Result(residual=exp.residual, quant=torch.zeros_like(exp.quant), sf=exp.sf.clone())
    assert "nvfp4 codes" in check(res, exp, P["residual_rmsnorm_nvfp4"])
    res = Result(residual=exp.residual, quant=exp.quant, sf=torch.zeros_like(exp.sf))
    assert "scale factors" in check(res, exp, P["residual_rmsnorm_nvfp4"])
    res = Result(residual=exp.residual, quant=exp.quant, sf=exp.sf)
    assert check(res, exp, P["residual_rmsnorm_nvfp4"]) is None


def test_tail_bytes_counts_each_tensor_once():
    P = cases.PATTERNS
    t, h = 128, 4096
    base = 3 * t * h * 2 + h * 2  # read a, residual, weight; write residual (bf16)
    assert cases.tail_bytes(P["residual_rmsnorm"], t, h, 2) == base + t * h * 2
    assert cases.tail_bytes(P["residual_rmsnorm_fp8"], t, h, 2) == base + t * h
    assert cases.tail_bytes(P["residual_gemma_rmsnorm_fp8"], t, h, 2) == base + t * h
    assert cases.tail_bytes(P["residual_rmsnorm_nvfp4_out"], t, h, 2) == base + t * h * 2 + t * h // 2 + t * h // 16
    # The computed scales: float32 per row, per 128-block; packed UE8M0 MN-major with its padding rows
    # (t = 130: 132 rows; 7168 / 128 = 56 blocks, 14 int32 per row).
    assert cases.tail_bytes(P["residual_rmsnorm_fp8_per_token"], t, h, 2) == base + t * h + 4 * t
    assert cases.tail_bytes(P["residual_rmsnorm_fp8_block"], t, h, 2) == base + t * h + 4 * t * 32
    t, h = 130, 7168
    base = 3 * t * h * 2 + h * 2
    assert cases.tail_bytes(P["residual_rmsnorm_fp8_block_ue8m0"], t, h, 2) == base + t * h + 4 * 132 * 14
    # Every scale byte the oracle writes is counted (its storage, padding included).
    for name in COMPUTED:
        for t in (1, 5):
            case = cases.make_case(_ctx(), P[name], "bf16", t, 256)
            s = case.expected_tail.scales
            n = s.untyped_storage().nbytes()
            assert cases.tail_bytes(P[name], t, 256, 2) == 3 * t * 256 * 2 + 256 * 2 + t * 256 + n, (name, t)


@pytest.mark.parametrize("name", NEW_PATTERNS)
def test_new_patterns_verify_and_wrong_results_are_rejected(name):
    """The tail-eager row of each new pattern passes the gate, with 5 tokens (MN-major padding rows);
    its scales corrupted, the result is rejected; so is the Gemma pattern's tail without the offset."""
    ctx = _ctx()
    p = cases.PATTERNS[name]
    case = cases.make_case(ctx, p, "bf16", 5, 256)
    assert (case.scale is None) == (p.quant != "fp8")
    impl = impls.IMPLS["tail-eager"]
    step = impl.prepare(ctx, case)
    verdict, res = cases.gate(ctx, step, lambda r, i: impl.mismatch(case, r, i))
    assert verdict is OK
    if p.weight_offset:
        x, residual = case.sets[0]
        plain = reference.fused_tail(x, residual, case.weight, case.eps, p.quant, case.scale)
        assert "codes" in impl.mismatch(case, cases.Result.of_tail(plain))
        return
    assert res.scales is not None and res.scales.stride() == case.expected_tail.scales.stride()

    def off(edit):
        r = step.result(step.call(0))
        storage = reference.mn_major_storage(r.scales, 5, 2, p.scale_ue8m0) if p.scale_layout == "mn_major" else None
        r.scales = r.scales.clone() if storage is None else torch.as_strided(storage.clone(), r.scales.shape,
                                                                             r.scales.stride())
        edit(r.scales if storage is None else reference.mn_major_storage(r.scales, 5, 2, True).view(torch.uint8))
        return impl.mismatch(case, r)
    if p.scale_ue8m0:
        def bump(b):
            b[0] += 2
        assert "UE8M0 scales" in off(bump)

        def pad(b):
            b[4 * 5] = 1  # row 5 of int32 column 0: a padding row
        assert "padding not 0" in off(pad)
    else:
        def double(s):
            s.view(-1)[1] *= 2
        assert "scales" in off(double)


def test_flashinfer_rows_take_its_computed_scale_patterns(monkeypatch):
    """FlashInfer's rows, with a stand-in for its API (no GPU here): per-token FP8 and the packed UE8M0
    group pattern get its pattern codes, block_quant_group_size 128 and our scale buffers (poisoned: a
    kernel that leaves them unwritten is rejected); row-major block scales and a Gemma RMSNorm without
    weight_bias skip with the reason."""
    calls = []

    def fuse(allreduce_in, world_size, world_rank, token_num, hidden_dim, workspace_ptrs, launch_with_pdl,
             trigger_completion_at_end, fp32_acc, pattern_code, allreduce_out, residual_in, residual_out, norm_out,
             quant_out, scale_out, rms_gamma, rms_eps, scale_factor, layout_code, use_oneshot=None,
             block_quant_group_size=None):
        calls.append((pattern_code, block_quant_group_size))
        quant, layout = {10: ("fp8_per_token", ("row", False)), 8: ("fp8_block", ("mn_major", True))}[pattern_code]
        tail = reference.fused_tail(allreduce_in, residual_in, rms_gamma, rms_eps, quant, None, False, "swizzled",
                                    0.0, *layout)
        residual_out.copy_(tail.residual)
        quant_out.copy_(tail.quant.view(torch.uint8))
        if skip_scales:
            return
        if quant == "fp8_per_token":
            scale_out.copy_(tail.scales)
        else:  # the valid bytes only, as its kernel (the padding is the caller's zeros)
            t, k = token_num, hidden_dim // reference.FP8_BLOCK
            idx = reference.packed_ue8m0_byte_index(torch.arange(t).unsqueeze(1), torch.arange(k), t)
            reference.mn_major_storage(scale_out, t, k, True).view(torch.uint8)[idx] = \
                reference.unpack_ue8m0_mn_major(tail.scales, t, k)

    patterns = types.SimpleNamespace(kARResidualRMSNormDynamicFP8Quant=10,
                                     kARResidualRMSNormPerTokenGroupFP8PackedQuant=8, kARResidualRMSNormFP8Quant=2)
    ctx = _ctx()
    ctx.cache["flashinfer"] = {"fuse": fuse, "patterns": patterns, "version": "test",
                               "params": inspect.signature(fuse).parameters, "swizzled": 0}
    ctx.cache["flashinfer_ws"] = (None, torch.zeros(1))
    fi = impls.IMPLS["flashinfer"]
    for skip_scales in (False, True):
        for name, code in (("residual_rmsnorm_fp8_per_token", 10), ("residual_rmsnorm_fp8_block_ue8m0", 8)):
            case = cases.make_case(ctx, cases.PATTERNS[name], "bf16", 5, 512)
            why = fi.mismatch(case, fi.prepare(ctx, case).call(0))
            assert calls[-1] == (code, 128 if code == 8 else None)
            assert (why is None) != skip_scales, why
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm_fp8_block"], "bf16", 5, 512)
    with pytest.raises(Skip, match="^flashinfer test has no FP8 block pattern with row float32 scales"):
        fi.prepare(ctx, case)
    case = cases.make_case(ctx, cases.PATTERNS["residual_gemma_rmsnorm_fp8"], "bf16", 5, 512)
    with pytest.raises(Skip, match="flashinfer test trtllm_allreduce_fusion has no weight_bias"):
        fi.prepare(ctx, case)
    del patterns.kARResidualRMSNormDynamicFP8Quant
    case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm_fp8_per_token"], "bf16", 5, 512)
    with pytest.raises(Skip, match="flashinfer test has no pattern kARResidualRMSNormDynamicFP8Quant"):
        fi.prepare(ctx, case)


def _fi_moe_tail(acc, residual_in, gamma, eps, residual_out, norm_out):
    """A stand-in's all-reduce (one rank) and tail: its outputs written as FlashInfer's kernels write them."""
    tail = reference.fused_tail(acc, residual_in, gamma, eps, None, None, True)
    residual_out.copy_(tail.residual)
    norm_out.copy_(tail.norm)


def test_flashinfer_moe_rows_take_its_layouts_and_its_combine():
    """FlashInfer's MoE fusions, with stand-ins for its API written from its kernels' source (no GPU here):
    the reduction form gets experts-major copies ([k, t, h] rows, [k, t] float32 weights) and zeros for the token
    input it requires, the finalize form our rows and row_index with the weights in T; both combine in T, slot
    by slot, and the gate judges them by that combine. A stand-in that reads the rows token-major is rejected;
    the formats they cannot compute skip with the reason."""
    calls = []

    def reduce(world_size, world_rank, token_num, hidden_dim, workspace_ptrs, launch_with_pdl, residual_in, rms_gamma,
               rms_eps, scale_factor, moe_reduction_device_num_experts, moe_reduction_scale_input,
               moe_reduction_active_experts_token_input, moe_reduction_token_input, layout_code, moe_allreduce_out,
               residual_out, norm_out, quant_out, scale_out, weight_bias=None):
        y, w, k = moe_reduction_active_experts_token_input, moe_reduction_scale_input, moe_reduction_device_num_experts
        calls.append(("reduce", tuple(y.shape), w.dtype, bool(moe_reduction_token_input.eq(0).all())))
        if token_major:
            y = y.reshape(token_num, k, hidden_dim).transpose(0, 1)
        acc = torch.zeros(token_num, hidden_dim, dtype=y.dtype)
        for j in range(k):
            acc = acc + (y[j].float() * w[j].unsqueeze(1)).to(y.dtype)  # bf16 + bf16: one rounding
        _fi_moe_tail(acc + moe_reduction_token_input, residual_in, rms_gamma, rms_eps, residual_out, norm_out)

    def finalize(allreduce_in, residual_in, norm_weight, expanded_idx_to_permuted_idx, norm_out, residual_out,
                 quant_out, scale_out, workspace_ptrs, launch_with_pdl, world_rank, world_size, eps,
                 shared_expert_output, expert_scale_factor, routed_scaling_factor):
        calls.append(("finalize", tuple(allreduce_in.shape), expert_scale_factor.dtype, routed_scaling_factor))
        t, k = expanded_idx_to_permuted_idx.shape
        acc = torch.zeros(t, allreduce_in.shape[1], dtype=allreduce_in.dtype)
        for i in range(t):
            for j in range(k):
                r = int(expanded_idx_to_permuted_idx[i, j])
                if r >= 0:
                    acc[i] = acc[i] + (allreduce_in[r].float() * expert_scale_factor[i, j].float()).to(acc.dtype)
        _fi_moe_tail(acc, residual_in, norm_weight, eps, residual_out, norm_out)

    ctx = _ctx()
    ctx.cache["flashinfer"] = {"version": "test", "swizzled": 0, "reduce": reduce, "finalize": finalize}
    ctx.cache["flashinfer_ws"] = (None, torch.zeros(1))
    fi = impls.IMPLS["flashinfer"]
    t, h = 5, 256
    for name, k in (("moe_k2_residual_rmsnorm", 2), ("moe_finalize_k8_residual_rmsnorm", 8)):
        case = cases.make_case(ctx, cases.PATTERNS[name], "bf16", t, h)
        for token_major in (False, True):
            step = fi.prepare(ctx, case)
            why = fi.mismatch(case, step.call(0), expected=step.expected)
            assert (why is None) != (token_major and "finalize" not in name), why
        if "finalize" in name:
            assert calls[-1] == ("finalize", (t * k + cases.MOE_PADDING_ROWS, h), torch.bfloat16, None)
        else:
            assert calls[-1] == ("reduce", (k, t, h), torch.float32, True)
    # The combine in T, not float32: for these inputs it differs from the oracle's by more than the gate allows.
    case = cases.make_case(ctx, cases.PATTERNS["moe_k8_residual_rmsnorm"], "bf16", 16, 1024)
    step, token_major = fi.prepare(ctx, case), False
    assert fi.mismatch(case, step.call(0), expected=step.expected) is None
    assert fi.mismatch(case, step.call(0)) is not None
    case = cases.make_case(ctx, cases.PATTERNS["moe_k8_residual_rmsnorm_fp8"], "bf16", t, h)
    with pytest.raises(Skip, match="^flashinfer test's trtllm_moe_allreduce_fusion quantizes to NVFP4 only$"):
        fi.prepare(ctx, case)
    case = cases.make_case(ctx, cases.PATTERNS["moe_finalize_k2_residual_rmsnorm_nvfp4"], "bf16", t, h)
    with pytest.raises(Skip, match="trtllm_moe_finalize_allreduce_fusion takes no global scale: it quantizes nothing"):
        fi.prepare(ctx, case)
    ctx.cache["flashinfer"]["reduce"] = None
    case = cases.make_case(ctx, cases.PATTERNS["moe_k2_residual_rmsnorm"], "bf16", t, h)
    with pytest.raises(Skip, match="^API mismatch: flashinfer test has no trtllm_moe_allreduce_fusion$"):
        fi.prepare(ctx, case)


@pytest.mark.parametrize("wrong_from, where", [(None, None), (2, "checked call 2 (input set 1)"),
                                               (3, "the last timed call (eager)")])
def test_flashinfer_moe_rows_are_checked_on_every_input_set(wrong_from, where):
    """FlashInfer's MoE rows are judged on every input set, against that set's oracle fed its combine: on the gate's
    two calls (sets 0 and 1) and on the last timed call (K = 20 over 8 sets: set 3). A stand-in that writes
    residual + 1 from its second call on, or from its first after the gate's, is rejected; a right one is timed."""
    calls = []

    def reduce(world_size, world_rank, token_num, hidden_dim, workspace_ptrs, launch_with_pdl, residual_in, rms_gamma,
               rms_eps, scale_factor, moe_reduction_device_num_experts, moe_reduction_scale_input,
               moe_reduction_active_experts_token_input, moe_reduction_token_input, layout_code, moe_allreduce_out,
               residual_out, norm_out, quant_out, scale_out, weight_bias=None):
        y, w = moe_reduction_active_experts_token_input, moe_reduction_scale_input
        acc = torch.zeros(token_num, hidden_dim, dtype=y.dtype)
        for j in range(moe_reduction_device_num_experts):
            acc = acc + (y[j].float() * w[j].unsqueeze(1)).to(y.dtype)
        _fi_moe_tail(acc + moe_reduction_token_input, residual_in, rms_gamma, rms_eps, residual_out, norm_out)
        calls.append(1)
        if wrong_from is not None and len(calls) >= wrong_from:
            residual_out.add_(1)

    args = cli.parse_args(["--impls", "flashinfer", "--patterns", "moe_k2_residual_rmsnorm", "--shapes", "5x256",
                           "--dtypes", "bf16", "--modes", "eager", "--repeats", "1", "--warmup", "1"])
    ctx = Ctx(args, 0, 1, "gloo", torch.device("cpu"))
    ctx.cache["flashinfer"] = {"version": "test", "swizzled": 0, "reduce": reduce, "finalize": None}
    ctx.cache["flashinfer_ws"] = (None, torch.zeros(1))
    records, skipped, _ = cli.run_cases(ctx, {"hbm_copy_GBps": None, "p2p_GBps": None})
    assert (args.calls_per_graph - 1) % cases._input_sets(ctx, 5, 256, torch.bfloat16) == 3
    if wrong_from is None:
        assert [r["mode"] for r in records] == ["eager"] and not skipped, skipped
    else:
        assert not records and len(skipped) == 1, skipped
        assert skipped[0]["reason"].startswith(f"rejected (bf16 5x256): {where}: residual"), skipped


@pytest.mark.parametrize("argv, error", [
    (["--shapes", "64"], "TOKENSxHIDDEN"), (["--impls", "nope"], "unknown impl"), (["--modes", "host,wall"], "unknown mode"),
    (["--shapes", "0x512"], "tokens >= 1"), (["--shapes", "4x0"], "hidden a multiple of 8"),
    (["--repeats", "0"], "--repeats and --calls-per-graph must be >= 1"),
    (["--calls-per-graph", "0"], "--repeats and --calls-per-graph must be >= 1"),
    (["--shapes", "2x136", "--patterns", "residual_rmsnorm_nvfp4"], "needs a hidden size that is a multiple of 16"),
    (["--shapes", ","], "--shapes lists nothing"), (["--impls", ","], "--impls lists nothing"),
    (["--eps", "nan"], "--eps must be a finite number >= 0"), (["--eps", "-1"], "--eps must be a finite number >= 0"),
    (["--machine", ""], "--machine must name the machine"),
])
def test_bad_options_are_named(argv, error, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("COMMFUSE_STRATEGY", "nccl"), ("COMMFUSE_DISABLE_FUSION", "1"),
                                         ("COMMFUSE_PRETEND_NO_P2P", "1")])
def test_overrides_that_would_relabel_commfuse_rows_are_refused(monkeypatch, capsys, name, value):
    """COMMFUSE_STRATEGY would make every commfuse row run that strategy (the auto row timing NCCL under its
    name), the other two their tails separated or P2P off: the benchmark refuses them, naming the variable."""
    for other in ("COMMFUSE_STRATEGY", "COMMFUSE_DISABLE_FUSION", "COMMFUSE_PRETEND_NO_P2P"):
        monkeypatch.delenv(other, raising=False)
    assert cli.parse_args(["--quick"]).quick
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        cli.parse_args(["--quick"])
    assert f"{name} is set ({value!r})" in capsys.readouterr().err
    if name != "COMMFUSE_STRATEGY":  # the switches read "1" alone: "0" changes nothing
        monkeypatch.setenv(name, "0")
        assert cli.parse_args(["--quick"]).quick


@pytest.mark.parametrize("raw", ["abc", "0", "1e10", "1e-9"])
def test_a_bad_timeout_is_named(raw, monkeypatch, capsys, tmp_path):
    """COMMFUSE_BENCH_TIMEOUT outside env.seconds' range: one line naming it and exit status 2, before any
    group is made (1e10 was a traceback from init_distributed that did not name it)."""
    monkeypatch.setenv("COMMFUSE_BENCH_TIMEOUT", raw)
    assert cli.main(["--out", str(tmp_path)]) == 2
    assert "commfuse-bench: COMMFUSE_BENCH_TIMEOUT must be a number" in capsys.readouterr().err


def test_repeated_options_run_once():
    args = cli.parse_args(["--dtypes", "bf16,bf16", "--modes", "eager,eager", "--shapes", "1x512,1x512",
                           "--impls", "nccl+eager,nccl+eager"])
    assert (args.dtype_list, args.mode_list, args.shape_list, args.impl_list) == \
        (["bf16"], ["eager"], [(1, 512)], ["nccl+eager"])


def test_a_wrong_backend_sum_is_no_oracle(monkeypatch):
    """Beyond 2 ranks the tail rows are also judged against the oracle fed the backend's own sum (its summation
    order): only where that sum is within world-size ulps of the exact one, else a broken collective would be its
    own oracle."""
    ctx = _ctx(world=3)
    exact = {}
    real_sum = cases.reference.all_reduce_sum

    def recorded_sum(xs):  # the exact sum, which the stand-in backend below returns (scaled)
        exact["sum"] = real_sum(xs)
        return exact["sum"]

    monkeypatch.setattr(cases.reference, "all_reduce_sum", recorded_sum)
    for scale, oracles in ((1.0, 2), (1.5, 1)):
        monkeypatch.setattr(cases.dist, "all_reduce", lambda a, *args, **kw: a.copy_(exact["sum"] * scale))
        case = cases.make_case(ctx, cases.PATTERNS["residual_rmsnorm"], "bf16", 4, 256)
        assert len(case.expected) == oracles


@cpu_smoke
def test_ranks_given_different_options_stop_at_once(tmp_path):
    """Two ranks, two --shapes (mpirun's MPMD form): both stop before any row, naming the option, rather than
    pair different collectives until the timeout."""
    common = ["-m", "commfuse.bench", "--quick", "--patterns", "residual_rmsnorm", "--impls", "nccl+eager",
              "--out", str(tmp_path / "out")]
    env = dict(_child_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-n", "1", sys.executable, *common, "--shapes", "1x512", ":",
           "-n", "1", sys.executable, *common, "--shapes", "1x512,4x512"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and "the ranks were given different options: --shapes\n" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 120


@cpu_smoke
def test_device_bench_sh_fails_when_a_run_fails(tmp_path):
    """launch/device_bench.sh's exit status is its runs' (its last lines only print their tails)."""
    p = subprocess.run([str(ROOT / "launch" / "device_bench.sh"), str(tmp_path / "out")], cwd=tmp_path,
                       env=dict(_child_env(), PYTHON="/bin/false"), capture_output=True, text=True, timeout=240)
    assert p.returncode != 0, p.stdout[-2000:]


def test_new_patterns_run_on_request_only():
    assert cli.parse_args([]).pattern_list == list(cases.DEFAULT_PATTERNS)
    assert set(cases.DEFAULT_PATTERNS) < set(cases.PATTERNS)
    assert cli.parse_args(["--patterns", ",".join(NEW_PATTERNS)]).pattern_list == list(NEW_PATTERNS)


def test_mxfp8_pattern_verifies_and_wrong_scale_factors_are_rejected():
    """The MXFP8 pattern (from the format registry): its tail-eager row passes the gate; a UE8M0 scale
    factor two exponents off, or a swizzle padding byte not 0, is rejected; its bytes are counted."""
    ctx = _ctx()
    p = cases.PATTERNS["residual_rmsnorm_mxfp8"]
    case = cases.make_case(ctx, p, "bf16", 5, 256)
    assert case.scale is None
    impl = impls.IMPLS["tail-eager"]
    step = impl.prepare(ctx, case)
    verdict, res = cases.gate(ctx, step, lambda r, i: impl.mismatch(case, r, i))
    assert verdict is OK and res.sf.dtype == torch.uint8 and res.scales is None
    for index, change, why in ((0, 2, "UE8M0 scale factors"), (res.sf.numel() - 1, 1, "swizzle padding not 0")):
        r = step.result(step.call(0))
        r.sf = r.sf.clone()
        r.sf[index] += change
        assert why in impl.mismatch(case, r)
    assert cases.tail_bytes(p, 5, 256, 2) == 3 * 5 * 256 * 2 + 256 * 2 + 5 * 256 + 128 * 8


# ------------------------------------------------------------------------------- post-norm patterns

POST_PATTERNS = ("residual_gemma_post_rmsnorm", "residual_gemma_post_rmsnorm_fp8")

POST_DROPPED = r'''
import dataclasses, sys
from commfuse.bench import cli, impls

def prepare(ctx, case):  # Gemma's tail without its post-norm: the sum added to the residual as it is
    return impls.IMPLS["nccl+eager"].prepare(ctx, dataclasses.replace(case, post_weight=None))

impls.register(impls.Impl("post-dropped", "collective", prepare, "test only: nccl+eager without the post-norm"))
sys.exit(cli.main(sys.argv[1:]))
'''


def test_post_patterns_run_on_request_only():
    assert not set(POST_PATTERNS) & set(cli.parse_args([]).pattern_list)
    assert cli.parse_args(["--patterns", "residual_gemma_post_rmsnorm_fp8"]).pattern_list == \
        ["residual_gemma_post_rmsnorm_fp8"]
    assert all(cases.PATTERNS[n].post and cases.PATTERNS[n].weight_offset == 1.0 for n in POST_PATTERNS)
    assert not any(p.post for n, p in cases.PATTERNS.items() if n not in POST_PATTERNS)
    # The post weight is read too: h more elements than the Gemma tail without it.
    t, h = 128, 4096
    assert cases.tail_bytes(cases.PATTERNS["residual_gemma_post_rmsnorm_fp8"], t, h, 2) == \
        cases.tail_bytes(cases.PATTERNS["residual_gemma_rmsnorm_fp8"], t, h, 2) + h * 2
    assert cases.tail_bytes(cases.PATTERNS["residual_gemma_post_rmsnorm"], t, h, 2) == \
        3 * t * h * 2 + 2 * h * 2 + t * h * 2


@cpu_smoke
def test_post_patterns_run_every_cpu_row_at_world_size_1(tmp_path):
    """The post-norm patterns through the CLI in one process: the CPU rows pass the gate and are timed, FlashInfer
    skips (no post-norm in its fusion); a row that drops the post-norm is rejected on its residual."""
    out = tmp_path / "out"
    rows = "nccl+eager,commfuse-auto,commfuse-ops,tail-eager,flashinfer"
    _run([sys.executable, "-c", POST_DROPPED, "--impls", rows + ",post-dropped", "--patterns", ",".join(POST_PATTERNS),
          "--shapes", "5x256", "--dtypes", "bf16", "--modes", "eager", "--repeats", "1", "--calls-per-graph", "2",
          "--out", str(out)], tmp_path)
    doc = _load(out)
    assert doc["world_size"] == 1
    timed = set(rows.split(",")) - {"flashinfer"}
    assert {(r["impl"], r["pattern"]) for r in doc["records"]} == {(i, p) for i in timed for p in POST_PATTERNS}
    assert all("wrong" not in r for r in doc["records"])
    skipped = {(s["impl"], s["pattern"]): s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {(i, p) for i in ("flashinfer", "post-dropped") for p in POST_PATTERNS}, skipped
    for p in POST_PATTERNS:
        assert skipped[("flashinfer", p)].startswith("its all-reduce fusion has no post-norm")
        assert skipped[("post-dropped", p)].startswith("rejected (bf16 5x256): residual: "), skipped
        assert "beyond ulp(a') + ulp(r)" in skipped[("post-dropped", p)]


@cpu_smoke
def test_post_patterns_run_every_cpu_row_on_2_ranks(tmp_path):
    """launch/bench.sh 2 (gloo) with the post-norm patterns: every row that runs on the CPU passes the gate and is
    timed (commfuse's rows on gloo + the separated tail: the reference's bits), tail rows' frac_hbm counts the post
    weight; FlashInfer, the forced P2P rows and tail-commfuse (CUDA only) skip with their reasons."""
    out = tmp_path / "out"
    rows = ("nccl+eager,commfuse-fallback,commfuse-p2p,commfuse-auto,commfuse-auto-out,commfuse-ops,tail-eager,"
            "tail-commfuse,torch-add,flashinfer")
    _run([str(ROOT / "launch" / "bench.sh"), "2", "--impls", rows, "--patterns", ",".join(POST_PATTERNS), "--shapes",
          "4x256", "--dtypes", "bf16", "--modes", "eager", "--repeats", "1", "--calls-per-graph", "2", "--out",
          str(out)], tmp_path)
    doc = _load(out)
    assert doc["world_size"] == 2
    skips = {"flashinfer", "commfuse-p2p", "tail-commfuse"}
    timed = set(rows.split(",")) - skips
    assert {(r["impl"], r["pattern"]) for r in doc["records"]} == {(i, p) for i in timed for p in POST_PATTERNS}
    assert all("wrong" not in r for r in doc["records"])
    assert_tail_rows_frac_hbm(doc, 4, 256)
    skipped = {(s["impl"], s["pattern"]): s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {(i, p) for i in skips for p in POST_PATTERNS}, skipped
    assert not any(why.startswith(("rejected", "failed")) for why in skipped.values()), skipped
    assert {pl["tail"] for pl in doc["plans"] if pl["pattern"] in POST_PATTERNS} == {"separated"}


def test_post_cases_draw_one_post_weight_and_the_oracle_normalises_the_sum():
    """A post pattern's case: one post weight on every rank, about 0 (Gemma's w of 1 + w); the oracle of every input
    set is the reference's tail with the post-norm of the sum of every rank's x, and holds that post-normed sum;
    other patterns have no post weight."""
    p = cases.PATTERNS["residual_gemma_post_rmsnorm_fp8"]
    c0, c1 = (cases.make_case(Ctx(_args(), rank=r, world=2, backend="gloo", device=torch.device("cpu")), p, "bf16",
                              4, 256) for r in (0, 1))
    assert c0.post_weight.dtype == torch.bfloat16 and torch.equal(c0.post_weight, c1.post_weight)
    assert c0.post_weight.float().abs().mean() < 0.2
    for i, (expected, _) in enumerate([c0.oracle(i) for i in range(len(c0.sets))]):
        (x0, residual), x1 = c0.input_set(i), c1.input_set(i)[0]
        total = reference.all_reduce_sum([x0, x1])
        want = reference.fused_tail(total, residual, c0.weight, c0.eps, "fp8", c0.scale, weight_offset=1.0,
                                    post_weight=c0.post_weight)
        assert torch.equal(expected[0].residual, want.residual) and torch.equal(expected[0].quant, want.quant)
        assert torch.equal(expected[0].post_normed, reference.rmsnorm(total, c0.post_weight, c0.eps, 1.0))
    assert cases.make_case(_ctx(), cases.PATTERNS["residual_gemma_rmsnorm_fp8"], "bf16", 4, 256).post_weight is None


@pytest.mark.parametrize("name", POST_PATTERNS)
def test_the_gate_holds_post_rows_to_ulp_a_plus_ulp_r_and_their_own_residuals_tail(name):
    """The gate of a post row (docs/semantics.md section 2a): its residual within ulp(a') + ulp(r) of the oracle's
    passes, with its norm and quantization those of its own residual; a few residual elements 2 ulps of a' off,
    beyond that bound, are rejected; so is a norm of another residual (the tail without the post-norm). commfuse's
    rows on the CPU (the separated route: the reference's ops) are held to the residual's bits."""
    ctx = _ctx()
    p = cases.PATTERNS[name]
    case = cases.make_case(ctx, p, "bf16", 16, 256)
    exp, bf16 = case.expected[0], torch.bfloat16
    eager, ours = impls.IMPLS["nccl+eager"], impls.IMPLS["commfuse-auto"]

    def row(r):  # a row's outputs from its residual r: the norm and quantization of r
        own = reference.fused_tail(r, None, case.weight, case.eps, p.quant, case.scale, p.return_norm,
                                   weight_offset=p.weight_offset)
        return cases.Result(residual=r, norm=own.norm, quant=own.quant)

    def gated(impl, res):
        return cases.gate(ctx, impls.Step(lambda i: res), lambda r, i: impl.mismatch(case, r, i))[0]

    r = exp.residual.float()
    a_ulp = tolerance.ulp(exp.post_normed.float(), bf16)
    bound = a_ulp + tolerance.ulp(r, bf16)

    def moved(by, keep):  # the oracle's residual moved by `by` (rounded to T) at the first 3 elements where keep(|d|)
        m = (r + by).to(bf16)
        d = (m.float() - r).abs()
        where = keep(d).flatten().nonzero().flatten()[:3]
        assert where.numel() == 3
        out = exp.residual.clone()
        out.view(-1)[where] = m.view(-1)[where]
        return out

    assert gated(eager, row(exp.residual)) is OK and gated(ours, row(exp.residual)) is OK
    within = row(moved(a_ulp, lambda d: (d > 0) & (d <= bound)))
    assert gated(eager, within) is OK
    verdict = gated(ours, within)
    assert verdict.kind is Kind.REJECTED and verdict.reason.startswith("residual: 3 of 4096 elements beyond 0 ulp")
    verdict = gated(eager, row(moved(2 * a_ulp, lambda d: d > bound)))
    assert verdict.kind is Kind.REJECTED, verdict
    assert verdict.reason.startswith("residual: 3 of 4096 elements beyond ulp(a') + ulp(r)"), verdict
    x, residual = case.sets[0]
    plain = reference.fused_tail(x, residual, case.weight, case.eps, p.quant, case.scale, weight_offset=1.0)
    verdict = gated(eager, cases.Result(residual=exp.residual, norm=plain.norm, quant=plain.quant))
    assert verdict.kind is Kind.REJECTED and ("codes" if p.quant else "norm") in verdict.reason, verdict
    verdict = gated(eager, cases.Result.of_tail(plain))
    assert verdict.kind is Kind.REJECTED and "beyond ulp(a') + ulp(r)" in verdict.reason, verdict


def test_compiled_tail_rows_take_the_post_weight(monkeypatch):
    """tail-compile of a post pattern computes the post-norm (the compiled function is called with the post
    weight), as its own compiled function (not the Gemma tail's without a post-norm): it passes the gate. torch.compile
    is left out (its C++ build on a CPU): the function it would compile runs as Python."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):  # _compiled_tail sets it: restored after the test
        monkeypatch.setattr(dynamo_config, "fail_on_recompile_limit_hit", dynamo_config.fail_on_recompile_limit_hit)
    ctx = _ctx(quick=False)
    impl = impls.IMPLS["tail-compile"]
    for name in POST_PATTERNS + ("residual_gemma_rmsnorm_fp8",):
        case = cases.make_case(ctx, cases.PATTERNS[name], "bf16", 4, 256)
        step = impl.prepare(ctx, case)
        assert cases.gate(ctx, step, lambda r, i: impl.mismatch(case, r, i))[0] is OK, name
    assert len([k for k in ctx.cache if k[0] == "compiled"]) == 3


def test_tail_commfuse_launches_the_post_variants_plan(monkeypatch):
    """tail-commfuse of a post pattern (fused_tail.run has no post-norm): the POST plan of the case's tail (eps, the
    weight offset, the format), its launcher given the post weight as z, as the library's routes give it."""
    from commfuse.kernels import fused_tail, native

    planned, zs = [], []

    def plan(dtype, t, h, spec, device_index, *, residual=True, nccl=None, post=False):
        planned.append((dtype, t, h, spec, post))
        return spec

    def launcher(spec):
        def launch(x, residual, weight, scale, out, z):
            zs.append(z)
            return reference.fused_tail(x, residual, weight, spec.eps, spec.quant, scale, spec.return_norm,
                                        weight_offset=spec.weight_offset, post_weight=z)
        return launch
    monkeypatch.setattr(fused_tail.FUSED_TAIL, "plan", plan)
    monkeypatch.setattr(native, "launcher", launcher)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ctx = _ctx()
    impl = impls.IMPLS["tail-commfuse"]
    case = cases.make_case(ctx, cases.PATTERNS["residual_gemma_post_rmsnorm_fp8"], "bf16", 4, 256)
    step = impl.prepare(_GpuCtx(_args(), 0, 1, "nccl", torch.device("cpu")), case)
    assert cases.gate(ctx, step, lambda r, i: impl.mismatch(case, r, i))[0] is OK
    (dtype, t, h, spec, post), = planned
    assert (dtype, t, h, post) == (torch.bfloat16, 4, 256, True)
    assert (spec.quant, spec.eps, spec.weight_offset) == ("fp8", case.eps, 1.0)
    assert len(zs) == 1 and zs[0] is case.post_weight


# ------------------------------------------------------------------------------------- MoE patterns

SWAPPED = r'''
import dataclasses, sys
from commfuse.bench import cli, impls
from commfuse.bench.cases import MoeInputs
from commfuse.bench.verdict import Skip

def prepare(ctx, case):
    if not case.pattern.is_moe:
        raise Skip("MoE patterns only")
    swapped = dataclasses.replace(case, moe=[MoeInputs(m.y, m.weights.flip(-1).contiguous(), m.row_index, m.shared)
                                             for m in case.moe])
    return impls.IMPLS["commfuse-auto"].prepare(ctx, swapped)

impls.register(impls.Impl("slots-swapped", "collective", prepare, "test only: commfuse-auto, weights reversed"))
sys.exit(cli.main(sys.argv[1:]))
'''


@cpu_smoke
def test_moe_patterns_run_every_cpu_row(tmp_path):
    """--patterns moe through the CLI at world size 1: every MoE pattern's rows that run on the CPU (the
    torch sequence, commfuse's rows: the separated combine) pass the gate and are timed, FlashInfer and
    the CUDA-only rows skip with their reasons, the commfuse plans name the combine's route, tail rows'
    frac_hbm counts the k expert rows; a commfuse row fed the routing weights in reversed slot order is
    rejected."""
    out = tmp_path / "out"
    rows = "nccl+eager,commfuse-fallback,commfuse-auto,commfuse-auto-out,commfuse-ops,tail-eager,torch-add,flashinfer"
    p = _run([sys.executable, "-c", SWAPPED, "--impls", rows + ",slots-swapped", "--patterns", "moe", "--shapes",
              "3x256", "--dtypes", "bf16", "--modes", "eager", "--repeats", "1", "--calls-per-graph", "2",
              "--out", str(out)], tmp_path)
    doc = _load(out)
    assert doc["config"]["patterns"] == list(cases.MOE_PATTERNS) and doc["config"]["moe_shapes"] == ["3x256"]
    timed = set(rows.split(",")) - {"flashinfer"}
    assert {(r["impl"], r["pattern"]) for r in doc["records"]} == {(i, n) for i in timed for n in cases.MOE_PATTERNS}
    assert all("wrong" not in r for r in doc["records"])
    assert_tail_rows_frac_hbm(doc, 3, 256)
    skipped = {(s["impl"], s["pattern"]): s["reason"] for s in doc["skipped"]}
    assert {n for i, n in skipped if i == "flashinfer"} == set(cases.MOE_PATTERNS)
    rejected = {n: why for (i, n), why in skipped.items() if i == "slots-swapped"}
    assert set(rejected) == set(cases.MOE_PATTERNS), skipped
    assert all(why.startswith("rejected (bf16 3x256): ") for why in rejected.values()), rejected
    plans = [pl for pl in doc["plans"] if pl["impl"] == "commfuse-auto"]
    assert {pl["pattern"] for pl in plans} == set(cases.MOE_PATTERNS)
    assert all(pl["combine"] == "separated" and any(r.startswith("combine: ") for r in pl["reasons"]) for pl in plans)
    assert "== eager: moe_finalize_k8_residual_rmsnorm_nvfp4 bf16\n" in p.stdout
    assert "separated combine + gloo + separated tail" in p.stdout


def test_moe_inputs_follow_tensor_parallelism_and_the_torch_combine_is_exact():
    """The MoE cases' inputs: the routing (weights, row_index) is every rank's, the expert rows differ
    per rank; weights a softmax over k; the finalize form's row_index an injection into t k + padding rows,
    the padding NaN; several input sets; sets[i]'s x is the oracle's combine. The separated rows' torch
    combine gives the reference's bits in every pattern (the shared expert's too)."""
    for name in cases.MOE_PATTERNS:
        p = cases.PATTERNS[name]
        t, h, k = 5, 256, p.moe_k
        c0, c1 = (cases.make_case(Ctx(_args(), rank=r, world=2, backend="gloo", device=torch.device("cpu")), p, "bf16",
                                  t, h) for r in (0, 1))
        assert len(c0.moe) == len(c0.sets) > 1
        a, b = c0.moe[0], c1.moe[0]
        assert torch.equal(a.weights, b.weights) and not torch.equal(a.y.nan_to_num(), b.y.nan_to_num())
        assert a.weights.dtype == torch.float32 and torch.allclose(a.weights.sum(-1), torch.ones(t))
        assert (a.shared is not None) == p.moe_shared
        if p.moe_form == "finalize":
            assert torch.equal(a.row_index, b.row_index) and a.row_index.dtype == torch.int32
            used = a.row_index.view(-1).long()
            assert used.unique().numel() == t * k and a.y.shape == (t * k + cases.MOE_PADDING_ROWS, h)
            pad = torch.ones(a.y.shape[0], dtype=torch.bool)
            pad[used] = False
            assert a.y[pad].isnan().all() and not a.y[~pad].isnan().any()
        else:
            assert a.row_index is None and a.y.shape == (t, k, h)
        for m, (x, _) in zip(c0.moe, c0.sets):
            assert torch.equal(x, m.combine())
            assert torch.equal(impls.torch_combine(m).view(torch.int16), x.view(torch.int16)), name


def test_moe_tail_bytes_read_the_k_expert_rows_once():
    P = cases.PATTERNS
    t, h = 64, 4096
    out = t * h * 2 + h * 2 + t * h  # residual (bf16), weight; FP8 codes
    assert cases.tail_bytes(P["moe_k8_residual_rmsnorm_fp8"], t, h, 2) == 8 * t * h * 2 + t * h * 2 + 4 * t * 8 + out
    assert cases.tail_bytes(P["moe_finalize_k2_residual_rmsnorm_fp8"], t, h, 2) == \
        2 * t * h * 2 + t * h * 2 + 2 * 4 * t * 2 + out  # + the int32 row_index
    assert cases.tail_bytes(P["moe_k8_shared_residual_rmsnorm_fp8"], t, h, 2) == \
        8 * t * h * 2 + 2 * t * h * 2 + 4 * t * 8 + out  # + the shared expert's output
    # The quantized outputs as the dense patterns': the same bytes written.
    for q in ("", "_fp8", "_nvfp4"):
        moe, dense = P[f"moe_k2_residual_rmsnorm{q}"], P[f"residual_rmsnorm{q}"]
        assert cases.tail_bytes(moe, t, h, 2) - cases.tail_bytes(dense, t, h, 2) == 2 * t * h * 2 - t * h * 2 + 4 * t * 2


def test_moe_patterns_options():
    """On request only; `--patterns moe` names them all; their own default shapes (tokens 1..1024, hidden
    4096 and 7168) unless --shapes says, which then holds for every pattern; --quick has its own."""
    assert not set(cases.MOE_PATTERNS) & set(cli.parse_args([]).pattern_list)
    args = cli.parse_args(["--patterns", "residual_rmsnorm,moe,moe_k2_residual_rmsnorm"])
    assert args.pattern_list == ["residual_rmsnorm", *cases.MOE_PATTERNS]
    assert len(cases.MOE_PATTERNS) == 13 and all(cases.PATTERNS[n].is_moe for n in cases.MOE_PATTERNS)
    moe = cases.PATTERNS["moe_k8_residual_rmsnorm_fp8"]
    assert cases.shapes_of(args, moe) == [(t, h) for h in (4096, 7168) for t in (1, 16, 64, 256, 1024)]
    assert cases.shapes_of(args, cases.PATTERNS["residual_rmsnorm"]) == args.shape_list != cases.shapes_of(args, moe)
    args = cli.parse_args(["--patterns", "moe", "--shapes", "2x512"])
    assert cases.shapes_of(args, moe) == [(2, 512)] == cases.shapes_of(args, cases.PATTERNS["allreduce"])
    assert cases.shapes_of(cli.parse_args(["--quick"]), moe) == list(cases.MOE_QUICK_SHAPES)
    assert cases.shapes_of(_args(), moe) == [(4, 256)]  # a Namespace without moe_shape_list


def test_moe_table_rows_are_the_patterns_own_shapes():
    args = cli.parse_args(["--modes", "eager", "--dtypes", "bf16", "--patterns", "residual_rmsnorm,moe_k2_residual_rmsnorm",
                           "--impls", "nccl+eager"])
    records = [_rec("nccl+eager", 3.0, "eager", t=1, pattern="moe_k2_residual_rmsnorm") | {"hidden": 7168}]
    doc = {"machine": "m", "gpu": "g", "world_size": 2, "backend": "gloo", "date": "d", "versions": {},
           "ceilings": {"hbm_copy_GBps": None, "p2p_GBps": None}, "records": records, "skipped": [],
           "plans": [{"impl": "commfuse-auto", "pattern": "moe_k2_residual_rmsnorm", "dtype": "bf16", "tokens": 1,
                      "hidden": 7168, "combine": "kernel", "collective": "p2p_oneshot", "tail": "fused"}]}
    text = report.format_table(doc, {}, args)
    blocks = {b.split("\n")[0]: b.split("\n")[1:] for b in text.split("\n== ")[1:]}
    moe = blocks["eager: moe_k2_residual_rmsnorm bf16"]
    assert [r.split()[0] + "x" + r.split()[2] for r in moe[1:11]] == [f"{t}x{h}" for h in (4096, 7168)
                                                                       for t in (1, 16, 64, 256, 1024)]
    assert moe[6].split() == ["1", "x", "7168", "3.0"]
    assert len([r for r in blocks["eager: residual_rmsnorm bf16"] if r.strip()]) == 1 + len(args.shape_list)
    assert len([r for r in moe if r.strip() and r[0].isdigit()]) == 10
    assert "commfuse-auto / moe_k2_residual_rmsnorm bf16: kernel combine + p2p_oneshot + fused tail (1x7168)" in text




def test_tail_commfuse_row_plans_the_moe_combine_on_the_machine(monkeypatch):
    """The benchmark's tail-commfuse row asks commfuse.moe.plan for the combine's route on the bench's device
    (a routes.Machine), and skips with its reason where the combine kernel cannot run (here: CPU tensors)."""
    from commfuse.bench import impls
    from commfuse.bench.verdict import Skip
    from commfuse.kernels import fused_tail

    monkeypatch.setattr(fused_tail, "warmup", lambda *a, **k: None)  # no NVRTC here
    m0 = types.SimpleNamespace(y=torch.randn(4, 2, 256).bfloat16(), weights=torch.rand(4, 2), row_index=None,
                               shared=None)
    case = types.SimpleNamespace(pattern=types.SimpleNamespace(is_moe=True, quant=None, post=False),
                                 dtype=torch.bfloat16, hidden=256, moe_set=lambda i: m0)
    with pytest.raises(Skip, match="combine: tensors on cpu"):
        impls._prep_tail_commfuse(types.SimpleNamespace(cuda=True, device=torch.device("cpu")), case)


@pytest.mark.parametrize("script", ["bench", "device", "gate", "probe", "sanitize", "test"])
def test_launch_scripts_refuse_fewer_than_one_rank(script, tmp_path):
    """N = 0 is an error that names N, before anything starts (mpirun -n 0 would start a rank per slot)."""
    run = subprocess.run(["bash", str(ROOT / "launch" / f"{script}.sh"), "0"], env=dict(_child_env(), OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"launch/{script}.sh: N, the number of ranks, must be at least 1, got 0" \
        in run.stderr, (run.returncode, run.stderr[-500:])
    assert not any(tmp_path.iterdir())  # nothing written


def test_device_sh_refuses_an_unknown_stage_and_fails_with_a_failed_stage(tmp_path):
    """A misspelt stage is an error before anything runs (it was skipped, and the call passed); a stage that fails
    fails the command (it exited 0 whatever its stages did). On the CPU the sanitizer stage fails: it needs a GPU."""
    env = dict(_child_env(), OUT=str(tmp_path / "out"))
    run = subprocess.run(["bash", str(ROOT / "launch" / "device.sh"), "1", "tset"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "unknown stage 'tset'" in run.stderr, (run.returncode, run.stderr[-500:])
    assert not (tmp_path / "out").exists()
    if not torch.cuda.is_available():
        run = subprocess.run(["bash", str(ROOT / "launch" / "device.sh"), "1", "sanitize"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "sanitize   rc=2" in run.stdout, (run.returncode, run.stdout[-1000:])


def test_ab_sh_refuses_a_missing_base_tree(tmp_path):
    """Without its base tree ab.sh benchmarked the working directory's tree under the base's name, and passed."""
    run = subprocess.run(["bash", str(ROOT / "launch" / "ab.sh"), str(tmp_path / "absent"), "1", str(tmp_path / "o")],
                         env=_child_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "BASE_TREE" in run.stderr and not (tmp_path / "o").exists(), run.stderr[-500:]
    run = subprocess.run(["bash", str(ROOT / "launch" / "ab.sh"), str(tmp_path)], env=_child_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "usage: launch/ab.sh" in run.stderr


@cpu_smoke
def test_bench_sh_counts_no_gpu_behind_a_hidden_list(tmp_path):
    """CUDA_VISIBLE_DEVICES=-1 hides every GPU (CUDA reads the list up to its first invalid entry): the CPU's two
    gloo ranks, with the warning that these are not GPU numbers (it was counted as one GPU)."""
    run = subprocess.run([str(ROOT / "launch" / "bench.sh"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(_child_env(), CUDA_VISIBLE_DEVICES="-1"), timeout=120)
    assert "no GPU: 2 ranks over gloo on the CPU" in run.stderr and run.stdout.count("usage:") == 2, run.stderr[-500:]


@cpu_smoke
def test_test_sh_reads_a_leading_zero_as_decimal(tmp_path):
    """launch/test.sh 08: eight ranks, whose results are checked (bash took "08" for a bad octal: mpirun started 8
    ranks and the script checked none of them, so a failure on rank 1 passed). The failing rank fails the command,
    by name."""
    (tmp_path / "test_rank.py").write_text(
        "import os\n\n\ndef test_rank_zero_only():\n    assert os.environ.get('OMPI_COMM_WORLD_RANK', '0') == '0'\n")
    run = subprocess.run(["bash", str(ROOT / "launch" / "test.sh"), "08", str(tmp_path / "test_rank.py"), "-q"],
                         env=dict(_child_env(), COMMFUSE_TEST_LOGS=str(tmp_path / "logs")), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and "rank 1: FAILED" in run.stdout, (run.returncode, run.stdout[-1000:],
                                                                    run.stderr[-500:])
    assert len(list((tmp_path / "logs").glob("rank*.rc"))) == 8
    assert "value too great for base" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the sanitizer")
def test_sanitize_sh_says_it_needs_a_gpu(tmp_path):
    """Without a GPU (or compute-sanitizer) the sanitizer script says what it needs, before it starts anything."""
    run = subprocess.run(["bash", str(ROOT / "launch" / "sanitize.sh"), "2"], env=dict(_child_env(), OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "launch/sanitize.sh: needs a CUDA GPU" in run.stderr, (run.returncode,
                                                                                          run.stderr[-500:])


def test_the_plot_marks_rows_timed_though_wrong(tmp_path, monkeypatch):
    """A baseline timed though its gate rejected it (the record's "wrong", the table's *) is drawn as a cross, and
    its label says so: the plot drew it as a plain point."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    recs = [{"impl": impl, "pattern": "residual_rmsnorm_fp8", "dtype": "bf16", "tokens": t, "hidden": 4096,
             "mode": "graph", "us": 1.0 + t / 100,
             **({"wrong": "rejected"} if impl == "tail-compile" and t == 16 else {})}
            for impl in ("commfuse-auto", "tail-compile") for t in (1, 16, 64)]
    doc = {"machine": "m", "gpu": "g", "world_size": 1, "records": recs}
    report.plot(doc, str(tmp_path / "p.png"), "graph", "bf16")
    (fig,) = figures
    ax = fig.axes[0]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [16]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sorted(labels) == ["commfuse-auto", "tail-compile (x: wrong)"], labels
    monkeypatch.undo()
    plt.close(fig)


@pytest.mark.parametrize("n, lo, hi", [(40, 14, 27), (41, 14, 28), (9, 2, 8), (6, 1, 6), (5, 1, 5), (3, 1, 3),
                                       (1, 1, 1)])
def test_median_interval_takes_the_binomial_ranks(n, lo, hi):
    """The median's interval is the lo-th and hi-th smallest of n values (the binomial table's ranks), whatever
    order they come in; its coverage, 1 - 2 P(B < lo), is at least 95% where n >= 6 and one rank further in
    would drop below it; fewer values give their whole range and its lower coverage (75% for 3, 0 for 1)."""
    import math

    xs = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).tolist()
    s = sorted(xs)

    def coverage(j):
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n

    low, high, cov = timing.median_interval(xs)
    assert (low, high) == (s[lo - 1], s[hi - 1]) and cov == pytest.approx(coverage(lo), abs=1e-15)
    assert (cov >= 0.95 > coverage(lo + 1)) if n >= 6 else cov < 0.95
    with pytest.raises(ValueError, match="at least one value"):
        timing.median_interval([])
