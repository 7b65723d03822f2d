"""python -m benchmarks: the JSON report's structure (no timed assertions), the command line,
and each section's contenders bound to that section's own steps and batch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from benchmarks import cli, contenders, mnist, ratios
from benchmarks.sections import (
    curvature,
    freeze,
    orthogonalize,
    penalty,
    per_loss,
    per_sample,
    sam_peers,
    scale,
    scores,
    sharpness,
)
from benchmarks.timing import paired_ratio


@pytest.mark.slow  # every default section's contenders, about 100 s on 2 cores
def test_quick_bench_writes_a_complete_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = cli.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    expected = (
        {
            "epoch.article",
            "epoch.gradmod",
            "epoch.floor",
            "eval.article",
            "eval.gradmod",
            "eval.gradmod_b100",
            "step.none",
            "step.clip_hook",
            "step.clip_fused",
            "step.clip_grad_value_",
            "step.norm_fused",
            "step.log_every_step",
            "step.log_every_50",
            "step.clip_logged",
        }
        | {f"per_sample.{n}" for n in per_sample.names(hf=False)}
        | {f"per_loss.{n}" for n in per_loss.names()}
        | {f"sharpness.{n}" for n in sharpness.names()}
        | {f"freeze.{n}" for n in freeze.names()}
        | {f"orthogonalize.{n}" for n in orthogonalize.names()}
        | {f"scores.{n}" for n in scores.names()}
        | {f"penalty.{n}" for n in penalty.names()}
    )
    assert set(report["results"]) == expected
    for name, r in report["results"].items():
        assert r["section"] == name.split(".")[0]
        assert len(r["seconds"]) == report["settings"]["repeats"] == 1
        assert all(s > 0 and math.isfinite(s) for s in r["seconds"])
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert (
            r["items"]
            == {
                "epoch": 200,
                "eval": 50,
                "step": 2,
                "per_sample": 1,
                "per_loss": 1,
                "sharpness": 1,
                "freeze": 1,
                "orthogonalize": 1,
                "scores": 1,
                "penalty": 1,
            }[r["section"]]
        )
    targets = {
        "epoch_speedup_vs_article",
        "epoch_gradmod_over_floor",
        "eval_speedup_vs_article",
        "hook_overhead",
        "log_every_50_over_none",
        "per_sample_resnet18gn_over_plain",
        "per_sample_transformer_over_plain",
    }
    if per_sample.has_opacus():
        targets |= {"per_sample_mnist_over_opacus", "per_sample_mlp_over_opacus", "per_sample_mlp_over_opacus_ghost"}
        targets |= {"per_sample_mha_over_opacus"}
    for m in sharpness.MODELS:
        targets |= {f"sharpness_{m}_sam_over_plain", f"sharpness_{m}_every4_over_plain"}
    targets |= {f"orthogonalize_{m}_over_muon" for m in orthogonalize.MODELS}
    targets.add("freeze_resnet18_rule_over_by_hand")
    targets |= {f"scores_{m}_over_plain" for m in scores.MODELS}
    targets |= {f"penalty_{m}_{r}_over_{h}" for m in penalty.MODELS for r, h in penalty.PAIRS}
    gramian = [x for x in per_loss.METHODS if x not in ratios.WEIGHTINGS]
    for m in per_loss.MODELS:
        targets |= {f"per_loss_{m}_modules_over_plain"} | {f"per_loss_{m}_{x}_over_plain" for x in ratios.WEIGHTINGS}
        if per_loss.has_torchjd():
            targets |= {f"per_loss_{m}_{x}_over_torchjd" for x in gramian}
        if m in ratios.GRAMIAN_OVER_PLAIN:
            targets |= {f"per_loss_{m}_{x}_over_plain" for x in gramian}
    assert targets <= set(report["ratios"])
    for m in per_loss.MODELS:  # a loss weighting against the plain step on its own model instance
        assert {report["ratios"][f"per_loss_{m}_{x}_over_plain"]["denominator"] for x in ratios.WEIGHTINGS} == {
            f"per_loss.{m}.plain_{x}" for x in ratios.WEIGHTINGS
        }
    for name, r in report["ratios"].items():
        assert isinstance(r["value"], float) and r["value"] > 0 and math.isfinite(r["value"]), name
        num, den = report["results"][r["numerator"]], report["results"][r["denominator"]]
        series = {"median_cpu_s": "cpu_seconds", "median_s": "seconds"}[r["clock"]]
        paired = paired_ratio(num[series], den[series])
        assert r["value"] == pytest.approx(paired if r["paired"] else num[r["clock"]] / den[r["clock"]])
        assert r["paired"] == (name in ratios.PAIRED)
        assert ("target" in r) == (name in targets) and (name not in targets or isinstance(r["met"], bool))
    m = report["machine"]
    assert m["cores"] >= 1 and m["torch"] and m["device"] == "cpu" and len(m["load_average_before"]) == 3
    ops = report["ops"]
    assert set(ops) == {"floor", "bare", "none", "clip_hook", "clip_fused", "log", "clip_logged", "norm_fused"}
    assert (
        ops["floor"]["ops"]
        < ops["bare"]["ops"]
        <= ops["none"]["ops"]
        < ops["clip_hook"]["ops"]
        < ops["clip_logged"]["ops"]
    )
    assert ops["clip_hook"]["over_bare"] <= 2 * ops["clip_hook"]["tensors"] + 4
    assert ops["clip_logged"]["over_bare"] <= 12 * ops["clip_logged"]["tensors"]
    table = capsys.readouterr().out
    assert "epoch.article" in table and "hook_overhead" in table and str(out) in table and "ops per step" in table


def test_bench_full_tiles_the_sample_to_mnist_sizes_and_unknown_sections_are_refused(tmp_path):
    args = cli.parse_args(["--full", "--device", "cuda", "--epochs", "10"])
    assert (args.train_size, args.test_size, args.epochs) == (60_000, 10_000, 10)
    with pytest.raises(SystemExit):
        cli.parse_args(["--sections", "epoch,nope"])
    assert mnist.tile(torch.arange(3), 7).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_scale_section_times_every_contender_beside_its_ops(capsys):
    """The scale section on two small shapes: every contender's ratio to bare and ops per step."""
    out = scale.measure(rounds=1, run_steps=1, shapes=((2, 8), (1, 16)))
    assert list(out["shapes"]) == ["2x8", "1x16"]
    for s in out["shapes"].values():
        rows = s["contenders"]
        assert set(rows) == set(scale.CONTENDERS)
        assert rows["bare"]["x_bare"] == 1.0 and rows["bare"]["ops_over_bare"] == 0
        for name, r in rows.items():
            assert r["ms"] > 0 and r["wall_ms"] > 0 and r["ops"] >= rows["bare"]["ops"], name
            assert ("met" in r) == (name in scale.TARGETS)
        # clamp_min_ and clamp_max_ over every .grad at the end of backward (and, in the first two
        # backward passes, the raw non-finite count, until the ledger sees nobody takes it)
        assert rows["clamp_hook"]["ops_over_bare"] <= 4
    print(scale.table(out))
    assert "clip_logged" in capsys.readouterr().out
    assert cli.parse_args(["--sections", "scale"]).sections == ["scale"]
    assert "scale" not in cli.parse_args([]).sections  # asked for by name


def test_per_sample_contenders_alternate_with_their_ratio_to_the_first():
    out = per_sample.alternate(["mlp"], rounds=1, steps=1)
    assert set(out) == {"mlp"} and set(out["mlp"]) == {"plain", "gradmod"}
    assert out["mlp"]["plain"][1] == 1.0
    ms, ratio = out["mlp"]["gradmod"]
    assert ms > 0 and math.isclose(ratio, ms / out["mlp"]["plain"][0])


def test_a_weighting_and_its_plain_step_share_one_model_instance():
    plain, weighted = (per_loss.setup(f"mlp5.{c}_famo", steps=1) for c in ("plain", "gradmod"))
    model = per_loss._SHARED[("mlp5", "famo", 1)][0]
    before = [p.detach().clone() for p in model.parameters()]
    plain()
    after_plain = [p.detach().clone() for p in model.parameters()]
    weighted()
    assert all(not torch.equal(a, b) for a, b in zip(before, after_plain))  # the plain step moved this model
    assert any(not torch.equal(a, p) for a, p in zip(after_plain, model.parameters()))  # so did famo's


def test_a_paired_ratio_cancels_the_order_of_the_two_runs():
    # forwards the numerator runs second (0.9 of the other), backwards first (1.1): 0.99 together
    assert paired_ratio([0.9, 1.1, 0.9, 1.1, 0.9], [1.0] * 5) == pytest.approx((0.9 * 1.1) ** 0.5)
    assert paired_ratio([2.0], [4.0]) == 0.5  # one repeat (--quick)


# section -> (steps per timed run, batch handed to the set-up: "-" where it takes none), full and --quick
SECTION_RUNS = {
    "per_sample": ((per_sample.STEPS, "-"), (1, "-")),
    "per_loss": ((per_loss.STEPS, "-"), (1, "-")),
    "sharpness": ((sharpness.STEPS, None), (1, 4)),  # None: each model's own batch
    "freeze": ((freeze.STEPS, freeze.BATCH), (1, 2)),
    "orthogonalize": ((orthogonalize.STEPS, "-"), (1, "-")),
    "sam_peers": ((sam_peers.STEPS, None), (1, 4)),
    "scores": ((scores.STEPS, "-"), (1, "-")),
    "penalty": ((penalty.STEPS, "-"), (1, "-")),
    "curvature": ((curvature.EVERY, None), (2, 4)),
    "influence": ((1, None), (1, 50)),
}


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_each_contender_runs_its_own_sections_steps_and_batch(monkeypatch, tmp_path, quick):
    """A contender's set-up gets its own section's steps and batch, and its items per run are
    those steps (what a run's time is divided by): not those of the section built last."""
    called = {}

    def recorder(section):
        def setup(name, steps, batch="-", device=None):
            called[f"{section}.{name}"] = (steps, batch)
            return lambda: None

        return setup

    for section in SECTION_RUNS:
        monkeypatch.setattr(f"benchmarks.sections.{section}.setup", recorder(section))
    args = cli.parse_args([*cli.SECTIONS, "--train-size", "200", "--test-size", "50", *(["--quick"] if quick else [])])
    table = contenders.contenders(mnist.Bench(args, torch.device("cpu"), str(tmp_path)))
    assert {name.split(".")[0] for name in table} == set(SECTION_RUNS) | set(mnist.SECTIONS)
    for name, (setup, items, _) in table.items():
        section = name.split(".")[0]
        if section in SECTION_RUNS:
            setup()
            steps, batch = SECTION_RUNS[section][quick]
            assert called[name] == (steps, batch) and items == steps, name


def test_the_freeze_section_runs_at_its_own_batch(tmp_path):
    """``--sections freeze`` outside a smoke run: four steps of batch 16 per contender, the
    per-step time its median over four."""
    out = tmp_path / "bench.json"
    args = ["--repeats", "1", "--warmup", "0", "--train-size", "200", "--test-size", "50", "--json", str(out)]
    report = cli.main(["--sections", "freeze", *args])
    assert set(report["results"]) == {f"freeze.{n}" for n in freeze.names()}
    for r in report["results"].values():
        assert r["items"] == freeze.STEPS and r["unit"] == "freeze_step"
        assert r["per_item_ms"] == pytest.approx(1000 * r["median_s"] / freeze.STEPS)
        assert r["images_per_s"] == pytest.approx(freeze.STEPS * freeze.BATCH / r["median_s"])
    assert json.loads(out.read_text())["command"] == "python -m benchmarks --sections freeze " + " ".join(args)


def test_the_curvature_section_reports_each_estimates_products_and_a_whole_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = cli.main(["curvature", "--quick", "--only", "curvature.mnist.*", "--json", str(out)])
    counts = report["curvature_products"]["mnist"]  # --quick: one repeat, no warm-up
    assert len(counts) == 1 and 1 <= counts[0] <= curvature.SETTINGS["iterations"]
    written = json.loads(out.read_text())
    assert written["curvature_products"] == {"mnist": counts}
    assert list(written["curvature_runs"]) == ["mnist"]  # --only's pattern names the run too
    ratio = written["ratios"]["curvature_mnist_run_over_plain"]
    assert ratio["value"] == written["curvature_runs"]["mnist"]["ratio"] and ratio["target"] == "<= 1.10"
    printed = capsys.readouterr().out
    assert f"curvature.mnist: products per estimate, in the order they ran (warm-up runs first): {counts}" in printed
    assert "curvature.mnist run of 4 steps at every: 4 (2 estimates): " in printed


def test_a_runs_cost_is_its_steps_and_estimates_over_the_plain_copys_steps():
    """As gradmod's trainer estimates: cold at step 0, then after every ``every``-th step, the last too."""
    run = curvature.run_cost("mnist", rounds=2, every=4, window=2)
    assert [row["step"] for row in run["estimates"]] == [0, 4, 8]
    for row in run["estimates"]:
        assert 1 <= row["products"] <= curvature.SETTINGS["iterations"]
        assert row["plain_steps"] == pytest.approx(row["estimate_s"] / run["plain_step_s"])
    plain = run["plain_step_s"] * 8
    spent = run["after"] * plain + sum(row["estimate_s"] for row in run["estimates"])
    assert run["ratio"] == pytest.approx(spent / plain)
    assert run["ratio"] > run["after"] > 0
    ratios = [row["run_ratio"] for row in run["estimates"]]
    assert ratios[0] is None and ratios[-1] == run["ratio"]  # nothing trained before the cold one
    assert all(r > 0 for r in ratios[1:])


def test_sections_are_named_positionally_or_by_flag():
    assert cli.parse_args(["freeze", "scores"]).sections == ["freeze", "scores"]
    assert cli.parse_args(["--sections", "freeze,scores"]).sections == ["freeze", "scores"]
    assert cli.parse_args(["freeze", "--quick", "scores,freeze"]).sections == ["freeze", "scores"]
    assert cli.parse_args(["ops", "--sections", "scale"]).sections == ["ops", "scale"]
    assert cli.parse_args([]).sections == list(cli.DEFAULT_SECTIONS)
    assert "positional_sections" not in vars(cli.parse_args(["ops"]))  # bench.json's settings keep their keys
    with pytest.raises(SystemExit):
        cli.parse_args(["epoch", "nope"])


def test_the_package_runs_with_python_dash_m():
    """``python -m benchmarks --help`` from the checkout, and a section's contender in a fresh
    process as its peak memory is measured (``python -m benchmarks.sections.per_sample --peak``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--sections" in proc.stdout and "SECTION" in proc.stdout and "sam_peers" in proc.stdout
    assert per_sample.peak_in_subprocess("mlp.plain") >= 0


# one model of each default section (all of them: about 40 minutes on 2 loaded cores)
ONE_EACH = "epoch.*,eval.*,step.none,per_sample.mlp.*,per_loss.mlp5.plain*,per_loss.mlp5.gradmod_upgrad"
ONE_EACH += ",sharpness.mnist.*,freeze.*,orthogonalize.small.*,scores.mnist.*,penalty.mlp.*"


@pytest.mark.slow
def test_every_default_section_runs_outside_a_smoke_run(tmp_path):
    """The default sections at their own steps and batches (a small MNIST split, one repeat,
    one model of each section; ``--only``: no peak memory)."""
    out = tmp_path / "bench.json"
    args = ["--repeats", "1", "--warmup", "0", "--train-size", "200", "--test-size", "50", "--only", ONE_EACH]
    report = cli.main([*args, "--json", str(out)])
    assert {r["section"] for r in report["results"].values()} == set(cli.DEFAULT_SECTIONS) - {"ops"}
    for name, r in report["results"].items():
        if r["section"] in SECTION_RUNS:
            assert r["items"] == SECTION_RUNS[r["section"]][0][0], name
