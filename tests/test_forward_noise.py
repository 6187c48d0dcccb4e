"""The forward-noise twin's re-roundings (convergence/trainer/forward_noise.py) in bf16: the
row-wise linears' outputs and the column-wise linears' input gradients summed as TP2's two
ranks sum them, bit for bit (TP4's four, in this process's order); every output element and
weight gradient computed whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convergence.trainer.config import load_train_config
from convergence.trainer.forward_noise import (
    RE_ROUNDED,
    RE_ROUNDED_BACKWARD,
    UNIT_ROUNDOFF,
    add_tp_rounding,
)
from convergence.trainer.model import ModelArgs, build_model

DEBUG = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"
U = UNIT_ROUNDOFF["bfloat16"]


class Block(torch.nn.Module):
    """A column-wise (wq) and a row-wise (wo) linear, as the model names them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wq = torch.nn.Linear(64, 192, bias=False).to(torch.bfloat16)
        self.wo = torch.nn.Linear(192, 64, bias=False).to(torch.bfloat16)


def backward_through_wq(
    block: Block,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, output gradient, input gradient, weight gradient) of one call of ``wq``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    y = block.wq(x)
    g = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(g)
    assert x.grad is not None and block.wq.weight.grad is not None
    return x, g, x.grad, block.wq.weight.grad


def test_the_twin_sums_a_column_wise_linears_input_gradient_as_tp2_does() -> None:
    control, twin = Block(), Block()
    assert add_tp_rounding([twin]) == 2
    x, g, plain_dx, plain_dw = backward_through_wq(control)
    _, _, twin_dx, twin_dw = backward_through_wq(twin)
    w = twin.wq.weight.detach()
    # Two ranks' partial products over the halves of the output dim, each rounded to bf16, then
    # their sum rounded: bitwise what the twin computes.
    assert torch.equal(twin_dx, g[..., :96] @ w[:96] + g[..., 96:] @ w[96:])
    # A rounding-level change of a good share of the elements, no more.
    moved = twin_dx != plain_dx
    assert 0.05 < moved.float().mean().item() < 0.9
    rel = (twin_dx.float() - plain_dx.float()).norm() / plain_dx.float().norm()
    assert 0 < rel.item() < 4 * U
    # The forward and the weight gradient are the control's, bit for bit.
    assert torch.equal(twin.wq(x.detach()), control.wq(x.detach()))
    assert torch.equal(twin_dw, plain_dw)


def test_the_twin_sums_a_row_wise_linears_output_as_tp2_does() -> None:
    control, twin = Block(), Block()
    add_tp_rounding([twin])
    h = torch.randn(2, 32, 192, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w = twin.wo.weight.detach()
    plain, split = control.wo(h), twin.wo(h)
    # Two ranks' partial outputs over the halves of the input dim, each rounded to bf16, then
    # their sum rounded: bitwise what the twin computes; a rounding-level change of the output.
    assert torch.equal(split, h[..., :96] @ w[:, :96].T + h[..., 96:] @ w[:, 96:].T)
    assert 0.05 < (split != plain).float().mean().item() < 0.9
    rel = (split.float() - plain.float()).norm() / plain.float().norm()
    assert 0 < rel.item() < 4 * U


class Attention(torch.nn.Module):
    """Three column-wise linears reading one input, as attention's wq/wk/wv do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wq = torch.nn.Linear(64, 128, bias=False).to(torch.bfloat16)
        self.wk = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
        self.wv = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)


def test_the_consumers_of_one_input_sum_each_ranks_share_first_as_tp2s_one_all_reduce() -> None:
    twin = Attention()
    add_tp_rounding([twin])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    outs = [twin.wq(x), twin.wk(x), twin.wv(x)]
    grads = [torch.randn(o.shape, generator=gen).to(torch.bfloat16) for o in outs]
    torch.autograd.backward(outs, grads)
    assert x.grad is not None
    ws = [twin.wq.weight.detach(), twin.wk.weight.detach(), twin.wv.weight.detach()]
    # Each rank: the partial input gradients of its halves of wq, wk, wv, summed in bf16 (in
    # autograd's order: the last consumers first); then the two ranks' sums added, once.
    ranks = []
    for first in (True, False):
        q, k, v = (
            g[..., : w.shape[0] // 2] @ w[: w.shape[0] // 2]
            if first
            else g[..., w.shape[0] // 2 :] @ w[w.shape[0] // 2 :]
            for g, w in zip(grads, ws, strict=True)
        )
        ranks.append((v + k) + q)
    assert torch.equal(x.grad, ranks[0] + ranks[1])
    # Not what each linear split on its own gives (the association is TP2's one all-reduce).
    alone = sum(
        (
            g[..., : w.shape[0] // 2] @ w[: w.shape[0] // 2]
            + g[..., w.shape[0] // 2 :] @ w[w.shape[0] // 2 :]
            for g, w in zip(reversed(grads), reversed(ws), strict=True)
        ),
        torch.zeros_like(x.grad),
    )
    assert not torch.equal(x.grad, alone)
    # Each linear's forward is the control's, bit for bit (each output element computed whole).
    plain = Attention()
    assert torch.equal(twin.wq(x.detach()), plain.wq(x.detach()))


def test_the_real_models_re_rounded_linears_are_the_named_ones() -> None:
    cfg = load_train_config(DEBUG, [])
    model = build_model(ModelArgs.from_config(cfg.model, seq_len=32), "cpu")
    count = add_tp_rounding([model])
    layers = cfg.model.n_layers
    # wo, w2 per block; wq, wk, wv, w1, w3 per block and the vocab-sharded output projection
    assert count == layers * len(RE_ROUNDED) + layers * (len(RE_ROUNDED_BACKWARD) - 1) + 1
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_tp4_twin_adds_four_rounded_quarters() -> None:
    control, twin2, twin4 = Block(), Block(), Block()
    add_tp_rounding([twin2])
    assert add_tp_rounding([twin4], parts=4) == 2
    h = torch.randn(2, 32, 192, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w = twin4.wo.weight.detach()
    q = [h[..., i : i + 48] @ w[:, i : i + 48].T for i in range(0, 192, 48)]
    assert torch.equal(twin4.wo(h), ((q[0] + q[1]) + q[2]) + q[3])
    # A larger rounding than TP2's halves (more partial sums rounded), of the same order.
    plain = control.wo(h).float()
    gap2 = (twin2.wo(h).float() - plain).norm().item()
    gap4 = (twin4.wo(h).float() - plain).norm().item()
    assert gap2 < gap4 < 4 * gap2
    x, g, plain_dx, plain_dw = backward_through_wq(control)
    _, _, twin_dx, twin_dw = backward_through_wq(twin4)
    wq = twin4.wq.weight.detach()
    parts = [g[..., i : i + 48] @ wq[i : i + 48] for i in range(0, 192, 48)]
    # The four ranks' partial input gradients, each rounded; their sum differs from the plain
    # one by rounding only, and the weight gradient is computed whole.
    exact = sum((p.float() for p in parts), torch.zeros_like(plain_dx, dtype=torch.float32))
    rel = (twin_dx.float() - exact).norm() / exact.norm()
    assert 0 < rel.item() < 4 * U and not torch.equal(twin_dx, plain_dx)
    assert torch.equal(twin_dw, plain_dw)
    with pytest.raises(ValueError, match="at least 2 parts"):
        add_tp_rounding([Block()], parts=1)
