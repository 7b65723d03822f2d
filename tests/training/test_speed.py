"""channels_last, torch.compile (hooks still fire), the DataLoader path, the sync check."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import gradmod
from gradmod.app.cli import run
from gradmod.data import Data, load_mnist_sample
from gradmod.hooks import attach
from gradmod.models import MnistCNN
from gradmod.run import assembly as train_mod
from gradmod.run import factories as targets_mod
from gradmod.testing.epochs import bare_epoch
from gradmod.training.loader import batches, placement
from gradmod.training.speed import compile_model, forbid_syncs, to_channels_last

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA,
    reason="needs a CUDA GPU: torch.cuda.set_sync_debug_mode only watches CUDA syncs, and this machine has none",
)

RULES = {
    "clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.004, "max": 0.004}]},
    "log": {"params": "*", "transforms": ["log"]},
    "tap": {"modules": "conv2", "transforms": [{"name": "scale", "factor": 0.5}]},
}


def _small_data(n_train=64, n_test=32) -> Data:
    x, y, tx, ty = load_mnist_sample(0, 1000)
    return Data("mnist_sample", x[:n_train], y[:n_train], tx[:n_test], ty[:n_test])


def _step_grads(model, hooks, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()


def _compare_compiled(backend: str):
    torch.manual_seed(0)
    eager = MnistCNN()
    plain = copy.deepcopy(eager)
    other = copy.deepcopy(eager)
    h_eager, h_other = attach(eager, RULES), attach(other, RULES)
    compiled = compile_model(other, backend=backend)
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))
    for model, _hooks in ((plain, None), (eager, h_eager), (compiled, h_other)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
    for (n, p), q, r in zip(eager.named_parameters(), other.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
        assert not torch.allclose(p.grad, r.grad), f"{n}: the hooks changed nothing, the test proves nothing"
    calls = [s["calls"] for s in h_other.read_stats().values()]
    assert calls == [1] * 6, "every parameter's log hook fired once under compile"
    assert h_eager.read_stats().keys() == {n for n, _ in eager.named_parameters()}


def test_compiled_model_with_hooks_gives_eager_gradients():
    """Dynamo + AOTAutograd decide where hooks run; the aot_eager backend is that path
    without inductor's code generation (minutes of C++ compiling on 2 cores)."""
    _compare_compiled("aot_eager")


@pytest.mark.slow
def test_inductor_compiled_model_with_hooks_gives_eager_gradients():
    _compare_compiled("inductor")


def test_trainer_compile_trains_the_compiled_model_with_hooks(compose_cfg, tmp_path, monkeypatch, caplog):
    compiled = []

    def fake_compile(model):  # the trainer's call, with the fast backend
        compiled.append(model)
        return compile_model(model, backend="aot_eager")

    monkeypatch.setattr(train_mod, "compile_model", fake_compile)
    monkeypatch.setattr(targets_mod, "load_data", lambda *a, **k: _small_data())
    cfg = compose_cfg(
        "data=mnist_sample",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.compile=true",
        "trainer.log_every=1000",
        "+hooks=[clip,log]",
        "data.batch_size=16",
    )
    with caplog.at_level("INFO", logger="gradmod.training.callbacks"):
        summary = run(cfg, tmp_path)
    assert len(compiled) == 1
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile")]
    assert [t.split(":")[0] for t in told] == ["torch.compile (trainer.compile=true)", *["torch.compile"] * 2], told
    stats = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["grad_stats"]
    assert stats["conv1.weight"]["calls"] == 4 and stats["conv1.weight"]["max"] <= 0.01
    assert set(torch.load(tmp_path / "model.pt")) == {n for n, _ in MnistCNN().named_parameters()}
    assert summary["steps"] == 4


def test_channels_last_keeps_hooks_and_gradients():
    torch.manual_seed(0)
    model = MnistCNN()
    cl = copy.deepcopy(model)
    h1, h2 = attach(model, RULES), attach(cl, RULES)
    to_channels_last(cl)  # after attach: parameters stay the same objects
    assert cl.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert not cl.conv2.weight.is_contiguous()
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))
    _step_grads(model, h1, x, y)
    _step_grads(cl, h2, x, y)
    for (n, p), q in zip(model.named_parameters(), cl.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), n
    assert [s["calls"] for s in h2.read_stats().values()] == [1] * 6


def test_bad_values_are_one_line_errors(compose_cfg, tmp_path):
    for override, key in (
        ("trainer.loader_workers=-1", "trainer.loader_workers"),
        ("trainer.data_placement=gpu", "trainer.data_placement"),
    ):
        cfg = compose_cfg("data=mnist_sample", "trainer.device=cpu", override)
        with pytest.raises(ValueError, match=key):
            run(cfg, tmp_path)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_path_gives_the_device_paths_batches(workers):
    data = _small_data(50, 10)
    a = list(batches(data.train_x, data.train_y, 16, torch.Generator().manual_seed(7)))
    b = list(
        batches(
            data.train_x,
            data.train_y,
            16,
            torch.Generator().manual_seed(7),
            device=torch.device("cpu"),
            loader_workers=workers,
        )
    )
    assert [len(yb) for _, yb in b] == [16, 16, 16, 2]
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xb.dtype == torch.float32 and xb.max() <= 1


def test_training_through_the_loader_matches_device_training():
    data = _small_data(48, 16)
    torch.manual_seed(0)
    base = MnistCNN()
    params = []
    for loader_workers in (None, 1):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters())
        bare_epoch(
            model,
            opt,
            data.train_x,
            data.train_y,
            batch_size=16,
            generator=torch.Generator().manual_seed(1),
            device=torch.device("cpu"),
            loader_workers=loader_workers,
        )
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_placement():
    data = _small_data(10, 10)
    assert placement("auto", data, torch.device("cpu")) == "device"
    assert placement("loader", data, torch.device("cpu")) == "loader"
    with pytest.raises(ValueError, match="trainer.data_placement='disk'.*allowed: auto, device, loader"):
        placement("disk", data, torch.device("cpu"))


def test_trainer_loader_placement_runs(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(targets_mod, "load_data", lambda *a, **k: _small_data())
    cfg = compose_cfg(
        "data=mnist_sample",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.data_placement=loader",
        "trainer.loader_workers=0",
        "data.batch_size=16",
    )
    assert run(cfg, tmp_path)["steps"] == 4


def test_sync_check_is_off_without_cuda():
    with forbid_syncs("cpu") as live:
        assert live is False
        torch.ones(3).sum().item()  # a CPU "sync" is nothing to catch


# --- on a GPU only ----------------------------------------------------------------------


def _syncing_transform():
    return lambda grad: grad * float(grad.abs().max().item() > 0)  # .item(): a host sync


@needs_cuda
def test_training_steps_between_log_points_never_sync(compose_cfg, tmp_path, monkeypatch):
    """trainer.sync_check=true sets sync debug mode 'error' between log points: a run with
    clip (hook), clip (fused) and log hooks finishes, so none of those steps synced."""
    monkeypatch.setattr(targets_mod, "load_data", lambda *a, **k: _small_data(256, 64))
    cfg = compose_cfg(
        "data=mnist_sample",
        "trainer.epochs=2",
        "trainer.device=cuda",
        "trainer.progress=false",
        "trainer.sync_check=true",
        "trainer.log_every=5",
        "+hooks=[clip,log]",
        "data.batch_size=16",
        "+hooks.fclip={params: 'l1.*', stage: fused, transforms: [{name: clamp, min: -0.001, max: 0.001}]}",
    )
    summary = run(cfg, tmp_path)
    assert summary["steps"] == 32 and summary["device"].startswith("cuda")


@needs_cuda
def test_sync_check_catches_a_syncing_transform(compose_cfg, tmp_path, monkeypatch):
    """The negative control: the same check raises when a transform reads a value."""
    gradmod.register("test_sync_item", _syncing_transform, overwrite=True)
    monkeypatch.setattr(targets_mod, "load_data", lambda *a, **k: _small_data(64, 16))
    cfg = compose_cfg(
        "data=mnist_sample",
        "trainer.epochs=1",
        "trainer.device=cuda",
        "trainer.progress=false",
        "trainer.sync_check=true",
        "data.batch_size=16",
        "+hooks.bad={params: 'l1.bias', transforms: [test_sync_item]}",
    )
    with pytest.raises(RuntimeError, match="synchroniz"):
        run(cfg, tmp_path)
    assert torch.cuda.get_sync_debug_mode() == 0, "the check is switched off again after the error"
