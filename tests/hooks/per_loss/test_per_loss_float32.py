"""The Gramian methods that decide a rank (ConFIG, IMTL-G, Aligned-MTL, PCD) on float32 task
gradients some of which depend on the others: against torchjd in float32 on the matrices its
aggregation tests use, and through the stage against the same model in float64 (Linears
answered directly and from their rows, a parameter of a million entries, bf16 autocast)."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tja  # the reference implementation (a test dependency, torchjd[full])
from peer_matrices import named
from torch import nn

import gradmod
from gradmod.hooks.per_loss.entries import gram
from gradmod.hooks.per_loss.methods import bases as M
from gradmod.hooks.per_loss.methods.rounding import formed_in

RANKED = [
    ("config", {}, tja.ConFIG),
    ("imtl_g", {}, tja.IMTLG),
    ("aligned_mtl", {}, tja.AlignedMTL),
    ("aligned_mtl", {"scale_mode": "median"}, lambda: tja.AlignedMTL(scale_mode="median")),
    ("aligned_mtl", {"scale_mode": "rmse"}, lambda: tja.AlignedMTL(scale_mode="rmse")),
    ("pcd", {}, tja.PCD),
]
TOL = 1e-6  # of the gradients' scale: float32's rounding, a few times over


def _ours(name: str, args: dict, J: torch.Tensor) -> torch.Tensor:
    """The update from the Gramian of float32 rows as the stage forms it, told their dtype."""
    method = M.build(name, args)
    method.set_tasks([f"t{i}" for i in range(len(J))])
    with formed_in(J.dtype):
        return method.weights(gram(J).cpu(), torch.Generator()) @ J.double()


@pytest.mark.parametrize("name, args, ref", RANKED, ids=lambda v: str(v) if isinstance(v, (str, dict)) else "")
def test_ranked_methods_equal_torchjd_float32_on_its_test_matrices(name, args, ref):
    """Each matrix in float32: the update equals torchjd's float32 one to ``TOL`` of the
    gradients' scale, and torchjd's float64 one on the matrix before rounding (its exact
    rank). Where torchjd's float32 update is itself further than ``TOL`` from that (it
    normalises rounding where the update is 0, or inverts a Gramian of float32 rounding),
    the float64 one decides."""
    own_misses = 0
    for label, J64 in named(2):
        J = J64.float()
        got, ref32, ref64 = _ours(name, args, J), ref()(J).double(), ref()(J64)
        scale = max(float(J.abs().max()) * len(J), float(ref64.abs().max()), 1e-30)
        assert float((got - ref64).abs().max()) <= TOL * scale, f"{label}: against float64"
        if float((ref32 - ref64).abs().max()) > TOL * scale:
            own_misses += 1
            continue
        assert float((got - ref32).abs().max()) <= TOL * scale, f"{label}: against torchjd's float32"
    assert own_misses <= 10, own_misses  # the rest (42 of 52 at least) against torchjd's float32


def _dependent(y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two losses and their sum: three task gradients of rank 2."""
    y = y.float() if y.dtype == torch.bfloat16 else y
    a = ((y - 1.0) ** 2).mean()
    b = y.sin().mean() + (y[:, 0] * y[:, 1]).mean()
    return {"a": a, "b": b, "a_plus_b": a + b}


class Elementwise(nn.Module):
    """One parameter of ``n`` entries, used elementwise: its task gradients come whole."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n) / n**0.5)

    def forward(self, x):
        return (x * self.w).view(len(x), 4, -1).sum(-1)


MODELS = {
    "linear 8-4": (lambda: nn.Linear(8, 4), (16, 8)),  # its weight gradients formed directly
    "linear 256-256 on rows": (lambda: nn.Linear(256, 256), (64, 256)),  # from its 64 rows
    "a million entries": (lambda: Elementwise(2**20), (4, 2**20)),  # one Gramian sum of 2^20 products
}


def _grads(make, shape, name: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    model = make().to(dtype)
    x = torch.randn(*shape).to(dtype)
    hooks = gradmod.attach(model, {"mtl": {"params": "*", "transforms": [name]}})
    hooks.backward(_dependent(model(x)))
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("name", ["config", "imtl_g", "aligned_mtl", "pcd"])
def test_dependent_tasks_in_float32_equal_float64_through_the_stage(name, model):
    """The stage's update in float32 equals the same model's in float64 to float32's rounding
    times the Gramian's conditioning (torchjd's own float32 misses these by up to 6e-5)."""
    make, shape = MODELS[model]
    for seed in range(2):
        f32, f64 = (_grads(make, shape, name, dt, seed) for dt in (torch.float32, torch.float64))
        assert float((f32 - f64).norm() / f64.norm()) < 1e-5, seed


@pytest.mark.parametrize("name", ["imtl_g", "aligned_mtl"])
def test_a_task_of_a_ten_thousandth_of_the_others_norm_is_not_rounding(name):
    """The rank is decided on the unit Gramian: a small but independent task gradient keeps
    its direction in float32 (its eigenvalue, 1e-8 of the largest, is below float32's
    tolerance on the Gramian itself)."""

    def grads(dtype):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(dtype)
        hooks = gradmod.attach(model, {"mtl": {"params": "*", "transforms": [name]}})
        y = model(torch.randn(16, 8).to(dtype))
        hooks.backward({"small": 1e-4 * ((y - 1.0) ** 2).mean(), "large": y.sin().mean()})
        return torch.cat([p.grad.flatten().double() for p in model.parameters()])

    f32, f64 = grads(torch.float32), grads(torch.float64)
    assert float((f32 - f64).norm() / f64.norm()) < 1e-5


def _conv_grads(name: str, amp: bool, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4))
    hooks = gradmod.attach(model, {"mtl": {"params": "0.*", "transforms": [name]}})
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = model(torch.randn(8, 3, 8, 8))
    hooks.backward(_dependent(y))
    return torch.cat([p.grad.flatten().double() for p in model[0].parameters()])


@pytest.mark.parametrize("name", ["config", "imtl_g", "aligned_mtl"])
def test_dependent_tasks_under_bf16_autocast_stay_near_float32(name):
    """A convolution's task gradients are float32 under autocast, with bf16's rounding: the
    Gramian is taken to carry bf16's (float64's tolerance inverted it: 2e4 times too large)."""
    for seed in range(2):
        amp, full = _conv_grads(name, True, seed), _conv_grads(name, False, seed)
        assert float((amp - full).norm() / full.norm()) < 0.1, seed  # bf16 keeps 2 to 3 digits
