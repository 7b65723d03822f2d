"""A curvature rule's rows and probe batch survive a real save and resume in Lightning and in
Hugging Face's Trainer: the resumed run keeps the rows before the checkpoint, and its next estimate
is on the first run's probe batch (against eigvalsh of torch.func's Hessian at the final weights),
not on the first batch it sees; HF's step-0 estimate reaches ``report_to`` (TensorBoard, read back)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import hessian_top, hf_args, lightning_args
from torch import nn

N, BATCH = 64, 8
RULE = {
    "curv": {
        "params": "net.0.*",
        "transforms": [{"name": "curvature", "every": 2, "k": 2, "iterations": 200, "tol": 1e-10, "batch": 5}],
    }
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(N, 6, generator=g) * 4).double(), torch.randint(3, (N,), generator=g)


def _exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The top 2 of ``net.0.*``'s Hessian block of ``cross_entropy(model.net(x), y)``."""
    return hessian_top(model.net, lambda call: F.cross_entropy(call(x), y), ["0.weight", "0.bias"], 2)


def _check_resumed(rows_before, rows, net, probe, other) -> None:
    """Rows 0 and 2 as saved; row 4 the exact top-2 on ``probe``, not on ``other`` (the first batch
    the resumed run saw)."""
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert rows[:2] == rows_before
    exact = _exact(net, *probe)
    assert [rows[2]["top1"], rows[2]["top2"]] == pytest.approx(exact, rel=1e-8)
    assert _exact(net, *other)[0] != pytest.approx(exact[0], rel=1e-3)  # the probe batch mattered


def test_lightning_rows_and_probe_batch_resume_from_a_checkpoint(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gradmod.integrations.lightning import GradmodCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    x, y = _data()
    orders = [torch.randperm(N, generator=torch.Generator().manual_seed(s)).tolist() for s in (3, 4)]

    def fit(callback, steps, order, ckpt=None) -> Module:
        module = Module()
        trainer = L.Trainer(**lightning_args(tmp_path, max_steps=steps, callbacks=[callback]))
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=order), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(tmp_path / "half.ckpt")
        return module

    first = GradmodCallback(RULE, loss_fn=F.cross_entropy)
    fit(first, 2, orders[0])
    saved = torch.load(tmp_path / "half.ckpt", weights_only=False)["callbacks"][first.state_key]["curvature"]
    assert [r["step"] for r in saved["rows"]] == [0, 2]
    resumed = GradmodCallback(RULE, loss_fn=F.cross_entropy)
    module = fit(resumed, 4, orders[1], tmp_path / "half.ckpt")  # another order: another first batch
    probe, other = (x[orders[0][:5]], y[orders[0][:5]]), (x[orders[1][:5]], y[orders[1][:5]])
    assert torch.equal(resumed.probe.batch[0], probe[0])
    _check_resumed(first.curvature_rows, resumed.curvature_rows, module, probe, other)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x, labels=None):
        return {"loss": F.cross_entropy(self.net(x), labels)}


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = _data()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _hf(folder, **overrides):
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=_Tiny(), args=TrainingArguments(**hf_args(folder, BATCH, max_steps=4, **overrides)), train_dataset=_Data()
    )


def test_hf_rows_and_probe_batch_resume_from_a_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from gradmod.integrations.transformers import add_to

    first = _hf(tmp_path / "a", save_strategy="steps", save_steps=2)
    ours = add_to(first, RULE)
    first.train()
    saved = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["GradmodCallback"]["attributes"]["curvature_state"]
    assert [r["step"] for r in state["rows"]] == [0, 2]
    probe = ours.probe.batch["x"], ours.probe.batch["labels"]

    def resume(restore: bool):
        t = _hf(tmp_path / "b", restore_callback_states_from_checkpoint=restore)
        add_to(t, RULE)
        seen = []
        t.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw) if not seen else None, with_kwargs=True)
        t.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
        return t, t.callback_handler.callbacks[0], (seen[0]["x"][:5], seen[0]["labels"][:5])

    t, callback, other = resume(True)
    _check_resumed(ours.curvature_rows[:2], callback.curvature_rows, t.model, probe, other)
    with pytest.warns(UserWarning, match=r"^resuming at step 2 without the curvature rows before it: [^\n]*$"):
        _, callback, _ = resume(False)
    assert [r["step"] for r in callback.curvature_rows] == [4]


def test_hf_step_0_estimate_reaches_report_to(tmp_path):
    """TensorBoard (a ``report_to`` integration) has the estimates at steps 0, 2 and 4; the step-0
    record in log_history is one, and the rule statistics are not read at step 0."""
    pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradmod.integrations.transformers import add_to

    t = _hf(tmp_path, report_to="tensorboard")
    callback = add_to(t, [RULE, "log"])
    t.train()
    events = EventAccumulator(str(next(tmp_path.glob("**/events.out.tfevents.*")).parent))
    events.Reload()
    written = events.Scalars("train/curv/net.0.*/top1")
    assert [e.step for e in written] == [0, 2, 4]
    assert [e.value for e in written] == pytest.approx([r["top1"] for r in callback.curvature_rows], rel=1e-6)
    step0 = [r for r in t.state.log_history if r["step"] == 0]
    assert len(step0) == 1 and not any(k.startswith("grad/") for k in step0[0])
    calls = events.Scalars("train/grad/net.0.weight/calls")
    assert [(e.step, e.value) for e in calls] == [(2, 2.0), (4, 2.0)]  # windows of two steps, none consumed at 0
