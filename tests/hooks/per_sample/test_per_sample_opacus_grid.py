"""Opacus' per-layer test configurations (tests/support/opacus_grid.py), each under mean and sum
losses, in float64: the per_sample stage's clipped mean (flat clipping at the median
per-example norm) against per-example gradients from ``torch.func`` (vmap of grad), to
1e-10 relative; packed sequences against each sequence packed alone (Opacus' own RNN layers
are refused then, in one line); a batch of zero examples gives zero gradients. The default suite walks one configuration per family (and the edge cases), the slow one thirty."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from gradmod.hooks.hookset import attach

opacus = pytest.importorskip("opacus", reason="the grid builds Opacus' own layers (opacus.layers)")
from opacus_grid import grid  # noqa: E402

RTOL = 1e-10
# Families refused in one line (their examples are not split along a dimension), with the words.
REFUSED = {"embedding_bag": "has no module whose forward covers every use"}


def _double(x):
    if isinstance(x, PackedSequence):
        return x.double()
    return x.double() if x.is_floating_point() else x


def _rule(max_norm: float) -> dict:
    return {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}}


def per_example(module: nn.Module, inputs: tuple, weights: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
    """Each example's gradient of ``sum(output_i * weights_i)``: vmap of grad; one example at a
    time for torch's fused RNNs (vmap cannot batch them)."""
    params = {n: p.detach() for n, p in module.named_parameters()}
    if any(isinstance(m, nn.RNNBase) for m in module.modules()):

        def one(i):
            xs = tuple(x.narrow(dim, i, 1) for x in inputs)
            return grad(lambda p: (functional_call(module, p, xs) * weights.narrow(dim, i, 1)).sum())(params)

        rows = [one(i) for i in range(weights.shape[dim])]
        return {n: torch.stack([r[n] for r in rows]) for n in params}

    def loss(p, *xs_and_w):
        *xs, w = xs_and_w
        out = functional_call(module, p, tuple(x.unsqueeze(dim) for x in xs))
        return (out * w.unsqueeze(dim)).sum()

    return vmap(grad(loss), in_dims=(None, *[dim] * (len(inputs) + 1)))(params, *inputs, weights)


def per_sequence(module: nn.Module, x: PackedSequence, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sequence's gradient of ``sum(output.data * weights)``, the sequence packed alone."""
    names, params = zip(*module.named_parameters())
    padded, lengths = pad_packed_sequence(x, batch_first=True)
    w = pad_packed_sequence(x._replace(data=weights), batch_first=True)[0]
    rows = []
    for i, n in enumerate(lengths.tolist()):
        one = pack_padded_sequence(padded[i : i + 1, :n], [n], batch_first=True)
        rows.append(torch.autograd.grad((module(one) * w[i, :n]).sum(), params))
    return {name: torch.stack([r[j] for r in rows]) for j, name in enumerate(names)}


def run(family: str, build, reduction: str, seed: int) -> None:
    torch.manual_seed(seed)
    module, inputs, dim, packed = build()
    module, inputs = module.double(), tuple(_double(x) for x in inputs)
    if packed and not isinstance(module.rnn, nn.RNNBase):  # Opacus' layers: Linears on each step's rows
        hooks = attach(module, _rule(1.0), loss_reduction=reduction, batch_dim=dim)
        with pytest.raises(ValueError, match="PackedSequence") as err:
            module(*inputs).sum().backward()
        assert "\n" not in str(err.value)
        hooks.remove()
        return
    with torch.no_grad():
        out = module(*inputs)
    weights = torch.randn_like(out)
    n = int(inputs[0].batch_sizes[0]) if packed else out.shape[dim]
    if n == 0:  # an empty batch: zero gradients, not an error
        hooks = attach(module, _rule(1.0), loss_reduction=reduction, batch_dim=dim)
        (module(*inputs) * weights).sum().backward()
        hooks.after_backward()
        assert all(p.grad is not None and not p.grad.any() for p in module.parameters())
        hooks.remove()
        return
    if family in REFUSED:
        hooks = attach(module, _rule(1.0), loss_reduction=reduction, batch_dim=dim)
        with pytest.raises(ValueError, match=REFUSED[family]) as err:
            module(*inputs)
        assert "\n" not in str(err.value)
        hooks.remove()
        return
    per = per_sequence(module, inputs[0], weights) if packed else per_example(module, inputs, weights, dim)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per.values()]).sum(0).sqrt()
    max_norm = float(norms.median()) if float(norms.median()) > 0 else 1.0
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    want = {k: torch.tensordot(coef, g, 1) / n for k, g in per.items()}
    hooks = attach(module, _rule(max_norm), loss_reduction=reduction, batch_dim=dim)
    loss = (module(*inputs) * weights).sum()
    (loss / n if reduction == "mean" else loss).backward()
    hooks.after_backward()
    scale = max(float(w.norm()) for w in want.values())
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        err = float((p.grad - want[name]).norm())
        assert err <= RTOL * max(float(want[name].norm()), 1e-3 * scale) + 1e-300, f"{name}: error {err:.2e}"
    hooks.remove()


def _params(per_family: int):
    return [
        pytest.param(family, build, id=f"{family}-{i}-{label}")
        for i, (family, label, build) in enumerate(grid(per_family))
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family, build", _params(1))
def test_opacus_layer_configurations(family, build):
    run(family, build, "sum" if len(family) % 2 else "mean", seed=0)  # both reductions across families


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family, build", _params(30))
def test_opacus_layer_configurations_full_walk(family, build):
    for reduction in ("mean", "sum"):
        run(family, build, reduction, seed=1)


def _edge_cases():
    """From the full walk: packed inputs to torch's and Opacus' RNNs and the first empty batches."""
    walk = grid(30)
    packed = [c for c in walk if "packed" in c[1] and c[1].split()[0] in ("LSTM", "GRU", "RNN")][:4]
    packed += [c for c in walk if "packed" in c[1] and c[1].startswith("DP")][:1]
    empty = [c for c in walk if c[1].startswith("N0 ")][:2]
    return [pytest.param(f, b, id=f"{f}-{label}") for f, label, b in packed + empty]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family, build", _edge_cases())
def test_packed_sequences_and_empty_batches(family, build):
    run(family, build, "mean", seed=0)
