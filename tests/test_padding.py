"""unpad_input / pad_input (flash-attn's bert_padding signatures and returns) and
sequence_to_tokens."""

from __future__ import annotations

import pytest
import torch

from rlhf_kernels import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    sequence_to_tokens,
    unpad_input,
)
from rlhf_kernels._checks import sequence_ids


def test_unpad_pad_roundtrip_and_grad():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    h, idx, cu, max_len, used = unpad_input(x, mask)
    assert h.shape == (9, 2, 4) and idx.tolist() == [0, 1, 2, 7, 8, 9, 10, 12, 13]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 6, 9] and max_len == 3
    assert used.tolist() == [3, 3, 3]
    torch.testing.assert_close(h, x.reshape(15, 2, 4)[mask.reshape(-1).bool()])
    back = pad_input(h * 2, idx, 3, 5)
    assert back.shape == x.shape
    torch.testing.assert_close(back, x * 2 * mask[..., None, None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * mask[..., None, None].float().expand_as(x))
    # int32 indices, as flash-attn's and transformers' pad_input take them
    torch.testing.assert_close(pad_input(h * 2, idx.int(), 3, 5), back)


def test_unused_mask_counts_in_cu_not_in_seqused():
    mask = torch.tensor([[1, 1, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0]])
    h, idx, cu, max_len, used = unpad_input(torch.randn(1, 4, 3), mask, unused)
    assert cu.tolist() == [0, 3] and used.tolist() == [2] and max_len == 3 and h.shape[0] == 3


def test_sequence_to_tokens():
    cu = torch.tensor([0, 2, 2, 5])
    out = sequence_to_tokens(torch.tensor([1.0, 2.0, 3.0]), cu, total=5)
    assert out.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match=r"cu_seqlens must be \(4,\) for 3 sequences"):
        sequence_to_tokens(torch.zeros(3), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"values must be a tensor \(S, ...\).*got \(\)"):
        sequence_to_tokens(torch.tensor(1.0), torch.tensor([0, 5]))
    assert sequence_to_tokens(torch.tensor([1, 2]), [0, 1, 3]).tolist() == [1, 2, 2]
    empty = sequence_to_tokens(torch.zeros(0, 3), torch.zeros(1, dtype=torch.int32))
    assert empty.shape == (0, 3)
    assert sequence_ids(torch.zeros(1, dtype=torch.int32), 0).shape == (0,)


def test_index_first_axis_matches_bert_padding():
    """flash-attn's recipe: gather (B*S, ...) rows at unpad_input's indices, scatter them back."""
    x = torch.randn(2, 5, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    packed, indices, _, _, _ = unpad_input(x, mask)
    gathered = index_first_axis(x.flatten(0, 1), indices)
    assert torch.equal(gathered, packed)
    back = index_put_first_axis(gathered, indices.int(), 10).view(2, 5, 3)
    assert torch.equal(back, pad_input(packed, indices, 2, 5))
    back.sum().backward()
    assert torch.equal(x.grad[..., 0], mask.float())  # gradients only at the real tokens
    with pytest.raises(TypeError, match="indices must be int32/int64"):
        index_first_axis(x.flatten(0, 1), indices.float())
    with pytest.raises(ValueError, match=r"values \(N, ...\) and indices \(N,\) must agree"):
        index_put_first_axis(gathered[:3], indices, 10)
    with pytest.raises(ValueError, match="hidden_states has 3 tokens but indices 7"):
        pad_input(packed[:3], indices, 2, 5)
    with pytest.raises(ValueError, match="indices are on meta, input on cpu"):
        index_first_axis(x.flatten(0, 1), indices.to("meta"))
    with pytest.raises(ValueError, match="input must have a first axis to index, got a 0-d"):
        index_first_axis(torch.tensor(1.0), indices[:0])


@pytest.mark.parametrize(
    "cu,total,match",
    [
        ([3, 5, 9, 9], None, r"cu_seqlens\[0\] must be 0"),  # gave 6 tokens silently
        ([0, 5, 2, 9], None, "non-decreasing"),
        ([0, 2, 5, 9], 7, "packed length 7, got 9"),
        (torch.tensor([0.0, 2.0, 5.0, 9.0]), None, "int32 or int64"),
    ],
)
def test_sequence_to_tokens_checks_cu_seqlens(cu, total, match):
    cu = torch.tensor(cu) if isinstance(cu, list) else cu
    with pytest.raises((ValueError, TypeError), match=match):
        sequence_to_tokens(torch.ones(3), cu, total=total)


def test_bad_mask_shape():
    with pytest.raises(ValueError, match="attention_mask must be"):
        unpad_input(torch.randn(2, 4, 3), torch.ones(2, 5))
    x, ones = torch.randn(2, 4, 3), torch.ones(2, 4)
    for bad in (torch.ones(4), torch.ones(1, 4)):  # would broadcast into the wrong tokens
        with pytest.raises(ValueError, match="unused_mask must have attention_mask's shape"):
            unpad_input(x, ones, bad)
    with pytest.raises(ValueError, match="attention_mask.*0 or 1"):
        unpad_input(x, ones * 2)  # a 2 is not "real"
    with pytest.raises(ValueError, match="unused_mask.*0 or 1"):
        unpad_input(x, ones, torch.full((2, 4), -1))
