"""CPU: LaunchPlans (commfuse.kernels.launch) and the Python plan table (commfuse.kernels.table), with
stand-in kernels that record their launches: the pointer patches, the caller's outputs, the table's
signatures. The C++ Launcher and Table run the same plans on a GPU (test_communicator.py)."""
import ctypes
import struct

import pytest
import torch

from commfuse.kernels import launch, params, table
from commfuse.kernels.launch import OUT, RESIDUAL, SCALE, WEIGHT, X, Launch, LaunchPlan, PyLauncher
from commfuse.reference import Tail
from commfuse.tail.spec import OutputSpec, TailSpec


class Recorder:
    """A jit.Kernel stand-in: keeps each launch's grid, block and parameter bytes."""

    def __init__(self):
        self.launches = []
        self.pdl = False

    def launch(self, grid, block, params=b"", shared_mem=0, stream=None, cluster=1):
        assert cluster == 1, "the tails launch no clusters"
        self.launches.append((grid, block, params))


def test_tail_patches_cover_every_pointer_field():
    """A pointer field added to TailParams without a source would be left 0 by every launcher: every 'ptr'
    field has exactly one patch, at its offset."""
    base = params.P2P.offsets["tail"] + 8  # any base: the offsets move with it
    patches = launch.tail_patches(base, {OUT + 1: 64})
    pointers = {base + params.TAIL.offsets[f.name] for f in params.TAIL.fields if f.kind == "ptr"}
    assert {o for o, _, _ in patches} == pointers
    sources = [s for _, s, _ in patches]
    assert len(set(sources)) == len(sources)
    assert set(sources) <= {RESIDUAL, WEIGHT, SCALE} | {OUT + i for i in range(5)}
    assert [d for _, s, d in patches if s == OUT + 1] == [64] and sum(d for _, _, d in patches) == 64


def test_tail_fields_follow_the_spec():
    f = dict(zip((fld.name for fld in params.TAIL.fields), launch.tail_fields(TailSpec.of("fp8_block",
                 scale_layout="mn_major", scale_ue8m0=True, weight_offset=1.0, eps=1e-5), 6, 256, rows=3)))
    assert (f["h"], f["t"], f["sf_swizzled"], f["scale_layout"], f["scale_stride"]) == (256, 3, 0, 3, 8)
    assert f["weight_offset"] == 1.0 and f["eps"] == 1e-5 and not any(f[n] for n in ("weight", "residual_in"))
    g = dict(zip((fld.name for fld in params.TAIL.fields), launch.tail_fields(TailSpec.of("nvfp4"), 5, 64)))
    assert (g["sf_swizzled"], g["scale_layout"]) == (1, 0) and struct.pack("<f", g["weight_offset"]) == \
        struct.pack("<f", -0.0)  # no offset: -0.0, which the kernel adds bit-exactly


def _plan(kernel, patches, outputs, fused=True):
    return LaunchPlan("test", (Launch(kernel, 3, 64, bytes(64), tuple(patches)),),
                      tuple(outputs) + ((None,) * (5 - len(outputs)) if fused else ()), 0)


def test_py_launcher_patches_pointers_of_the_call_and_the_callers_outputs():
    rec = Recorder()
    spec = (OutputSpec((4, 8), torch.bfloat16), OutputSpec((4, 8), torch.bfloat16))
    plan = _plan(rec, [(0, X, 0), (8, RESIDUAL, 16), (16, WEIGHT, 0), (24, OUT, 32), (32, OUT + 1, 0),
                       (40, OUT + 2, 0), (48, SCALE, 0)], spec)
    x, residual = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    weight = torch.randn(8).bfloat16()
    out = Tail(torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(4, 8, dtype=torch.bfloat16), None, None)
    got = PyLauncher(plan)(x, residual, weight, None, out)
    assert got[0] is out.residual and got[1] is out.norm and got[2:] == (None, None, None)
    (grid, block, raw), = rec.launches
    assert grid == (3, 1, 1) and block == (64, 1, 1)
    ptrs = struct.unpack("<7Q", raw[:56])
    assert ptrs == (x.data_ptr(), residual.data_ptr() + 16, weight.data_ptr(), out.residual.data_ptr() + 32,
                    out.norm.data_ptr(), 0, 0)  # absent: 0
    # A tuple in Tail's order serves as out too, and a misaligned caller tensor is refused per call.
    PyLauncher(plan)(x, residual, weight, None, (out.residual, out.norm, None, None))
    base = torch.empty(40, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out.norm must be 16-byte aligned"):
        PyLauncher(plan)(x, residual, weight, None, Tail(out.residual, base[1:33].view(4, 8), None, None))


def test_py_launcher_copies_strided_operands():
    rec = Recorder()
    plan = _plan(rec, [(0, X, 0), (8, OUT, 0)], (OutputSpec((4, 8), torch.bfloat16),), fused=False)
    x = torch.randn(8, 4).bfloat16().t()  # not contiguous
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    assert PyLauncher(plan)(x, out=out) is out
    x_ptr = struct.unpack("<Q", rec.launches[0][2][:8])[0]
    assert x_ptr != x.data_ptr()  # a contiguous copy


def _table(error_word=0):
    return table.PyTable("t", error_word, Tail, Tail, Tail)


def test_table_signatures_hold_metadata_and_exact_scalars():
    t = _table()
    calls = []

    def launcher(*args):
        calls.append(args)
        return (args[0], None, None, None, None)

    x = torch.randn(4, 8)
    args = (x, None, x[0], None, None, 1e-6, None, False, "swizzled", 0.0, "row", False)
    assert t.local(*args) is None  # a miss
    assert t.insert("local", args, "plan", launcher) and len(t) == 1
    r = t.local(torch.randn(4, 8), *args[1:])  # other data, same signature: a hit
    assert isinstance(r, Tail) and r.norm is None and len(calls) == 1
    for i, other in ((0, torch.randn(4, 16)), (0, torch.randn(8, 4).t()), (5, 1e-5), (8, "linear"), (7, True)):
        changed = args[:i] + (other,) + args[i + 1:]
        assert t.local(*changed) is None, i
    assert t.local(*args[:5], 1, *args[6:]) is None  # an int eps is another signature than a float's
    # A Python float scale is no key: every such call is a miss, and its insert says so.
    unkeyable = args[:3] + (0.5,) + args[4:]
    assert t.local(*unkeyable) is None and not t.insert("local", unkeyable, "plan", launcher)
    t.clear()
    assert len(t) == 0 and t.local(*args) is None


def test_table_keys_only_outs_the_checks_take():
    """A hit skips the checks, so an `out` they would reject must miss: a tuple of another length than
    reference.Tail's 4 or 5 fields, an object without the fields."""
    t = _table()
    x = torch.randn(4, 8)
    args = (x, None, x[0], None, Tail(None, None, None, None, None), 1e-6, None, False, "swizzled", 0.0, "row", False)
    assert t.insert("local", args, "plan", lambda *a: (a[0],) + (None,) * 4)
    assert t.local(*args) is not None
    assert t.local(*args[:4], (None,) * 4, *args[5:]) is not None  # the same fields, scales left out
    for out in ((None,) * 3, (None,) * 6, 42, object()):
        assert t.local(*args[:4], out, *args[5:]) is None, out


def test_table_misses_while_the_error_word_is_set():
    word = ctypes.c_int32(0)
    t = _table(ctypes.addressof(word))
    x = torch.randn(16)
    t.insert("plain", (x, None), "plan", lambda *a: a[0] + 1)
    assert torch.equal(t.plain(x, None), x + 1)
    word.value = 1 << 16
    assert t.plain(x, None) is None
    word.value = 0
    assert t.plain(x, None) is not None


def test_table_results_have_the_ops_types():
    from commfuse import FusedResult, Quantized

    t = table.PyTable("t", 0, FusedResult, Tail, Quantized)
    x = torch.randn(4, 8)
    five = lambda *a: (a[0], a[0], None, None, None)  # noqa: E731
    fused = (x, x, x[0], None, None, 1e-6, None, False, "swizzled", 0.0, "row", False, None)
    t.insert("fused", fused, "the plan", five)
    r = t.fused(*fused)
    assert isinstance(r, FusedResult) and r.plan == "the plan" and r.residual is x
    # a post_weight is a key of its own, handed to the launcher as its z
    post = fused[:12] + (x[1],)
    assert t.fused(*post) is None
    t.insert("fused", post, "post", lambda *a: (a[5], None, None, None, None))
    assert t.fused(*post).residual is post[12]
    quantize = (x, None, "fp8_block", "swizzled", "row", False)
    t.insert("quantize", quantize, "p", lambda *a: (None, None, a[0], None, a[0][:, 0]))
    q = t.quantize(*quantize)
    assert isinstance(q, Quantized) and q.quant is x and q.scale_factors is None
    gated = (x, None, x[0], None, 1e-5, 4, False, None, False, "swizzled", "row", False)
    t.insert("gated", gated, "p", lambda *a: (None, a[0], None, None, None))
    assert t.gated(*gated).norm is x


def test_table_keys_moe_calls_by_every_moe_input():
    """A MoE call's key holds y, the routing weights, the row index and the shared expert (their presence,
    dtype and shape) beside fused's arguments; a hit calls the launcher with the MoE inputs in their places
    and returns the fused result type, plan included."""
    from commfuse import FusedResult, Quantized

    t = table.PyTable("t", 0, FusedResult, Tail, Quantized)
    calls = []

    def launcher(*a):
        calls.append(a)
        return (a[1], None, None, None, None)

    y, w, idx, shared = torch.randn(12, 8), torch.rand(3, 4), torch.arange(12, dtype=torch.int32).view(3, 4), None
    residual, weight = torch.randn(3, 8), torch.randn(8)
    tail = (1e-6, None, False, "swizzled", 0.0, "row", False)
    args = (y, w, idx, shared, residual, weight, None, None) + tail
    assert t.moe(*args) is None and t.insert("moe", args, "the plan", launcher)
    r = t.moe(*args)
    assert isinstance(r, FusedResult) and r.plan == "the plan" and r.residual is residual
    assert calls == [(y, residual, weight, None, None, w, idx, None)]
    for i, other in ((2, idx.long()), (2, None), (3, residual), (1, w.bfloat16()), (0, torch.randn(12, 16))):
        assert t.moe(*args[:i], other, *args[i + 1:]) is None, i
    assert len(calls) == 1


@pytest.mark.parametrize("weights_dtype, index_dtype", [(torch.bfloat16, torch.int64), (torch.float32, torch.int32)])
def test_py_launcher_passes_a_moe_plans_weights_and_row_index_as_given(weights_dtype, index_dtype):
    """A MoE plan's launcher hands the kernel the routing weights and the row index themselves, whatever their
    dtypes (the plan's fields say which): no conversion kernel; a strided row index is made dense."""
    rec = Recorder()
    spec = (OutputSpec((3, 8), torch.bfloat16),)
    patches = [(0, X, 0), (8, launch.Z, 0), (16, launch.ROW_INDEX, 0), (24, launch.SHARED, 0)]
    plan = LaunchPlan("moe", (Launch(rec, 3, 64, bytes(64), tuple(patches)),), spec + (None,) * 4, 0, combine=True)
    y = torch.randn(12, 8).bfloat16()
    w = torch.rand(3, 4).to(weights_dtype)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, 7], [8, 12, -5, 11]], dtype=index_dtype)
    out = Tail(torch.empty(3, 8, dtype=torch.bfloat16), None, None, None)
    PyLauncher(plan)(y, None, None, None, out, w, idx, None)
    ptrs = struct.unpack("<4Q", rec.launches[0][2][:32])
    assert ptrs == (y.data_ptr(), w.data_ptr(), idx.data_ptr(), 0)
    strided = idx.t().contiguous().t()
    PyLauncher(plan)(y, None, None, None, out, w, strided, None)
    ptrs = struct.unpack("<4Q", rec.launches[1][2][:32])
    assert ptrs[2] not in (0, strided.data_ptr())


def test_table_is_cleared_when_full(monkeypatch):
    monkeypatch.setattr(table, "MAX_ENTRIES", 3)
    t = _table()
    for n in range(1, 5):
        t.insert("plain", (torch.randn(8 * n), None), "p", lambda *a: a[0])
    assert len(t) == 1


@pytest.mark.parametrize("family", ["fused_tail", "gated_norm", "quantize"])
@pytest.mark.parametrize("t, h, quant", [(1, 4096, "nvfp4"), (300, 7168, "fp8_block"), (130, 8192, "mxfp8")])
def test_row_kernel_families_plan_one_launch_per_call(monkeypatch, family, t, h, quant):
    """Each tail-row family's LaunchPlan: the variant of its launch configuration, one CTA per row and
    padding row (the gated norm: gated_norm.splits CTAs each), its struct's bytes with the pointers patched
    from the call's sources."""
    from commfuse.kernels import fused_tail, gated_norm, quantize

    module = {"fused_tail": fused_tail, "gated_norm": gated_norm, "quantize": quantize}[family]
    fam = {"fused_tail": fused_tail.FUSED_TAIL, "gated_norm": gated_norm.GATED_NORM, "quantize": quantize.QUANTIZE}[family]
    loaded = []
    monkeypatch.setattr(fam, "kernel", lambda name, device: loaded.append(name) or Recorder())
    spec = TailSpec.of(quant)
    if family == "gated_norm":
        plan, struct_ = fam.plan(torch.bfloat16, t, h, spec, 512, False, 0), params.GATED_NORM
        inputs = {"x": X, "z": launch.Z}
    else:  # fused_tail and quantize: FusedTailParams, x as its input a
        plan, struct_ = fam.plan(torch.bfloat16, t, h, spec, 0), params.FUSED_TAIL
        inputs = {"a": X}
    (one,) = plan.launches
    splits = {"gated_norm": lambda: gated_norm.splits(h, t, 512, spec), "quantize": lambda: quantize.splits(h, t, spec),
              "fused_tail": lambda: 1}[family]()
    assert splits == (4 if (family, t) == ("gated_norm", 1) else 1)  # 1 x 4096: 4 slices of 1024 (MIN_SLICE)
    vpt, threads = module.launch_config(h // splits, t, *([spec] if family == "quantize" else []))
    assert loaded == [fam.name_expression(torch.bfloat16, spec.format, vpt)]
    assert (one.grid, one.block, len(one.params)) == (spec.row_slots(t) * splits, threads, struct_.size)
    if family == "gated_norm":
        assert struct.unpack_from("<i", one.params, params.GATED_NORM.offsets["splits"]) == (splits,)
    patched = {offset: source for offset, source, _ in one.patches}
    for field, source in inputs.items():
        assert patched[struct_.offsets[field]] == source
    outputs = spec.outputs(t, h, torch.bfloat16, residual=family == "fused_tail")
    assert plan.outputs == tuple(outputs)
    if family != "fused_tail":  # no residual, no norm: quant, scale_factors / scales only
        assert plan.outputs[0] is None and plan.outputs[1] is None and plan.outputs[2] is not None


@pytest.mark.parametrize("family", ["fused_tail", "gated_norm", "quantize"])
@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_warmup_loads_every_kernel_a_plan_launches(monkeypatch, family, quant):
    """Family.configs (what warmup compiles and loads, before a CUDA graph capture) holds the kernel of
    every plan of that hidden size, few rows and many, with and without quantization."""
    from commfuse.kernels import fused_tail, gated_norm, quantize

    fam = {"fused_tail": fused_tail.FUSED_TAIL, "gated_norm": gated_norm.GATED_NORM, "quantize": quantize.QUANTIZE}[family]
    if family == "quantize" and quant is None:
        pytest.skip("quantize has no plain variant")
    loaded = []
    monkeypatch.setattr(fam, "kernel", lambda name, device: loaded.append(name) or Recorder())
    spec = TailSpec.of(quant)
    for h in (2048, 4096, 7168, 8192):
        configs = set(fam.configs(torch.bfloat16, spec, h))
        for t in (1, fused_tail.LATENCY_TOKENS - 1, fused_tail.LATENCY_TOKENS, 8192):
            loaded.clear()
            if family == "gated_norm":
                fam.plan(torch.bfloat16, t, h, spec, h // 2, False, 0)
            else:
                fam.plan(torch.bfloat16, t, h, spec, 0)
            assert loaded and set(loaded) <= configs, (h, t, loaded, configs)


@pytest.mark.parametrize("t, h, quant, vpt", [
    (255, 4096, "fp8", 1), (256, 4096, "fp8", 2), (8192, 8192, "fp8", 2), (1024, 4096, "nvfp4", 2),
    (1024, 8192, "nvfp4", 4), (8192, 4096, "nvfp4", 4), (1024, 4096, "mxfp8", 4), (1024, 16384, "fp8", 2)])
def test_quantize_many_rows_of_fp8_take_vpt_2(t, h, quant, vpt):
    """quantize.launch_config: from LATENCY_TOKENS rows static FP8 (NVFP4 up to 2^22 elements) runs at VPT 2,
    h / 16 threads a row; larger NVFP4 calls and the other formats keep register_config's VPT 4."""
    from commfuse.kernels import quantize

    got_vpt, threads = quantize.launch_config(h, t, TailSpec.of(quant))
    assert got_vpt == vpt and 8 * vpt * threads >= h and threads <= quantize.MAX_THREADS[vpt]
    if vpt == 2:
        assert threads == h // 16


@pytest.mark.parametrize("t, h, quant, split, threads", [
    (1, 7168, "fp8", 7, 128), (1, 8192, "nvfp4", 8, 128), (16, 8192, "fp8", 8, 128), (17, 8192, "fp8", 1, 1024),
    (64, 7168, "nvfp4", 1, 896), (1, 16384, "mxfp8", 8, 256), (2, 4352, "fp8", 5, 128), (1, 4096, "nvfp4", 1, 512),
    (3, 2944, "fp8", 1, 384), (1, 8192, "fp8_per_token", 1, 1024), (1, 8192, "fp8_block", 8, 128)])
def test_quantize_cuts_few_rows_into_slices(t, h, quant, split, threads):
    """quantize.splits: at few rows a row longer than WHOLE_HIDDEN goes to ceil(h / SLICE) CTAs (at most
    MAX_SPLIT, the call's at most SPLIT_CTAS), VPT 1, each a slice of whole 16-vector blocks (4352: the last one
    shorter); never a format whose scale spans the row."""
    from commfuse.kernels import quantize

    spec = TailSpec.of(quant)
    assert quantize.splits(h, t, spec) == split
    vpt, got_threads, got_split = quantize.cut_config(h, t, spec)
    assert (got_threads, got_split) == (threads, split) and (vpt == 1 or split == 1)
    if split > 1:  # the slices cover the row, each whole 16-vector blocks, none longer than SLICE but at MAX_SPLIT
        per = launch.slice_vectors(h // 8, split)
        assert per % 16 == 0 and per * split >= h // 8 > per * (split - 1)
        assert per * 8 <= quantize.SLICE or split == quantize.MAX_SPLIT
