"""scripts/bench.py --quick: the JSON report's structure (no timed assertions)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_bench_writes_a_complete_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench = _bench()
    report = bench.main(["--quick", "--json", str(out)])
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
        | {f"per_sample.{n}" for n in bench.per_sample.names(hf=False)}
        | {f"per_loss.{n}" for n in bench.per_loss.names()}
        | {f"sharpness.{n}" for n in bench.sharpness.names()}
        | {f"freeze.{n}" for n in bench.freeze.names()}
        | {f"orthogonalize.{n}" for n in bench.orthogonalize.names()}
        | {f"scores.{n}" for n in bench.scores.names()}
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
    if bench.per_sample.has_opacus():
        targets |= {"per_sample_mnist_over_opacus", "per_sample_mlp_over_opacus", "per_sample_mlp_over_opacus_ghost"}
        targets |= {"per_sample_mha_over_opacus"}
    for m in bench.sharpness.MODELS:
        targets |= {f"sharpness_{m}_sam_over_plain", f"sharpness_{m}_every4_over_plain"}
    targets |= {f"orthogonalize_{m}_over_muon" for m in bench.orthogonalize.MODELS}
    targets.add("freeze_resnet18_rule_over_by_hand")
    targets |= {f"scores_{m}_over_plain" for m in bench.scores.MODELS}
    gramian = [x for x in bench.per_loss.METHODS if x not in bench.WEIGHTINGS]
    for m in bench.per_loss.MODELS:
        targets |= {f"per_loss_{m}_modules_over_plain"} | {f"per_loss_{m}_{x}_over_plain" for x in bench.WEIGHTINGS}
        if bench.per_loss.has_torchjd():
            targets |= {f"per_loss_{m}_{x}_over_torchjd" for x in gramian}
        if m in bench.GRAMIAN_OVER_PLAIN:
            targets |= {f"per_loss_{m}_{x}_over_plain" for x in gramian}
    assert targets <= set(report["ratios"])
    for m in bench.per_loss.MODELS:  # a loss weighting against the plain step on its own model instance
        assert {report["ratios"][f"per_loss_{m}_{x}_over_plain"]["denominator"] for x in bench.WEIGHTINGS} == {
            f"per_loss.{m}.plain_{x}" for x in bench.WEIGHTINGS
        }
    for name, r in report["ratios"].items():
        assert isinstance(r["value"], float) and r["value"] > 0 and math.isfinite(r["value"]), name
        num, den = report["results"][r["numerator"]], report["results"][r["denominator"]]
        series = {"median_cpu_s": "cpu_seconds", "median_s": "seconds"}[r["clock"]]
        paired = bench.paired_ratio(num[series], den[series])
        assert r["value"] == pytest.approx(paired if r["paired"] else num[r["clock"]] / den[r["clock"]])
        assert r["paired"] == (name in bench.PAIRED)
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
    bench = _bench()
    args = bench.parse_args(["--full", "--device", "cuda", "--epochs", "10"])
    assert (args.train_size, args.test_size, args.epochs) == (60_000, 10_000, 10)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "epoch,nope"])
    assert bench.tile(bench.torch.arange(3), 7).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_scale_section_times_every_contender_beside_its_ops(capsys):
    """The scale section on two small shapes: every contender's ratio to bare and ops per step."""
    bench = _bench()
    out = bench.scale.measure(rounds=1, run_steps=1, shapes=((2, 8), (1, 16)))
    assert list(out["shapes"]) == ["2x8", "1x16"]
    for s in out["shapes"].values():
        rows = s["contenders"]
        assert set(rows) == set(bench.scale.CONTENDERS)
        assert rows["bare"]["x_bare"] == 1.0 and rows["bare"]["ops_over_bare"] == 0
        for name, r in rows.items():
            assert r["ms"] > 0 and r["wall_ms"] > 0 and r["ops"] >= rows["bare"]["ops"], name
            assert ("met" in r) == (name in bench.scale.TARGETS)
        # clamp_min_ and clamp_max_ over every .grad at the end of backward (and, in the first two
        # backward passes, the raw non-finite count, until the ledger sees nobody takes it)
        assert rows["clamp_hook"]["ops_over_bare"] <= 4
    print(bench.scale.table(out))
    assert "clip_logged" in capsys.readouterr().out
    assert bench.parse_args(["--sections", "scale"]).sections == ["scale"]
    assert "scale" not in bench.parse_args([]).sections  # asked for by name


def test_per_sample_contenders_alternate_with_their_ratio_to_the_first():
    per_sample = _bench().per_sample
    out = per_sample.alternate(["mlp"], rounds=1, steps=1)
    assert set(out) == {"mlp"} and set(out["mlp"]) == {"plain", "gradmod"}
    assert out["mlp"]["plain"][1] == 1.0
    ms, ratio = out["mlp"]["gradmod"]
    assert ms > 0 and math.isclose(ratio, ms / out["mlp"]["plain"][0])


def test_a_weighting_and_its_plain_step_share_one_model_instance():
    per_loss = _bench().per_loss
    plain, weighted = (per_loss.setup(f"mlp5.{c}_famo", steps=1) for c in ("plain", "gradmod"))
    model = per_loss._SHARED[("mlp5", "famo", 1)][0]
    before = [p.detach().clone() for p in model.parameters()]
    plain()
    after_plain = [p.detach().clone() for p in model.parameters()]
    weighted()
    assert all(not torch.equal(a, b) for a, b in zip(before, after_plain))  # the plain step moved this model
    assert any(not torch.equal(a, p) for a, p in zip(after_plain, model.parameters()))  # so did famo's


def test_a_paired_ratio_cancels_the_order_of_the_two_runs():
    bench = _bench()
    # forwards the numerator runs second (0.9 of the other), backwards first (1.1): 0.99 together
    assert bench.paired_ratio([0.9, 1.1, 0.9, 1.1, 0.9], [1.0] * 5) == pytest.approx((0.9 * 1.1) ** 0.5)
    assert bench.paired_ratio([2.0], [4.0]) == 0.5  # one repeat (--quick)


def test_each_sections_set_up_gets_its_own_steps_and_batch(tmp_path, monkeypatch):
    """Every contender's set-up is called with the steps (and batch) of its own section, the
    ones its row counts, not those of the section set up last."""
    bench = _bench()
    args = bench.parse_args(["--sections", "per_sample,per_loss,sharpness,freeze,orthogonalize,sam_peers,scores"])
    made = bench.Bench(args, torch.device("cpu"), str(tmp_path))
    seen = {}
    for section in ("per_sample", "per_loss", "sharpness", "freeze", "orthogonalize", "sam_peers", "scores"):
        module = getattr(bench, section)
        monkeypatch.setattr(module, "setup", lambda *a, section=section: seen.setdefault(section, a))
    for name, (setup, items, _) in made.contenders().items():
        setup()
        assert seen[name.split(".")[0]][1] == items, name  # its own section's steps per timed run
    assert seen["freeze"][1:3] == (bench.freeze.STEPS, bench.freeze.BATCH)
    assert seen["sharpness"][2] is None and seen["sam_peers"][2] is None  # their models' own batches
