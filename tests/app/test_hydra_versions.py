"""gradmod's entry on the Hydra releases it is tested with: 1.3 (installed), and a 1.4
pre-release from the registry, under which one multirun writes its report without a
deprecation warning (the sweep report's target resolves under gradmod's allowlist)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from omegaconf import OmegaConf

from gradmod.app import hydra_versions

HYDRA_14 = ["hydra-core==1.4.0rc3", "omegaconf==2.4.1rc1"]  # the newest pre-releases, as tested


def test_the_entry_names_1_3_defaults_or_an_allowlist():
    import hydra

    options = hydra_versions.main_options()
    if hydra.__version__.startswith("1.3"):
        assert options == {"version_base": "1.3"}
    else:
        assert options == {"execution_whitelist": ["gradmod.*"]}
    hydra_versions.register_resolver("gradmod_test_twice", lambda x: x + "!")
    assert OmegaConf.create({"a": "${gradmod_test_twice:b}"}).a == "b!"


@pytest.mark.slow  # downloads Hydra 1.4 (seconds) and runs a sweep
def test_a_multirun_under_hydra_1_4_warns_nothing_and_reports(tmp_path):
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *HYDRA_14]
    if subprocess.run(pip, capture_output=True, timeout=300).returncode != 0:
        pytest.skip("Hydra 1.4's pre-release does not install here (no registry)")
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-W", "default", str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep}"]
    tiny = ["data=fake", "data.image_size=28", "data.channels=1", "data.train_size=32", "data.test_size=16"]
    run = ["trainer.epochs=1", "trainer.device=cpu", "trainer.progress=false", "trainer.threads=1", "seed=0,1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    proc = subprocess.run([*cmd, *tiny, *run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "whitelist" not in proc.stderr, proc.stderr
    version = subprocess.run(
        [sys.executable, "-c", "import hydra; print(hydra.__version__)"], env=env, capture_output=True, text=True
    )
    assert version.stdout.strip() == "1.4.0rc3"
    with open(sweep / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert sorted(p.name for p in sweep.glob("[0-9]*")) == ["0", "1"]
