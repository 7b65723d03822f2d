"""A user's config file (--config-dir) that is not plain YAML data is one line naming the
file, in about a second: malformed YAML, a !!python tag, an alias bomb."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

from gradmod.app import config_files

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)
FILES = {
    "malformed": ('r:\n  params: "*"\n  transforms: [zero\n', "not valid YAML at line 4"),
    "python_tag": (
        'r:\n  params: !!python/object/apply:os.system ["echo hi"]\n  transforms: [zero]\n',
        "line 2: the tag !!python/object/apply:os.system is not allowed",
    ),
    "bomb": (BOMB, "expand to more than 100,000 values"),
}


@pytest.fixture
def conf(tmp_path):
    (tmp_path / "hooks").mkdir()
    for name, (text, _) in FILES.items():
        (tmp_path / "hooks" / f"{name}.yaml").write_text(text)
    (tmp_path / "hooks" / "mine.yaml").write_text(
        'base: &base\n  params: "l1.*"\n  transforms: [zero]\nother:\n  <<: *base\n  params: "conv1.*"\n'
    )
    return tmp_path


@pytest.mark.parametrize("name", FILES)
def test_each_bad_file_is_one_line_naming_it(conf, name):
    for argv in (["--config-dir", str(conf), f"+hooks=[clip,{name}]"], [f"-cd={conf}", f"+hooks=mine,{name}"]):
        with pytest.raises(ValueError) as e:
            config_files.check(argv)
        assert str(e.value).startswith(f"{conf / 'hooks' / name}.yaml: ") and FILES[name][1] in str(e.value)
        assert "\n" not in str(e.value)


def test_plain_files_and_unselected_ones_pass(conf):
    config_files.check(["--config-dir", str(conf), "+hooks=[clip,mine]", "trainer.epochs=1"])
    config_files.check([f"hydra.searchpath=[file://{conf}]", "+hooks=mine"])
    with pytest.raises(ValueError, match="bomb.yaml"):
        config_files.check([f"hydra.searchpath=[file://{conf}]", "+hooks=bomb"])


def test_the_command_line_says_it_fast(conf):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config-dir", str(conf), "+hooks=bomb"],
        capture_output=True,
        text=True,
        cwd=conf,
        timeout=60,  # it used to hang expanding the aliases
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "bomb.yaml: its aliases" in proc.stderr


def test_a_user_file_with_a_shipped_name_is_refused_unless_it_is_a_copy(tmp_path):
    from helpers import CONF

    (tmp_path / "hooks").mkdir()
    mine = tmp_path / "hooks" / "clip.yaml"
    mine.write_text('clip:\n  params: "l1.*"\n  transforms: [zero]\n')
    argv = ["--config-dir", str(tmp_path), "+hooks=[clip]"]
    with pytest.raises(ValueError) as e:
        config_files.check(argv, shipped=CONF)
    assert str(e.value).startswith(f"{mine}: gradmod ships a config of this name (hooks/clip)")
    assert "hooks/my_clip.yaml" in str(e.value)
    mine.write_bytes((CONF / "hooks" / "clip.yaml").read_bytes())  # a copy hides nothing
    config_files.check(argv, shipped=CONF)
    config_files.check(["--config-dir", str(tmp_path), "+hooks=zero"], shipped=CONF)  # not selected


@pytest.mark.parametrize("entry", [[str(ROOT / "train.py")], ["-m", "gradmod"]], ids=["train.py", "python -m gradmod"])
def test_version_is_gradmods(entry):
    from gradmod import __version__

    proc = subprocess.run([sys.executable, *entry, "--version"], capture_output=True, text=True, cwd=ROOT.parent)
    assert proc.returncode == 0 and proc.stdout.startswith(f"gradmod {__version__} ")
    assert "Hydra" not in proc.stdout


@pytest.mark.slow  # the help page loads torch for the transforms
def test_help_lists_a_plugins_transforms(tmp_path):
    (tmp_path / "my_flip_plugin.py").write_text(
        "from gradmod import register\n\n\n"
        "def flip(p: float = 1.0):\n"
        '    """Negate the gradient with probability p."""\n'
        "    return lambda g: -g\n\n\n"
        'register("flip_plugin", flip)\n'
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help", "plugins=[my_flip_plugin]"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "flip_plugin(" in ln)
    assert line.split() == ["flip_plugin(p=1.0)", "Negate", "the", "gradient", "with", "probability", "p."]


def test_an_own_optimizer_file_is_told_its_schema_line_and_composes_with_it(tmp_path):
    """``optimizer/mine.yaml`` with Adam's ``betas``: one line that gives the schema line; with
    that line the file composes, its ``betas`` kept."""
    (tmp_path / "optimizer").mkdir()
    body = "_target_: torch.optim.Adam\nlr: 0.001\nbetas: [0.9, 0.99]\n"
    (tmp_path / "optimizer" / "mine.yaml").write_text(body)
    (tmp_path / "optimizer" / "mine2.yaml").write_text("defaults: [/schema/optimizer/adam@_here_, _self_]\n" + body)

    def run(*args):
        cmd = [sys.executable, str(ROOT / "train.py"), "--config-dir", str(tmp_path), *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)

    refused = run("optimizer=mine", "trainer.epochs=1")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "'defaults: [/schema/optimizer/adam@_here_, _self_]'" in refused.stderr
    composed = run("optimizer=mine2", "--cfg", "job")
    assert composed.returncode == 0, composed.stderr
    assert yaml.safe_load(composed.stdout)["optimizer"]["betas"] == [0.9, 0.99]
