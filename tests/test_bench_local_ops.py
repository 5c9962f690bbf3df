"""examples/bench_local_ops.py at a small shape: every pattern's commfuse row passes its check against the
reference before it is timed, and each row counts the bytes its op must move (inputs once, outputs once),
from which a GPU run gives each time its share of the HBM copy ceiling."""
import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_local_ops", os.path.join(HERE, "..", "examples", "bench_local_ops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wrong_after(bench, monkeypatch, right: int) -> None:
    """commfuse.fused_add_rmsnorm as the bench calls it, right on its first `right` calls, then its residual off
    by one."""
    calls, fused = [], bench.commfuse.fused_add_rmsnorm

    def wrong_later(*args, **kw):
        r = fused(*args, **kw)
        calls.append(1)
        if len(calls) > right:
            r.residual.add_(1)
        return r
    monkeypatch.setattr(bench.commfuse, "fused_add_rmsnorm", wrong_later)


def test_local_ops_bench_checks_and_counts_bytes(tmp_path):
    bench = _bench()
    t, h = 3, 256
    out = bench.main(["--shapes", f"{t}x{h}",
                      "--patterns", ",".join(bench.PATTERNS + ("gated_rmsnorm:64", "gated_rmsnorm:96")),
                      "--repeats", "1", "--calls", "1", "--json", str(tmp_path / "out.json")])
    assert "gated_rmsnorm:96" not in {r["pattern"] for r in out["rows"]}  # 96 does not divide 256: skipped
    assert os.path.exists(tmp_path / "out.json")
    gpu = torch.cuda.is_available()  # the copy ceiling, and each time's share of it, only from a GPU's graphs
    assert out["hbm_copy_GBps"] > 0 if gpu else out["hbm_copy_GBps"] is None, out["hbm_copy_GBps"]
    row, e = {r["pattern"]: r for r in out["rows"]}, 2  # bf16
    for r in out["rows"]:
        times = ("graph", "eager") if gpu else ("host",)  # GPU time where CUDA is, else the host's wall time
        assert "rejected" not in r["commfuse"] and all(r["commfuse"][k] > 0 for k in times), r
        assert ("frac_hbm" in r["commfuse"]) == gpu, r
    x, w = t * h * e, h * e
    assert row["add_rmsnorm"]["bytes"] == 2 * x + w + 2 * x  # x, residual, weight; residual out, norm
    assert row["rmsnorm"]["bytes"] == x + w + x
    assert row["add_rmsnorm_fp8"]["bytes"] == 2 * x + w + 4 + x + t * h  # + the scale; residual out, fp8 codes
    # NVFP4: codes 2 a byte, scale factors one a 16 elements in the swizzled layout's 128-row x 4-column tiles
    sf = 128 * -(-(h // 16) // 4) * 4
    assert row["add_rmsnorm_nvfp4"]["bytes"] == 2 * x + w + 4 + x + t * h // 2 + sf
    assert row["gated_rmsnorm:64"]["bytes"] == 3 * x + w  # x, gate, weight; norm
    assert row["quantize_fp8"]["bytes"] == x + 4 + t * h


def test_a_dropped_output_is_rejected_and_bad_options_named(capsys):
    """An op that returns fewer outputs than the reference (its norm dropped) fails the check, not only a
    wrong value; an unknown pattern (a typo would run another op under its name) or shape is refused."""
    import pytest

    bench = _bench()
    assert bench.check((1,), (1, 2), None) == "1 outputs, the reference has 2"
    for argv in (["--patterns", "add_rmsnorm_fp4"], ["--shapes", "0x512"], ["--repeats", "0"], ["--dtypes", "fp32"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert "unknown pattern 'add_rmsnorm_fp4'" in capsys.readouterr().err
    for argv, error in ((["--patterns", "quantize_nvfp4", "--shapes", "2x24"], "need a hidden size that is a multiple "
                         "of 16"), (["--json", "/nonexistent/x.json"], "is not a folder this process can write to")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert error in capsys.readouterr().err, argv


def test_a_row_wrong_from_the_plan_table_or_after_its_checks_is_rejected(monkeypatch):
    """commfuse's calls after a signature's first run from the plan table, as every timed call does: a table
    whose launches are wrong (here every call from it), or an op right on its first N calls only, gets its row
    rejected rather than timed."""
    import commfuse.local as local

    bench = _bench()
    real = local._table()

    class Wrong:  # the plan table, its launches' residual off by one
        def __getattr__(self, name):
            return getattr(real, name)

        def local(self, *args):
            r = real.local(*args)
            if r is not None:
                r.residual.add_(1)
            return r

    argv = ["--shapes", "4x256", "--patterns", "add_rmsnorm", "--repeats", "1", "--calls", "2"]
    with monkeypatch.context() as m:
        m.setattr(local, "_TABLE", Wrong())
        row = bench.main(argv)["rows"][0]
    assert row["commfuse"]["rejected"].startswith("output: "), row
    _wrong_after(bench, monkeypatch, 2)  # the two checked calls right, the timed ones not
    row = bench.main(argv)["rows"][0]
    assert row["commfuse"]["rejected"].startswith("the last timed call: output: "), row


def test_paired_rounds_are_checked_and_reported(monkeypatch):
    """--paired N times commfuse against torch.compile in N interleaved rounds: the row gets both medians,
    the ratio's median inside its interval; an op whose paired calls go wrong gets that part rejected."""
    import pytest

    bench = _bench()
    argv = ["--shapes", "4x256", "--patterns", "add_rmsnorm", "--repeats", "1", "--calls", "2", "--paired", "7"]
    v = bench.main(argv)["rows"][0]["paired"]
    assert v["rounds"] == 7 and v["commfuse"] > 0 and v["torch.compile"] > 0, v
    assert v["ratio_ci95"][0] <= v["ratio"] <= v["ratio_ci95"][1] and v["coverage"] >= 0.95, v  # 7 rounds: 98.4%
    # Right until the paired rounds start (the checks and every mode's timed calls: how many depends on the modes
    # the device has), then wrong: captured so in the paired rounds' CUDA graphs on a GPU.
    fused, paired, real = bench.commfuse.fused_add_rmsnorm, [], bench.paired_us

    def wrong_when_paired(*args, **kw):
        r = fused(*args, **kw)
        if paired:
            r.residual.add_(1)
        return r
    monkeypatch.setattr(bench.commfuse, "fused_add_rmsnorm", wrong_when_paired)
    monkeypatch.setattr(bench, "paired_us", lambda *a, **kw: paired.append(1) or real(*a, **kw))
    row = bench.main(argv)["rows"][0]
    assert "rejected" not in row["commfuse"], row
    assert row["paired"]["rejected"].startswith("the last paired call: output: "), row
    with pytest.raises(SystemExit):
        bench.main(["--paired", "-1"])


def test_the_commfuse_column_times_the_library_call_alone(monkeypatch):
    """commfuse's timed call is the library's own, its result returned as it is; the outputs are taken for the
    checks outside it (a tuple built from the result in the timed call was host time the torch columns, which
    return their tuples directly, did not pay: about 1.3 us a call)."""
    bench = _bench()
    gen = torch.Generator().manual_seed(0)
    for pattern, name in (("add_rmsnorm", "fused_add_rmsnorm"), ("rmsnorm", "fused_add_rmsnorm"),
                          ("quantize_fp8", "quantize"), ("gated_rmsnorm", "gated_rmsnorm")):
        ours, _, want, *_ = bench.make_case(pattern, 4, 256, torch.bfloat16, torch.device("cpu"), gen)
        assert bench.check(ours(), want, None if "fp8" not in pattern else "fp8", pattern) == "", pattern
        sentinel = object()
        with monkeypatch.context() as m:
            m.setattr(bench.commfuse, name, lambda *args, **kw: sentinel)
            assert ours() is sentinel, pattern
