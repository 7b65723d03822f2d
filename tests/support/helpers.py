"""What the tests share: the repository's paths, the tiny runs' overrides, the real config
composed as train.py sees it, train.py run as a user would, and small reference objects."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch import nn

import gradmod
import gradmod.app.config_store  # noqa: F401  (registers the schemas the YAMLs build on)

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "gradmod" / "conf"

# A tiny, fast run on the bundled sample: the overrides most end-to-end tests start from.
FAST = ["data=mnist_sample", "trainer.epochs=1", "trainer.device=cpu", "trainer.progress=false"]
# Two epochs of 6 steps on 28x28 FakeData, on one thread.
TINY_FAKE = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=60",
    "data.test_size=20",
    "data.batch_size=10",
    "trainer.epochs=2",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.threads=1",
]
# A sweep job on tiny random 28x28 images (a job costs well under a second once Python is up);
# each sweep test adds its epochs, threads and model.
SWEEP_JOB = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=64",
    "data.test_size=32",
    "trainer.device=cpu",
    "trainer.progress=false",
]
# The resume tests' run: that, with a checkpoint every 4 steps.
RESUMABLE = [*TINY_FAKE, "trainer.checkpoint_every_steps=4", "+hooks=[clip,log]"]

KEEP = [*RESUMABLE, "trainer.checkpoint_keep=10"]  # checkpoints at steps 4, 6, 8 and 12


def compose_config(*overrides: str):
    """The real config with ``overrides``, as train.py would see it."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def run_train(
    tmp_path: Path, *overrides: str, multirun: bool = False, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python train.py`` in a subprocess with its outputs under ``tmp_path``."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    entry = "tests/support/kill_driver.py" if "GRADMOD_KILL_AT" in (env or {}) else "train.py"  # see kill_driver
    cmd = [
        sys.executable,
        str(ROOT / entry),
        *(["-m"] if multirun else []),
        f"{dir_key}={tmp_path}",
        f"data_dir={tmp_path / 'data'}",
        *overrides,
    ]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def same_params(a: dict, b: dict) -> None:
    """Two state dicts hold the same names and bit-identical tensors."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def tiny_mlp(*widths: int, act: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Sequential:
    """Linear layers of ``widths`` with ``act`` between them, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [act()] if i else []
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def free_port() -> int:
    """A free TCP port on this host, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_folders() -> tuple[str, str]:
    """The run and sweep folders gradmod/conf/config.yaml makes, as the docs write them
    (``outputs/YYYY-MM-DD/HH-MM-SS.ffffff``)."""
    import yaml

    hydra = yaml.safe_load((ROOT / "gradmod" / "conf" / "config.yaml").read_text())["hydra"]
    codes = {"%Y": "YYYY", "%m": "MM", "%d": "DD", "%H": "HH", "%M": "MM", "%S": "SS", "%f": "ffffff"}

    def shown(folder: str) -> str:
        folder = re.sub(r"\$\{now:([^}]*)\}", r"\1", folder)
        return re.sub(r"%[a-zA-Z]", lambda m: codes[m.group(0)], folder)

    return shown(hydra["run"]["dir"]), shown(hydra["sweep"]["dir"])


def per_loss_method(name: str | dict) -> bool:
    """Whether this build has the per_loss stage's method ``name`` (pcgrad, mgda, ..., or a
    rule's entry with its arguments: ``{name: krum, n_byzantine: 0}``)."""
    try:
        from gradmod.hooks.per_loss.methods.bases import is_method
    except ImportError:  # a build without the per_loss stage
        return False
    return is_method(name if isinstance(name, str) else name.get("name"))


def _rank_then_exit(rank: int, fn, args: tuple) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done: skip the interpreter's teardown (see spawn_ranks)


def spawn_ranks(fn, *args, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes (``torch.multiprocessing.spawn``). The ranks
    hand their results over in files, so a rank whose ``fn`` returned has nothing left to do
    and ends at once (``os._exit(0)``): the interpreter's teardown, where torch's gloo threads
    can abort a finished process ("terminate called without an active exception"), is
    skipped. A rank that raises ends as spawn reports it, with its traceback."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_then_exit, args=(fn, args), nprocs=nprocs, join=True)


class SharedTrunk(nn.Module):
    """A tanh trunk shared by ``k`` linear heads ``t0``, ``t1``, ...: a task's output each."""

    def __init__(self, k: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(8, 3) for i in range(k)})

    def forward(self, x):
        z = self.trunk(x)
        return {n: h(z) for n, h in self.heads.items()}


def trunk_losses(model, seed: int = 0, nan: str | None = None) -> dict[str, torch.Tensor]:
    """Each head's cross-entropy on a seeded float64 batch of 5; ``nan``: that task's loss made nan."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    losses = {n: F.cross_entropy(o, torch.randint(0, 3, (5,), generator=g)) for n, o in model(x).items()}
    if nan is not None:
        losses[nan] = losses[nan] * float("nan")
    return losses


def nan_task_spares_the_state(rules: dict, label: object) -> None:
    """A step whose task ``t1`` has a nan loss: a nan update on the trunk, no solver error, and
    the per_loss methods' state as the step before left it."""
    model = SharedTrunk().double()
    hooks = gradmod.attach(model, rules)
    hooks.backward(trunk_losses(model, 0))
    state = copy.deepcopy(hooks.state_dict())
    model.zero_grad()
    hooks.backward(trunk_losses(model, 1, nan="t1"))  # no solver error, no traceback
    assert torch.isnan(model.trunk[0].weight.grad).all()
    after = hooks.state_dict()["per_loss"]["methods"]
    for key, value in state["per_loss"]["methods"].items():
        assert repr(after[key]) == repr(value), f"{label}: the nan step changed the method's state"


def hessian_top(model: nn.Module, loss, names: list[str], k: int) -> list[float]:
    """The ``k`` largest eigenvalues of the Hessian of ``loss(model_output_fn)`` over ``names``
    (flattened in that order) at the model's weights, by ``torch.linalg.eigvalsh(torch.func.hessian)``:
    ``loss(call)`` gets ``call(*args, **kwargs)``, the model run at the moved weights."""
    from torch.func import functional_call, hessian

    params = {n: p.detach() for n, p in model.named_parameters()}
    sizes = [params[n].numel() for n in names]

    def of(flat):
        moved = dict(params) | {n: v.view_as(params[n]) for n, v in zip(names, flat.split(sizes))}
        return loss(lambda *args, **kwargs: functional_call(model, moved, args, kwargs))

    h = hessian(of)(torch.cat([params[n].reshape(-1) for n in names]))
    return torch.linalg.eigvalsh(h.double()).flip(0)[:k].tolist()


def checkpoint_folder(folder: Path, config: dict, rates: tuple[float, ...]) -> list:
    """A run folder (run id ``r1``) with one checkpoint of the MNIST CNN per learning rate in
    ``rates``, its weights moved a little each time, each holding ``config``."""
    import json

    from gradmod.models import MnistCNN
    from gradmod.run.folder import checkpoint_file as ckpt

    (folder / ".gradmod").mkdir(parents=True)
    (folder / ".gradmod" / "run.json").write_text(json.dumps({"run_id": "r1"}) + "\n")
    torch.manual_seed(0)
    model = MnistCNN()
    paths = []
    for step, lr in enumerate(rates, start=1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        state = {
            "step": step,
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "trainer": {"optimizer": {"param_groups": [{"lr": lr}]}},
            "config": config,
        }
        paths.append(ckpt.save(folder / "checkpoints", state, keep=10, run="r1"))
    return paths


def hf_args(folder, batch: int, **overrides) -> dict:
    """Hugging Face ``TrainingArguments`` keywords for a tiny run on the CPU: SGD at a constant rate
    0.5, no clipping, a log every 2 steps, nothing saved or reported (``overrides`` change any)."""
    args = dict(
        output_dir=str(folder),
        per_device_train_batch_size=batch,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
    )
    return {**args, **overrides}


def lightning_args(root=None, **overrides) -> dict:
    """Lightning ``Trainer`` keywords for a quiet run on one CPU: no logger, checkpoint, progress bar
    or model summary, files under ``root`` (``overrides`` change any)."""
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    return {**args, **overrides}
