"""The per-head custom ops (convit_convert.kernels) against einsums and per-head bmm, float64:
values to 1e-12 (rounding only), gradients by finite differences, and the registrations that
torch.compile and the benchmarks' FLOP counter rely on."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import rel_err
from convit_convert.attention import RelPosAttention
from convit_convert.kernels import head_logits, head_logits_grad, head_products, head_values, head_values_grad


def test_head_products_against_einsum_gradcheck_and_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.rand(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.einsum("bhnk,bke->bnhe", p, x).reshape(2, 5, 12)
    assert torch.allclose(head_products(p, x), ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(head_products, (p, x))
    checks = torch.library.opcheck(head_products, (p.detach().float().requires_grad_(), x.detach().float()))
    assert all(v == "SUCCESS" for v in checks.values()), checks


def values_inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights over K = 8 keys, values for the first M = 6 (keys 6, 7 stand for the sink and the
    alignment padding: nonzero weights here, so skipping them is tested)."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(2, 3, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 6, 3 * 4, generator=g, dtype=dtype, requires_grad=True)
    return p, v


def test_head_values_against_einsum_and_gradcheck() -> None:
    p, v = values_inputs()
    ref = torch.einsum("bhnm,bmhe->bnhe", p[..., :6], v.view(2, 6, 3, 4)).reshape(2, 5, 12)
    assert torch.allclose(head_values(p, v), ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(head_values, (p, v))  # also: dP is 0 in the skipped columns


def logits_inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries for N = 5 patches, keys for M = 5 of L = 8 columns, 3 heads of width 4."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 12, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 5, 12, generator=g, dtype=dtype, requires_grad=True)
    return q, k


def test_head_logits_against_einsum_and_gradcheck() -> None:
    q, k = logits_inputs()
    ref = torch.einsum("bnhe,bmhe->bhnm", q.view(2, 5, 3, 4), k.view(2, 5, 3, 4))
    s = head_logits(q, k, 3, 8)
    assert s.shape == (2, 3, 5, 8)
    assert torch.allclose(s[..., :5], ref, rtol=0, atol=1e-12)
    assert (s[..., 5:] == 0).all()  # the zero keys' columns
    assert torch.autograd.gradcheck(lambda q, k: head_logits(q, k, 3, 8), (q, k))


OPCHECKS = {
    "head_values": lambda: (head_values, values_inputs(torch.float32)),
    "head_values_grad": lambda: (
        head_values_grad,
        (torch.randn(2, 5, 12), *(t.detach() for t in values_inputs(torch.float32))),
    ),
    "head_logits": lambda: (head_logits, (*logits_inputs(torch.float32), 3, 8)),
    "head_logits_grad": lambda: (
        head_logits_grad,
        (torch.randn(2, 3, 5, 8), *(t.detach() for t in logits_inputs(torch.float32))),
    ),
}


@pytest.mark.parametrize("op", OPCHECKS)
def test_training_ops_opcheck(op: str) -> None:
    """Fake-tensor kernels, autograd registration and AOT dispatch: what torch.compile traces."""
    fn, args = OPCHECKS[op]()
    checks = torch.library.opcheck(fn, args)
    assert all(r == "SUCCESS" for r in checks.values()), checks


def test_flop_formulas_equal_per_head_bmm() -> None:
    """The FLOP counter (bench MFU) sees the ops, not their bmms: the formulas must count what the
    same products count written as plain per-head bmm, forward and backward."""

    def plain_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.bmm(p[:, i, :, :6], v[:, :, 4 * i : 4 * i + 4]) for i in range(3)], -1)

    def plain_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [torch.bmm(q[..., 4 * i : 4 * i + 4], k[..., 4 * i : 4 * i + 4].mT) for i in range(3)], 1
        )

    cases = [
        ((head_values, plain_values), values_inputs, 3 * 2 * 2 * 5 * 6 * 12),
        ((lambda q, k: head_logits(q, k, 3, 8), plain_logits), logits_inputs, 3 * 2 * 2 * 5 * 5 * 12),
    ]
    for fns, inputs, expected in cases:
        counts = []
        for fn in fns:
            a, b = inputs()
            with FlopCounterMode(display=False) as fc:
                fn(a, b).sum().backward()
            counts.append(fc.get_total_flops())
        assert counts[0] == counts[1] == expected


@pytest.mark.parametrize("gated", [False, True])
def test_value_forms_agree_in_the_model(gated: bool) -> None:
    """RelPosAttention with its products by head (custom ops) and padded (batched bmm): outputs
    and every parameter's gradient agree (float64)."""
    torch.manual_seed(0)
    first = RelPosAttention(12, (4, 4), num_heads=3, qk_dim=4, v_dim=5, gated=gated).double()
    for t in first.parameters():
        torch.nn.init.normal_(t, std=0.5)
    if gated:  # both attentions mixed, so the content side has gradients to compare
        torch.nn.init.constant_(first.gate, 0.5)
    x = torch.randn(2, 16, 12, dtype=torch.float64)
    results = []
    for form in ("padded", "by_head"):
        attn = RelPosAttention(12, (4, 4), num_heads=3, qk_dim=4, v_dim=5, gated=gated, form=form).double()
        attn.load_state_dict(first.state_dict())
        out = attn(x)
        out.square().sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in attn.parameters()]))
    (a, ga), (b, gb) = results
    assert rel_err(a, b) < 1e-12
    # all gradients as one vector: some are zero up to rounding (k.bias, by softmax's shift invariance)
    assert rel_err(torch.cat([t.flatten() for t in ga]), torch.cat([t.flatten() for t in gb])) < 1e-12


def test_by_head_form_traces_whole() -> None:
    """torch.compile sees the custom ops whole, forward and backward: one graph (fullgraph) through
    AOTAutograd (backend aot_eager: the tracing inductor gets, without a C++ compiler), equal to the
    eager padded form to float32 rounding (1e-5: the traced graph may order sums differently)."""
    torch.manual_seed(0)
    first = RelPosAttention(12, (4, 4), num_heads=3, qk_dim=4, v_dim=5)
    for t in first.parameters():
        torch.nn.init.normal_(t, std=0.5)
    x = torch.randn(2, 16, 12)
    results = []
    for form, compiled in (("padded", False), ("by_head", True)):
        attn = RelPosAttention(12, (4, 4), num_heads=3, qk_dim=4, v_dim=5, form=form)
        attn.load_state_dict(first.state_dict())
        torch._dynamo.reset()
        fn = torch.compile(attn, backend="aot_eager", fullgraph=True) if compiled else attn
        attn.zero_grad()
        out = fn(x)
        out.square().sum().backward()
        results.append(torch.cat([out.detach().flatten()] + [t.grad.flatten() for t in attn.parameters()]))
    assert rel_err(results[1], results[0]) < 1e-5
