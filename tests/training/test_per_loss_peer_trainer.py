"""The Trainer with three named losses on a transformer trunk, each of torchjd 0.18's newer
methods as a per_loss rule: four full-batch SGD steps equal torchjd's (``backward`` +
``jac_to_grad`` with its aggregator on the trunk, the heads the sum's gradient; or its
scalarizer's ``backward`` for a loss weighting), in float64. Three cases by default, the rest slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchjd.aggregation as tja  # the reference implementation (a test dependency, torchjd[full])
import torchjd.scalarization as tjs
from torch import nn
from torchjd.autojac import backward as tj_backward
from torchjd.autojac import jac_to_grad

from gradmod.hooks import attach
from gradmod.labels import Labels
from gradmod.training.trainer import Trainer, TrainerSettings

N, T, V, D, K = 12, 5, 11, 8, 3
LR, STEPS = 0.2, 4
W = [0.2, 0.5, 0.3]


def _f64(values):
    return torch.tensor(values, dtype=torch.float64)


class Tokens(nn.Module):
    """An embedding, one TransformerEncoder layer, mean pooling: the trunk; three heads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = Trunk()
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(D, 3) for i in range(K)})

    def forward(self, x):
        z = self.trunk(x)
        return {n: h(z) for n, h in self.heads.items()}


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(self.emb(x)).mean(1)


def data() -> tuple[torch.Tensor, Labels]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (N, T), generator=g)
    return x, Labels({f"t{i}": torch.randint(0, 3, (N,), generator=g) for i in range(K)})


# spec, torchjd's aggregator (None: a scalarization, below), its scalarizer
CASES = {
    "pcd": ({"name": "pcd", "tau": 0.1}, lambda: tja.PCD(tau=0.1), None),
    "excess_mtl": ({"name": "excess_mtl"}, tja.ExcessMTL, None),
    "config": ({"name": "config"}, tja.ConFIG, None),
    "fairgrad": ({"name": "fairgrad", "alpha": 1.0}, lambda: tja.FairGrad(1.0), None),
    "krum": ({"name": "krum", "n_byzantine": 0}, lambda: tja.Krum(0), None),
    "trimmed_mean": ({"name": "trimmed_mean", "trim_number": 1}, lambda: tja.TrimmedMean(1), None),
    "modo": ({"name": "modo"}, None, None),
    "sdmgrad": ({"name": "sdmgrad"}, None, None),
    "crmogm": (
        {"name": "crmogm", "weighting": "upgrad", "alpha": 0.5},
        lambda: tja.GramianWeightedAggregator(tja.CRMOGMWeighting(tja.UPGradWeighting(), alpha=0.5)),
        None,
    ),
    "cosmos": ({"name": "cosmos", "lambda_": 0.5, "weights": W}, None, lambda: tjs.COSMOS(0.5, _f64(W))),
    "imtll": ({"name": "imtll", "lr": 0.01}, None, lambda: tjs.IMTLL(K).double()),
    "pbi": ({"name": "pbi", "theta": 5.0, "weights": W}, None, lambda: tjs.PBI(5.0, _f64(W))),
    "stch": ({"name": "stch", "mu": 0.1}, None, lambda: tjs.STCH(0.1)),
}
MATRIX = {"modo": tja.MoDoWeighting, "sdmgrad": tja.SDMGradWeighting}  # torchjd's weighting given J J^T
DEFAULT = {"pcd", "excess_mtl", "cosmos"}  # a Gramian method, a matrix weighting, a loss weighting
SOLVER = {"fairgrad": 1e-6}  # scipy's least squares: its finite-difference Jacobian sees the last bits


def trained(spec: dict, scalarization: bool) -> Tokens:
    model = Tokens().double()
    params = "*" if scalarization else "trunk.*"
    hooks = attach(model, {"mtl": {"params": params, "transforms": [spec]}})
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        TrainerSettings(batch_size=N, log_every=2**62),
        hooks=hooks,
        generator=torch.Generator().manual_seed(5),
    )
    x, y = data()
    for _ in range(STEPS):
        trainer.train_epoch(x, y)
    return model


def reference(name: str) -> Tokens:
    _, make, scalarizer = CASES[name]
    model = Tokens().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    agg = make() if make is not None else None
    weighting = MATRIX[name]() if name in MATRIX else None
    s = scalarizer() if scalarizer is not None else None
    opt_s = torch.optim.Adam(s.parameters(), lr=0.01) if s is not None and list(s.parameters()) else None
    x, y = data()
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(x)
        losses = [F.cross_entropy(out[f"t{i}"], y[f"t{i}"]) for i in range(K)]
        if s is not None:
            s(torch.stack(losses)).backward()
        else:
            heads, trunk = list(model.heads.parameters()), list(model.trunk.parameters())
            for p, g in zip(heads, torch.autograd.grad(sum(losses), heads, retain_graph=True)):
                p.grad = g
            tj_backward(losses, inputs=trunk)
            if weighting is not None:  # the weights from J J^T, the update J^T w
                J = torch.cat([p.jac.flatten(1) for p in trunk], 1)
                w = weighting(J @ J.T)
                for p in trunk:
                    p.grad = torch.tensordot(w, p.jac, 1)
                    del p.jac
            else:
                jac_to_grad(trunk, agg)
        opt.step()
        if opt_s is not None:
            opt_s.step()
            opt_s.zero_grad()
    return model


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_trainer_steps_on_a_transformer_trunk_equal_torchjd(name):
    spec, _, scalarizer = CASES[name]
    ours, theirs = trained(spec, scalarizer is not None), reference(name)
    start = Tokens().double()
    tol = SOLVER.get(name, 1e-9)
    for (n, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start.parameters()):
        assert not torch.equal(p, p0) or n.startswith("trunk.emb"), f"{n} did not move"
        torch.testing.assert_close(p, q, rtol=tol, atol=tol / 10, msg=n)
