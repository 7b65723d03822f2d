"""gradmod's rules inside a real ``transformers.Trainer`` (a tiny model built here, no
download): equal to HF's own ``max_grad_norm`` under gradient accumulation, statistics
reach the callbacks after it and ``log_history``, rule state resumes bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_args
from torch import nn

pytest.importorskip("transformers", reason='Transformers is not installed (pip install "gradmod[transformers]")')
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gradmod.integrations.transformers import GradmodCallback, add_to  # noqa: E402

N, BATCH, ACCUMULATE = 64, 8, 2  # 4 optimizer steps of 2 micro-batches


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 6, generator=g) * 4, torch.randint(3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Recorder(TrainerCallback):
    """After the reporting integrations: what they receive, and the gradients each step uses."""

    def __init__(self):
        self.logs, self.grad_max = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grad_max.append(max(p.grad.abs().max().item() for p in model.parameters()))


def trainer(tmp_path, callbacks=(), model=None, dataset=None, **overrides) -> Trainer:
    return Trainer(
        model=model or Tiny(),
        args=TrainingArguments(
            **hf_args(tmp_path, BATCH, gradient_accumulation_steps=ACCUMULATE, num_train_epochs=1, **overrides)
        ),
        train_dataset=dataset or Data(),
        callbacks=list(callbacks),
    )


def params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


GNC = {"gnc": {"params": "*", "stage": "fused", "transforms": [{"name": "global_norm_clip", "max_norm": 0.5}]}}
CLAMP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}


def test_global_norm_clip_equals_max_grad_norm_under_accumulation(tmp_path):
    ours = trainer(tmp_path)
    add_to(ours, GNC)
    ours.train()
    ref = trainer(tmp_path, max_grad_norm=0.5)
    ref.train()
    plain = trainer(tmp_path)
    plain.train()
    assert ours.state.global_step == 4
    assert all(torch.equal(p, q) for p, q in zip(params(ours), params(ref)))
    assert not all(torch.equal(p, q) for p, q in zip(params(ours), params(plain)))  # the clip acted


def test_a_hook_stage_clamp_acts_on_each_micro_batch(tmp_path):
    seen, plain = Recorder(), Recorder()
    t = trainer(tmp_path, [seen])
    callback = add_to(t, CLAMP)
    t.train()
    trainer(tmp_path, [plain]).train()
    assert len(seen.grad_max) == 4 and max(seen.grad_max) <= 2 * 0.01  # two clamped micro-batches summed
    assert max(plain.grad_max) > 2 * 0.01
    assert callback.hooks is None  # removed at on_train_end
    t.model.zero_grad()
    F.cross_entropy(t.model.net(Data().x), Data().y).backward()
    assert max(p.grad.abs().max() for p in t.model.parameters()) > 0.01


def test_statistics_reach_the_callbacks_after_it_and_log_history(tmp_path):
    recorder = Recorder()
    t = trainer(tmp_path, [recorder])
    add_to(t, ["log", GNC])  # a shipped hook file by name and a mapping, merged
    t.train()
    logged = [r for r in recorder.logs if "grad/net.0.weight/norm" in r]
    assert len(logged) == 2  # logging_steps=2: steps 2 and 4
    assert all(r["grad/net.0.weight/calls"] == 2 * ACCUMULATE for r in logged)  # one call per micro-batch
    assert all(r["grad/gnc/global_norm_clip/calls"] == 2 for r in logged)  # one per optimizer step
    history = [r for r in t.state.log_history if "grad/net.2.bias/norm" in r]
    assert [r["step"] for r in history] == [2, 4]
    assert [r["grad/net.2.bias/norm"] for r in history] == [r["grad/net.2.bias/norm"] for r in logged]


def test_hf_clipping_with_fused_rules_warns(tmp_path):
    t = trainer(tmp_path, max_grad_norm=0.5, max_steps=1)
    add_to(t, GNC)
    with pytest.warns(UserWarning, match=r"max_grad_norm=0.5: HF clips the gradients before gradmod's fused rules"):
        t.train()


ZCLIP = {
    "z": {
        "params": "*",
        "stage": "fused",
        "transforms": [{"name": "zclip", "warmup_steps": 1, "z_threshold": 0.3, "alpha": 0.5}],
    }
}


def test_zclip_state_resumes_bit_identically_from_an_hf_checkpoint(tmp_path):
    straight = trainer(tmp_path / "a", max_steps=4)
    add_to(straight, ZCLIP)
    straight.train()

    first = trainer(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2)
    add_to(first, ZCLIP)
    first.train()
    saved = json.loads((tmp_path / "b" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["GradmodCallback"]["attributes"]["rule_state"]["group"]["z/zclip"]["steps"] == 2

    def resume(restore: bool) -> Trainer:
        t = trainer(tmp_path / "c", max_steps=4, restore_callback_states_from_checkpoint=restore)
        add_to(t, ZCLIP)
        t.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
        assert isinstance(t.callback_handler.callbacks[0], GradmodCallback)  # still first after HF's restore
        return t

    assert all(torch.equal(p, q) for p, q in zip(params(straight), params(resume(True))))
    assert not all(torch.equal(p, q) for p, q in zip(params(straight), params(resume(False))))  # state mattered


def test_zclip_skip_is_refused_in_one_line(tmp_path):
    rules = {"z": {"params": "*", "stage": "fused", "transforms": [{"name": "zclip", "on_spike": "skip"}]}}
    t = trainer(tmp_path)
    add_to(t, rules)
    with pytest.raises(
        ValueError,
        match=r"^hooks.z: zclip\(on_spike='skip'\) cannot skip an optimizer step "
        r"under Transformers' Trainer; use on_spike: clip$",
    ):
        t.train()


def test_hook_stage_rules_under_fp16_are_refused(tmp_path):
    callback = GradmodCallback(CLAMP)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    args.fp16 = True  # as on a GPU; the refusal comes before any scaled gradient
    with pytest.raises(
        ValueError,
        match=r"^hooks.clip: hook-stage rules would see fp16's scaled gradients; "
        r"use stage: fused",
    ):
        callback.on_train_begin(args, None, None, model=Tiny())
    assert callback.hooks is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for fp16 with a GradScaler")
def test_fp16_on_cuda_fused_clip_sees_unscaled_gradients(tmp_path):
    common = dict(use_cpu=False, fp16=True, learning_rate=0.05)
    ours = trainer(tmp_path, **common)
    add_to(ours, GNC)
    ours.train()
    ref = trainer(tmp_path, max_grad_norm=0.5, **common)
    ref.train()
    for p, q in zip(params(ours), params(ref)):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_the_docs_example_runs_as_written_from_another_folder(tmp_path, monkeypatch, capsys):
    import re

    from helpers import ROOT

    doc = ROOT / "docs" / "guide" / "transformers.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)  # its output_dir lands here
    ns = {"__name__": "__main__"}
    exec(compile(code, str(doc), "exec"), ns)
    history = [r for r in ns["hf_trainer"].state.log_history if "grad/norm/global_norm_clip/clip_coef" in r]
    assert [r["step"] for r in history] == [8, 16, 24, 32]
    assert all(r["grad/net.1.weight/calls"] == 8 and r["grad/norm/global_norm_clip/clip_coef"] <= 1 for r in history)
    assert "'grad/net.1.weight/norm'" in capsys.readouterr().out


def test_the_console_gets_one_line_per_log_and_report_to_gets_the_statistics(tmp_path, capsys):
    """HF's printer shows one line instead of the ``grad/...`` entries; TensorBoard (a
    ``report_to`` integration) and the callbacks before the printer get every entry."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = Recorder()
    t = trainer(tmp_path, [recorder], report_to="tensorboard")
    add_to(t, ["log", GNC])
    t.train()
    out = capsys.readouterr().out
    assert "grad/" not in out, out  # PrinterCallback (disable_tqdm) prints each logs dict
    lines = [ln for ln in out.splitlines() if ln.startswith("gradmod step")]
    assert [ln.split(":")[0] for ln in lines] == ["gradmod step 2", "gradmod step 4"]
    logged = [r for r in recorder.logs if "grad/net.0.weight/norm" in r]
    entries = {k.removeprefix("grad/"): v for k, v in logged[-1].items() if k.startswith("grad/")}
    norms = {k.rpartition("/")[0]: v for k, v in entries.items() if k.endswith("/norm")}
    top = max(norms, key=norms.get)
    tensors = {k.rpartition("/")[0] for k in entries}
    assert lines[-1] == (
        f"gradmod step 4: {len(entries)} statistics of {len(tensors)} tensors to tensorboard; "
        f"largest norm {norms[top]:.4g} ({top})"
    )
    events = EventAccumulator(str(next(tmp_path.glob("**/events.out.tfevents.*")).parent))
    events.Reload()
    written = events.Scalars("train/grad/net.0.weight/norm")
    assert [e.step for e in written] == [2, 4]
    assert [e.value for e in written] == pytest.approx([r["grad/net.0.weight/norm"] for r in logged], rel=1e-6)


def test_two_callbacks_on_one_tensor_name_the_one_callback_to_use(tmp_path):
    t = trainer(tmp_path)
    add_to(t, "clip")
    add_to(t, "log")
    with pytest.raises(
        ValueError,
        match=r"^Transformers' Trainer: two GradmodCallbacks on the same tensors "
        r"\(net.0.weight, .*\); give one callback several rule sources instead: "
        r"GradmodCallback\(\['(clip|log)', '(clip|log)'\]\)$",
    ):
        t.train()


def test_sam_rules_are_refused_in_one_line_at_train_begin(tmp_path):
    t = trainer(tmp_path)
    add_to(t, "sam")
    with pytest.raises(
        ValueError,
        match=r"^hooks.sam: sharpness rules \(SAM\) are refused under Transformers' Trainer: [^\n]*closure=fn\)$",
    ):
        t.train()


def test_per_sample_rules_are_refused_in_one_line_at_add_to(tmp_path):
    t = trainer(tmp_path)
    before = list(t.callback_handler.callbacks)
    with pytest.raises(
        ValueError,
        match=r"^hooks.dp: per_sample rules .* are refused under Transformers' Trainer: "
        r"[^\n]*attach the rules in your own loop \(gradmod.PoissonSampler, gradmod.Accountant\)$",
    ):
        add_to(t, "dp")
    assert t.callback_handler.callbacks == before  # nothing added


RAMP = {
    "ramp": {
        "params": "*",
        "stage": "fused",
        "transforms": [{"name": "global_norm_clip", "max_norm": {"schedule": "linear", "start": 1.0, "end": 0.1}}],
    }
}


class ClipByHand(TrainerCallback):
    """clip_grad_norm_ with the linear ramp over HF's own global step (the reference)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        t = state.global_step
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0 + (0.1 - 1.0) * min(t / state.max_steps, 1.0))


def test_a_schedule_follows_hfs_global_step_and_resumes(tmp_path):
    ours = trainer(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2)
    add_to(ours, RAMP)
    ours.train()
    ref = trainer(tmp_path / "r", max_steps=4, callbacks=[ClipByHand()])
    ref.train()
    assert all(torch.equal(p, q) for p, q in zip(params(ours), params(ref)))
    resumed = trainer(tmp_path / "c", max_steps=4)
    add_to(resumed, RAMP)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))  # the clock: HF's global step
    assert all(torch.equal(p, q) for p, q in zip(params(ours), params(resumed)))


CURVATURE = {
    "curv": {
        "params": ["net.0.*", "net.2.bias"],
        "transforms": [{"name": "curvature", "every": 2, "k": 2, "iterations": 200, "tol": 1e-10, "batch": 5}],
    }
}


def _float64(tmp_path, rules) -> tuple[Trainer, GradmodCallback, list[torch.Tensor]]:
    data = Data()
    data.x = data.x.double()
    t = trainer(tmp_path, model=Tiny().double(), dataset=data)
    callback = add_to(t, rules)
    first = params(t)
    t.train()
    return t, callback, first


def test_a_curvature_rule_estimates_the_exact_hessian_and_leaves_training_as_it_was(tmp_path):
    """Estimates at steps 0, 2 and 4 (the last; 2 micro-batches a step): those at 0 and 4 against
    eigvalsh of torch.func's Hessian of the model's own loss at the first and the final weights,
    on the first 5 examples of the first inputs; log_history carries each at its step."""
    from helpers import hessian_top

    ours, callback, first = _float64(tmp_path, [CURVATURE, GNC])
    plain, _, _ = _float64(tmp_path, GNC)
    assert all(torch.equal(p, q) for p, q in zip(params(ours), params(plain)))  # bit for bit
    rows = callback.curvature_rows
    assert [(r["step"], r["group"]) for r in rows] == [(s, g) for s in (0, 2, 4) for g in ("net.0.*", "net.2.bias")]
    probe = callback.probe.batch
    assert probe["x"].shape == (5, 6) and all((Data().x.double() == row).all(1).any() for row in probe["x"])
    names = {"net.0.*": ["net.0.weight", "net.0.bias"], "net.2.bias": ["net.2.bias"]}
    worst = 0.0
    for step, weights in ((0, first), (4, params(ours))):
        reference = Tiny().double()
        with torch.no_grad():
            for p, w in zip(reference.parameters(), weights):
                p.copy_(w)
        for row in (r for r in rows if r["step"] == step):
            k = min(2, sum(reference.get_parameter(n).numel() for n in names[row["group"]]))
            exact = hessian_top(reference, lambda call: call(**probe)["loss"], names[row["group"]], k)
            got = [row[f"top{i + 1}"] for i in range(k)]
            worst = max(worst, *(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, exact)))
            assert got == pytest.approx(exact, rel=1e-8, abs=1e-10), (step, row["group"], got, exact)
    print(f"largest relative error {worst:.2e}")
    history = [r for r in ours.state.log_history if "curv/net.0.*/top1" in r]
    assert [(r["step"], r["curv/net.0.*/top1"]) for r in history] == [
        (r["step"], r["top1"]) for r in rows if r["group"] == "net.0.*"
    ]


def test_a_curvature_glob_matching_nothing_is_refused_in_one_line_at_train_begin(tmp_path):
    t = trainer(tmp_path)
    add_to(t, {"curv": {"params": "conv*", "transforms": ["curvature"]}})
    with pytest.raises(ValueError, match=r"^hooks.curv.params: 'conv\*' matches no trainable parameter[^\n]*$"):
        t.train()
