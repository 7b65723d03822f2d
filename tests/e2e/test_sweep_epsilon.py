"""A DP sweep's report gives each job's epsilon; a sweep without noise has no such column."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from gradmod.reporting import sweep_report as sweep


def _job(root, name, overrides, summary):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_accuracy": summary["test_accuracy"]}) + "\n")


def test_sweep_md_has_an_epsilon_column_for_dp_sweeps(tmp_path):
    root = tmp_path / "sweep"
    for i, (sigma, eps) in enumerate([(0.8, 7.25), (1.6, 1.5)]):
        summary = {"status": "ok", "test_accuracy": 0.5 + i / 10, "test_loss": 1.0, "seconds": 2.0}
        summary["privacy"] = {"epsilon": eps, "delta": 1e-5, "noise_multiplier": sigma}
        _job(root, str(i), ["+hooks=dp", f"hooks.dp.transforms.0.noise_multiplier={sigma}"], summary)
    md = sweep.write_report(root)[0]["md"].read_text()
    assert "| test loss | epsilon | clip_coef |" in md
    assert "| ok | 0.5000 | 1.0000 | 7.250 |" in md and "| ok | 0.6000 | 1.0000 | 1.500 |" in md

    plain = tmp_path / "plain"
    _job(plain, "0", ["+hooks=clip"], {"status": "ok", "test_accuracy": 0.9, "test_loss": 0.1, "seconds": 1.0})
    assert "| epsilon |" not in sweep.write_report(plain)[0]["md"].read_text()
