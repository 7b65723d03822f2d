"""The run with optimizer groups: optimizer=muon resumes bitwise mid-epoch under a scheduler,
and a resume that changes the base learning rate leaves Muon's as its entry set it."""

from __future__ import annotations

import torch
from helpers import TINY_FAKE, compose_config

from gradmod.app.cli import run
from gradmod.app.config_store import validate
from gradmod.run.folder import checkpoint_file as ckpt

MUON_RUN = [
    *TINY_FAKE,
    "optimizer=muon",
    "optimizer.no_decay=[@biases]",
    "scheduler=cosine",
    "trainer.checkpoint_every_steps=4",
    "trainer.checkpoint_keep=10",
]


def test_optimizer_muon_resumes_bitwise_mid_epoch(tmp_path):
    full = tmp_path / "full"
    run(compose_config(*MUON_RUN), full)
    four = full / "checkpoints" / "step-000000004.pt"  # epoch 1 of 6 steps: mid-epoch
    saved = ckpt.load(four)["trainer"]["optimizer"]
    assert len(saved["param_groups"]) == 3  # AdamW: l1.weight, then the biases (no_decay); Muon: the kernels
    summary = run(compose_config(*MUON_RUN, f"trainer.resume={four}"), tmp_path / "resumed")
    assert summary["steps"] == 12 and summary["status"] == "ok"
    a, b = torch.load(full / "model.pt"), torch.load(tmp_path / "resumed" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_a_resume_with_a_new_base_lr_keeps_muons(tmp_path, caplog):
    over = [*TINY_FAKE, "optimizer=muon", "trainer.epochs=1", "trainer.checkpoint_every_steps=0"]
    run(compose_config(*over), tmp_path)
    last = ckpt.latest(tmp_path / "checkpoints")[0]
    run(compose_config(*over, "trainer.epochs=2", "optimizer.lr=0.001", f"trainer.resume={last}"), tmp_path)
    groups = ckpt.load(ckpt.latest(tmp_path / "checkpoints")[0])["trainer"]["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [0.001, 0.02]


def test_experiment_muon_sweeps_both_optimizers_on_both_workloads():
    from helpers import CONF
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / "muon.yaml").hydra.sweeper.params)
    assert params == {"workload": "char_gpt,mnist_cnn", "optimizer": "muon,adamw", "seed": "0,1,2"}
    for workload, model, data in (("char_gpt", "tiny_gpt", "char_text"), ("mnist_cnn", "mnist_cnn", "mnist_sample")):
        for optimizer in ("muon", "adamw"):
            built = validate(compose_config("experiment=muon", f"workload={workload}", f"optimizer={optimizer}"))
            assert (built.model.name, built.data.name) == (model, data)
            assert built.optimizer._target_ == "torch.optim.AdamW" and bool(built.optimizer.groups) == (
                optimizer == "muon"
            )
