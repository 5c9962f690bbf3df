"""commfuse.tail.spec's op codes: the `tail` int of the commfuse ops, and their outputs lists."""
import math

import pytest
import torch

from commfuse.tail import formats as F
from commfuse.tail import spec as S
from commfuse.tail.spec import TailSpec


def test_every_public_option_set_has_one_code_that_round_trips():
    seen = {}
    for c, kw in S.codes().items():
        spec = TailSpec.of(**kw, eps=1e-5, weight_offset=1.0)
        assert spec.code == c and 0 <= c < 256  # the C++ op kernels decode codes below 256
        assert S.code(**kw) == c and S.public(c) == kw
        assert TailSpec.from_code(c, 1e-5, 1.0) == spec
        seen.setdefault(spec.format.name, set()).add((kw["sf_layout"], kw["scale_layout"], kw["scale_ue8m0"]))
    assert set(seen) == set(F.names())
    assert seen["nvfp4"] == {("swizzled", "row", False), ("linear", "row", False)}
    assert seen["fp8_block"] == {("swizzled", s, u) for s in ("row", "mn_major") for u in (False, True)}
    assert seen["fp8"] == {("swizzled", "row", False)}


def test_code_names_the_wrong_argument():
    with pytest.raises(ValueError, match="quant must be one of"):
        S.code("int4")
    with pytest.raises(ValueError, match="sf_layout='linear' applies to quant 'nvfp4' / 'mxfp8' only"):
        S.code("fp8", sf_layout="linear")
    with pytest.raises(TypeError, match="return_norm must be a bool"):
        S.code("fp8", return_norm=1)
    with pytest.raises(TypeError, match="quant must be None or one of"):
        S.code(0)
    with pytest.raises(ValueError, match="quant must be one of .*got ''"):  # no format, as every public call says
        S.code("")
    assert S.code(None) == S.code()


def test_the_signature_tells_apart_what_str_rounds():
    """Ranks compare calls by `signature`: eps and weight_offset to the last bit, where str() prints %g."""
    one, near = TailSpec.of(weight_offset=1.0), TailSpec.of(weight_offset=1.000001)
    assert str(one) == str(near) and one.signature != near.signature
    assert TailSpec.of(eps=1e-6).signature != TailSpec.of(eps=1.0000001e-6).signature


def test_negative_zero_is_zero():
    """eps and weight_offset of -0.0 are 0.0 (the same tail): one signature, as the plan table, which keys them by
    value, has one entry (ranks passing 0.0 and -0.0 had been refused for good as disagreeing)."""
    for kw in ("eps", "weight_offset"):
        zero, negative = TailSpec.of(**{kw: 0.0}), TailSpec.of(**{kw: -0.0})
        assert zero == negative and zero.signature == negative.signature and \
            math.copysign(1.0, getattr(negative, kw)) == 1.0, kw


@pytest.mark.parametrize("bad", [1e39, -1e39, float("inf"), float("nan"), pytest.param(10**400, id="int 10**400"),
                                 pytest.param(-10**400, id="int -10**400")])
def test_numbers_must_be_finite_in_float32(bad):
    for name in ("eps", "weight_offset"):
        with pytest.raises(ValueError, match=f"{name} must be a finite float32 number"):
            TailSpec.of(**{name: bad})


@pytest.mark.parametrize("bad", [255, -1, True, "1", 1.0, None])
def test_a_number_that_is_no_spec_raises_naming_tail(bad):
    with pytest.raises(ValueError, match="tail must be the code of a tail spec"):
        S.public(bad)
    with pytest.raises(ValueError, match="tail must be the code of a tail spec"):
        TailSpec.from_code(bad)


@pytest.mark.parametrize("residual", [True, False])
def test_fields_and_spread_follow_the_specs_outputs(residual):
    for c in S.codes():
        outputs = TailSpec.from_code(c).outputs(3, 256, torch.bfloat16, residual)
        names = tuple(f for f, o in zip(outputs._fields, outputs) if o is not None)
        assert S.fields(c, residual) == names
        values = [f"<{n}>" for n in names]
        assert S.spread(values, c, residual) == tuple(None if o is None else f"<{f}>"
                                                      for f, o in zip(outputs._fields, outputs))
        assert S.present(S.spread(values, c, residual)) == values
