"""The ``per_loss`` section of ``python -m benchmarks``: one multi-task step (forward, backward of
several losses, SGD step) by each contender, at batch 64 on one thread:

    plain            the sum of the losses, one backward
    plain_<w>        the same, on gradmod_<w>'s own model instance (below)
    task_backwards   each loss's own backward (k passes): the task gradients an exact method
                     needs, formed the ordinary way and combined by nothing
    torchjd_<m>      torchjd 0.18: mtl_backward(losses, features) + jac_to_grad(trunk, <m>)
    gradmod_<m>      attach(model, {<m> on what +hooks=<m> selects}) and hooks.backward(losses)
    gradmod_modules  <m> = upgrad on the trunk's output (``modules: trunk``)
    gradmod_<w>      a loss weighting (famo, uw, dwa, geometric_mean, cosmos, imtll, pbi, stch: no
                     task gradients) as its shipped file has it, on every parameter; famo's
                     same-batch forward after the step, from which it learns, is left out

torchjd 0.18's newer methods (``PEERS``: config, fairgrad, krum, trimmed_mean, excess_mtl,
pcd, modo, sdmgrad, crmogm over upgrad) run as torchjd_<m> and gradmod_<m> with the arguments
of their shipped files (krum and trimmed_mean where there are three tasks or more); modo and
sdmgrad on the step's Gramian on both sides.

Each method's rule selects the parameters its shipped file does (``+hooks=<m>``: the trunk,
``*`` for the loss weightings).

A loss weighting adds a few host operations to one ordinary backward: a few percent of a
step at most, about what two instances of one model differ by here (where their parameters
lie in memory). Each is therefore timed against ``plain_<w>``: the plain step on its own
model, optimizer and batches, its hooks attached but bypassed (``sum(losses).backward()``),
next to it in every repeat (``benchmarks.timing.paired_ratio`` takes both orders alike).

Models: ``mlp5``, a 784-512-512 trunk with 5 classification heads (Linear 512-10); ``mlp10``,
the same trunk with 10 heads; ``trans5``, a 2-layer ``nn.TransformerEncoder`` (width 64, 4
attention heads, feed-forward 128, 16 tokens, mean-pooled) with 5 heads (Linear 64-10); and
``lenet``, a LeNet-like conv trunk (MultiMNIST's 36x36 input) with 2 heads (50-50-10).

Peak memory: each contender runs a few steps in a fresh process; the growth of its peak
resident set over the set-up is reported.

    python -m benchmarks.sections.per_loss --peak mlp5.gradmod_upgrad   # what the section runs per contender
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradmod
from benchmarks import peak_memory
from gradmod.hooks import attach
from gradmod.hooks.rules import shared as shared_params

# torchjd's batched backward loops over the tasks where torch has no batching rule (attention,
# on the transformer) and warns at every step; the timings say what it costs.
warnings.filterwarnings("ignore", message=".*we have not yet implemented the batching rule")

BATCH = 64
STEPS = 3  # optimizer steps per timed run
METHODS = (
    "pcgrad",
    "mgda",
    "cagrad",
    "imtl_g",
    "aligned_mtl",
    "upgrad",
    "dualproj",
    "gradvac",
    "nash_mtl",
    "mean",
    "sum",
    "random",
)
# torchjd 0.18's newer methods: gradmod's against torchjd's step (ratios without a target)
PEERS = ("config", "fairgrad", "krum", "trimmed_mean", "excess_mtl", "pcd", "modo", "sdmgrad", "crmogm")
MIN_TASKS = {"krum": 3, "trimmed_mean": 3}  # as their shipped files have them (n_byzantine 0, trim_number 1)
SCALARIZATIONS = (  # loss weightings torchjd has no aggregator for
    "famo",
    "uw",
    "dwa",
    "geometric_mean",
    "cosmos",
    "imtll",
    "pbi",
    "stch",
)
WEIGHTINGS = ("sum", "mean", "random", *SCALARIZATIONS)  # one ordinary backward: timed against plain_<w>
CONF = Path(gradmod.__file__).resolve().parent / "conf" / "hooks"  # the shipped hook configs


def shipped_rule(method: str) -> dict:
    """The rule ``+hooks=<method>`` adds (``mtl_sum`` is ``sum``'s file): its parameters, and
    its method with the file's arguments."""
    import yaml

    name = "mtl_sum" if method == "sum" else method
    rule = yaml.safe_load((CONF / f"{name}.yaml").read_text())[name]
    return {"params": rule["params"], "transforms": rule["transforms"]}


class MultiMLP(nn.Module):
    def __init__(self, tasks: int = 5):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(512, 10) for i in range(tasks)})

    def forward(self, x):
        z = self.trunk(x)
        return z, {n: h(z) for n, h in self.heads.items()}


class MultiTransformer(nn.Module):
    def __init__(self, tasks: int = 5):
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.trunk = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(64, 10) for i in range(tasks)})

    def forward(self, x):
        z = self.trunk(x).mean(1)
        return z, {n: h(z) for n, h in self.heads.items()}


class MultiLeNet(nn.Module):
    def __init__(self, tasks: int = 2):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(1, 10, 9),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(10, 20, 5),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(500, 50),
            nn.ReLU(),
        )
        self.heads = nn.ModuleDict(
            {f"t{i}": nn.Sequential(nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 10)) for i in range(tasks)}
        )

    def forward(self, x):
        z = self.trunk(x)
        return z, {n: h(z) for n, h in self.heads.items()}


MODELS = {
    "mlp5": (MultiMLP, (784,)),
    "mlp10": (lambda: MultiMLP(10), (784,)),
    "trans5": (MultiTransformer, (16, 64)),
    "lenet": (MultiLeNet, (1, 36, 36)),
}
TASKS = {"mlp5": 5, "mlp10": 10, "trans5": 5, "lenet": 2}


def has_torchjd() -> bool:
    try:
        import torchjd  # noqa: F401
    except ImportError:
        return False
    return True


def names() -> list[str]:
    """``model.contender`` for every contender that can run here."""
    out = []
    for m in MODELS:
        out += [f"{m}.plain", f"{m}.task_backwards"]
        for method in METHODS:
            if has_torchjd():
                out.append(f"{m}.torchjd_{method}")
            if method in WEIGHTINGS:  # next to each other: the rotation keeps them adjacent
                out.append(f"{m}.plain_{method}")
            out.append(f"{m}.gradmod_{method}")
        out.append(f"{m}.gradmod_modules")
        for method in PEERS:
            if TASKS[m] < MIN_TASKS.get(method, 2):
                continue
            if has_torchjd():
                out.append(f"{m}.torchjd_{method}")
            out.append(f"{m}.gradmod_{method}")
        out += [n for w in SCALARIZATIONS for n in (f"{m}.plain_{w}", f"{m}.gradmod_{w}")]
    return out


def _torchjd_aggregator(method: str, k: int):
    from torchjd import aggregation as A

    return {
        "pcgrad": A.PCGrad,
        "mgda": A.MGDA,
        "cagrad": lambda: A.CAGrad(c=0.5),
        "imtl_g": A.IMTLG,
        "aligned_mtl": A.AlignedMTL,
        "upgrad": A.UPGrad,
        "dualproj": A.DualProj,
        "gradvac": A.GradVac,
        "nash_mtl": lambda: A.NashMTL(n_tasks=k),
        "mean": A.Mean,
        "sum": A.Sum,
        "random": A.Random,
        "config": A.ConFIG,
        "fairgrad": lambda: A.FairGrad(alpha=1.0),
        "krum": lambda: A.Krum(n_byzantine=0),
        "trimmed_mean": lambda: A.TrimmedMean(trim_number=1),
        "excess_mtl": A.ExcessMTL,
        "pcd": A.PCD,
        "modo": lambda: A.GramianWeightedAggregator(A.MoDoWeighting()),  # the Gramian, as gradmod's
        "sdmgrad": lambda: A.GramianWeightedAggregator(A.SDMGradWeighting()),
        "crmogm": lambda: A.GramianWeightedAggregator(A.CRMOGMWeighting(A.UPGradWeighting())),
    }[method]()


_SHARED: dict[tuple, tuple] = {}  # (model, weighting, steps) -> the instance plain_<w> and gradmod_<w> share


def _instance(model_name: str, weighting: str | None, steps: int) -> tuple:
    """(model, its batches, its optimizer, the hooks of ``weighting`` on it, or None): one
    instance for both ``plain_<w>`` and ``gradmod_<w>``."""
    key = (model_name, weighting, steps)
    if weighting is not None and key in _SHARED:
        return _SHARED[key]
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(BATCH, *shape, generator=gen),
            {n: torch.randint(0, 10, (BATCH,), generator=gen) for n in model.heads},
        )
        for _ in range(steps)
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if weighting is None:
        return model, data, opt, None
    _find_shared(model, data[0])
    _SHARED[key] = (model, data, opt, attach(model, {"mtl": _rule(weighting)}))
    return _SHARED[key]


def _find_shared(model: nn.Module, batch: tuple) -> None:
    """What ``@shared`` (the shipped files' selection) stands for on ``model``: as the trainer
    does, from one forward of its tasks."""
    x, ys = batch
    _, out = model(x)
    shared_params.find(model, {n: F.cross_entropy(out[n], ys[n]) for n in out})


def _rule(method: str) -> dict:
    if method == "modules":
        return {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]}
    return shipped_rule(method)


def setup(name: str, steps: int = STEPS) -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    kind, _, method = contender.partition("_")
    paired = kind in ("plain", "gradmod") and method in WEIGHTINGS
    model, data, opt, hooks = _instance(model_name, method if paired else None, steps)
    k = len(model.heads)

    def losses(x, ys):
        z, out = model(x)
        return z, {n: F.cross_entropy(out[n], ys[n]) for n in out}

    if kind == "plain":  # plain_<w>: on gradmod_<w>'s instance, its hooks bypassed

        def step(x, ys):
            _, L = losses(x, ys)
            sum(L.values()).backward()
    elif contender == "task_backwards":
        params = list(model.parameters())

        def step(x, ys):
            _, L = losses(x, ys)
            for i, loss in enumerate(L.values()):
                torch.autograd.grad(loss, params, retain_graph=i < len(L) - 1, allow_unused=True)
    elif contender.startswith("torchjd_"):
        from torchjd.autojac import jac_to_grad, mtl_backward

        agg, trunk = _torchjd_aggregator(contender.removeprefix("torchjd_"), k), list(model.trunk.parameters())

        def step(x, ys):
            z, L = losses(x, ys)
            mtl_backward(list(L.values()), features=z)
            jac_to_grad(trunk, agg)
    else:
        if hooks is None:
            _find_shared(model, data[0])
        hooks = hooks or attach(model, {"mtl": _rule(method)})

        def step(x, ys):
            hooks.backward(losses(x, ys)[1])

    def run():
        for x, ys in data:
            opt.zero_grad(set_to_none=True)
            step(x, ys)
            opt.step()

    return run


MEMORY = ("upgrad", "mgda", "pcgrad", "mean")  # the methods whose peak memory the section measures


def peak_names() -> list[str]:
    """The contenders whose peak memory is measured (a fresh process each)."""
    keep = ("plain", "gradmod_modules", "gradmod_famo", *(f"{s}_{m}" for m in MEMORY for s in ("torchjd", "gradmod")))
    return [n for n in names() if n.split(".")[1] in keep]


def peak(name: str, steps: int = 3) -> int:
    """Bytes the peak resident set grows by over ``steps`` steps after the set-up."""
    return peak_memory.peak(setup(name, steps))


def peak_in_subprocess(name: str) -> int:
    """``peak(name)`` in a fresh process."""
    return peak_memory.in_subprocess("benchmarks.sections.per_loss", name)


if __name__ == "__main__":
    peak_memory.main(__doc__, peak)
