"""commfuse.reference's MoE combine (docs/semantics.md section 14) against hand-derived values: the slot
order of the fp32 sum, one rounding to T, the shared expert first, dropped slots, the errors."""
import pytest
import torch

from commfuse import reference as R

from compare import bits_equal


def test_slots_sum_in_order_in_fp32():
    # 2^24 + 1 rounds to 2^24 in fp32 (ties to even), so slot order shows: ((2^24 + 1) - 2^24) = 0, not 1.
    y = torch.tensor([[[2.0 ** 24], [1.0], [-(2.0 ** 24)]]])  # t=1, k=3, h=1
    w = torch.ones(1, 3)
    assert R.moe_reduce(y, w).item() == 0.0
    assert R.moe_reduce(y[:, [0, 2, 1]], w).item() == 1.0  # another order, another sum: the order is the definition


def test_one_rounding_to_t_and_weights_in_fp32():
    # bf16 keeps 8 significant bits: next to 1 its values are 2^-7 apart. 1 + 2^-8 + 2^-9 = 1 + 3 * 2^-9 is
    # exact in fp32 and rounds once, up, to 1 + 2^-7; summed in bf16 it would be 1 (1 + 2^-8 is a tie, to even).
    y = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -9]]], dtype=torch.bfloat16)
    w = torch.ones(1, 3, dtype=torch.bfloat16)
    assert R.moe_reduce(y, w).item() == 1.0 + 2.0 ** -7
    # float32 weights multiply in fp32: 0.1 is not a bf16 value, and is not rounded to one first.
    got = R.moe_reduce(torch.tensor([[[3.0]]], dtype=torch.bfloat16), torch.tensor([[0.1]]))
    assert bits_equal(got, torch.tensor([[0.1 * 3.0]], dtype=torch.float32).to(torch.bfloat16))


def test_shared_expert_comes_first():
    y = torch.tensor([[[1.0], [-(2.0 ** 24)]]])
    shared = torch.tensor([[2.0 ** 24]])
    # acc = 2^24, + 1 -> 2^24 (ties to even), - 2^24 -> 0: the shared output is the first addend.
    assert R.moe_reduce(y, torch.ones(1, 2), shared).item() == 0.0


def test_finalize_gathers_permuted_rows_and_skips_dropped_slots():
    rows = torch.arange(12.0).view(6, 2)
    rows[3] = float("nan")  # a padding row nobody points at, and the row a dropped slot's clamp would read
    idx = torch.tensor([[5, 0], [-1, 2]], dtype=torch.int32)
    w = torch.tensor([[1.0, 2.0], [3.0, 0.5]])
    got = R.moe_finalize(rows, idx, w)
    assert torch.equal(got, torch.tensor([[10.0 + 2 * 0.0, 11.0 + 2 * 1.0], [0.5 * 4.0, 0.5 * 5.0]]))
    assert torch.equal(got, R.moe_reduce(torch.stack([rows[[5, 0]], torch.stack([rows[2] * 0, rows[2]])]),
                                         torch.tensor([[1.0, 2.0], [0.0, 0.5]])))
    # A dropped slot adds nothing, not +0: a shared -0.0 stays -0.0.
    neg = R.moe_finalize(rows, torch.tensor([[-1, -1]]), torch.ones(1, 2), torch.tensor([[-0.0, -0.0]]))
    assert torch.equal(neg, torch.zeros(1, 2)) and bool(torch.signbit(neg).all())


def test_arguments_are_checked():
    y, w = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="y must be"):
        R.moe_reduce(y[0], w)
    with pytest.raises(ValueError, match="shared must be"):
        R.moe_reduce(y, w, torch.zeros(2, 4))
    rows = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="row_index must hold rows"):
        R.moe_finalize(rows, torch.tensor([[6, 0]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="int32/int64"):
        R.moe_finalize(rows, torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="weights must be"):
        R.moe_finalize(rows, torch.tensor([[0, 1]]), torch.ones(1, 3))


def test_finalize_with_every_slot_dropped_and_no_rows():
    """No row is read for a dropped slot, also where there are none: the shared output alone (or zeros)."""
    shared = torch.tensor([[1.5, -0.0]], dtype=torch.bfloat16)
    got = R.moe_finalize(torch.empty(0, 2, dtype=torch.bfloat16), torch.full((1, 3), -1), torch.ones(1, 3),
                                 shared)
    assert torch.equal(got.view(torch.int16), shared.view(torch.int16))  # -0.0 stays -0.0
