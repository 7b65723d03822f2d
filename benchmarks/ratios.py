"""The ratios ``python -m benchmarks`` reports, and their targets.

Each entry of ``RATIOS`` is (name, numerator, denominator, target description, test on the
value); a ratio is median(numerator) / median(denominator), on the clock
``benchmarks.timing.clock`` picks; those in ``PAIRED`` (two contenders on one model
instance, a few percent apart) are formed from the repeats' own ratios
(``benchmarks.timing.paired_ratio``). ``GPU_TARGET`` applies only on a GPU.
"""

from __future__ import annotations

import torch

from benchmarks.sections import curvature, orthogonalize, penalty, per_loss, sam_peers, scores, sharpness
from benchmarks.timing import clock, paired_ratio

Ratio = tuple  # (name, numerator, denominator, target description or None, test or None)

MNIST = [
    ("epoch_speedup_vs_article", "epoch.article", "epoch.gradmod", "> 1 (faster than the article)", lambda r: r > 1),
    ("epoch_gradmod_over_floor", "epoch.gradmod", "epoch.floor", "<= 1.10", lambda r: r <= 1.10),
    ("eval_speedup_vs_article", "eval.article", "eval.gradmod", ">= 2", lambda r: r >= 2),
    ("eval_b100_speedup_vs_article", "eval.article", "eval.gradmod_b100", None, None),
    ("hook_overhead", "step.clip_hook", "step.none", "<= 1.05", lambda r: r <= 1.05),
    ("fused_over_none", "step.clip_fused", "step.none", None, None),
    ("clip_grad_value_over_none", "step.clip_grad_value_", "step.none", None, None),
    ("norm_fused_over_none", "step.norm_fused", "step.none", None, None),
    ("log_every_step_over_none", "step.log_every_step", "step.none", None, None),
    ("log_every_50_over_none", "step.log_every_50", "step.none", "<= 1.25", lambda r: r <= 1.25),
    ("clip_logged_over_none", "step.clip_logged", "step.none", None, None),
    ("none_over_floor", "step.none", "epoch.floor", None, None),
    ("compiled_speedup", "epoch.gradmod", "epoch.gradmod_compiled", None, None),
]
PER_SAMPLE = [
    (
        "per_sample_mnist_over_opacus",
        "per_sample.mnist.gradmod",
        "per_sample.mnist.opacus",
        "<= 1.0",
        lambda r: r <= 1.0,
    ),
    ("per_sample_mlp_over_opacus", "per_sample.mlp.gradmod", "per_sample.mlp.opacus", "<= 0.1", lambda r: r <= 0.1),
    (
        "per_sample_mlp_over_opacus_ghost",
        "per_sample.mlp.gradmod",
        "per_sample.mlp.opacus_ghost",
        "< 1",
        lambda r: r < 1,
    ),
    ("per_sample_mnist_over_plain", "per_sample.mnist.gradmod", "per_sample.mnist.plain", None, None),
    (
        "per_sample_resnet18gn_over_plain",
        "per_sample.resnet18gn.gradmod",
        "per_sample.resnet18gn.plain",
        "<= 2.2",
        lambda r: r <= 2.2,
    ),
    (
        "per_sample_transformer_over_plain",
        "per_sample.transformer.gradmod",
        "per_sample.transformer.plain",
        "<= 1.6",
        lambda r: r <= 1.6,
    ),
    ("per_sample_mlp_over_plain", "per_sample.mlp.gradmod", "per_sample.mlp.plain", None, None),
    (
        "per_sample_mha_over_opacus",  # nn.MultiheadAttention against Opacus' DPMultiheadAttention
        "per_sample.transformer.gradmod",
        "per_sample.transformer.opacus",
        "<= 0.8",
        lambda r: r <= 0.8,
    ),
    ("per_sample_gpt2_over_plain", "per_sample.gpt2.gradmod", "per_sample.gpt2.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_gpt2_ids_over_plain", "per_sample.gpt2_ids.gradmod", "per_sample.gpt2_ids.plain", None, None),
    (
        "per_sample_gpt2_stock_over_plain",  # as returned: dropout 0.1, the key/value cache in its output
        "per_sample.gpt2_stock.gradmod",
        "per_sample.gpt2_stock.plain",
        "<= 1.8",
        lambda r: r <= 1.8,
    ),
    ("per_sample_bert_over_plain", "per_sample.bert.gradmod", "per_sample.bert.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_llama_over_plain", "per_sample.llama.gradmod", "per_sample.llama.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_qwen2_over_plain", "per_sample.qwen2.gradmod", "per_sample.qwen2.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_t5_over_plain", "per_sample.t5.gradmod", "per_sample.t5.plain", "<= 2", lambda r: r <= 2),
    ("opacus_mlp_over_plain", "per_sample.mlp.opacus", "per_sample.mlp.plain", None, None),
    ("opacus_ghost_mlp_over_plain", "per_sample.mlp.opacus_ghost", "per_sample.mlp.plain", None, None),
]
# per_loss: a Gramian method <= 0.6x torchjd's step, and <= 3x a plain step on the MLP with 10
# heads, <= 2.5x on the transformer trunk; a loss weighting <= 1.05x plain; modules <= 1.3x plain.
GRAMIAN_OVER_PLAIN = {"mlp10": 3.0, "trans5": 2.5}
WEIGHTINGS = per_loss.WEIGHTINGS
GPU_TARGET = ("epoch_speedup_vs_article", ">= 10 on a GPU (the article's 10 epochs, full MNIST)", lambda r: r >= 10)


def _per_loss(m: str) -> list[Ratio]:
    """One per_loss model's ratios: against torchjd's step, against the plain step."""
    out: list[Ratio] = [
        (
            f"per_loss_{m}_{x}_over_torchjd",
            f"per_loss.{m}.gradmod_{x}",
            f"per_loss.{m}.torchjd_{x}",
            None if x in WEIGHTINGS else "<= 0.6",
            None if x in WEIGHTINGS else (lambda r: r <= 0.6),
        )
        for x in per_loss.METHODS
    ]
    out.append(
        (
            f"per_loss_{m}_modules_over_plain",
            f"per_loss.{m}.gradmod_modules",
            f"per_loss.{m}.plain",
            "<= 1.3",
            lambda r: r <= 1.3,
        )
    )
    out += [  # against the plain step on the weighting's own model instance
        (
            f"per_loss_{m}_{x}_over_plain",
            f"per_loss.{m}.gradmod_{x}",
            f"per_loss.{m}.plain_{x}",
            "<= 1.05",
            lambda r: r <= 1.05,
        )
        for x in WEIGHTINGS
    ]
    if m in GRAMIAN_OVER_PLAIN:
        t = GRAMIAN_OVER_PLAIN[m]
        out += [
            (
                f"per_loss_{m}_{x}_over_plain",
                f"per_loss.{m}.gradmod_{x}",
                f"per_loss.{m}.plain",
                f"<= {t:g}",
                lambda r: r <= t,
            )
            for x in per_loss.METHODS
            if x not in WEIGHTINGS
        ]
    out += [
        (f"per_loss_{m}_torchjd_{x}_over_plain", f"per_loss.{m}.torchjd_{x}", f"per_loss.{m}.plain", None, None)
        for x in ("upgrad", "mgda", "pcgrad")
    ]
    out += [  # torchjd's newer methods: measured, no target
        (f"per_loss_{m}_{x}_over_torchjd", f"per_loss.{m}.gradmod_{x}", f"per_loss.{m}.torchjd_{x}", None, None)
        for x in per_loss.PEERS
    ]
    # The k task gradients by k ordinary backward passes: what an exact method pays where it
    # must form them (a convolution, a Linear with more rows than features).
    return out + [
        (f"per_loss_{m}_task_backwards_over_plain", f"per_loss.{m}.task_backwards", f"per_loss.{m}.plain", None, None),
        (
            f"per_loss_{m}_upgrad_over_task_backwards",
            f"per_loss.{m}.gradmod_upgrad",
            f"per_loss.{m}.task_backwards",
            None,
            None,
        ),
    ]


def _sharpness(m: str) -> list[Ratio]:
    """Two passes are the floor of a SAM step: <= 2.05x plain; every 4th step: <= 1.3x."""
    s = f"sharpness.{m}"
    return [
        (f"sharpness_{m}_sam_over_plain", f"{s}.sam", f"{s}.plain", "<= 2.05", lambda r: r <= 2.05),
        (f"sharpness_{m}_every4_over_plain", f"{s}.sam_every4", f"{s}.plain", "<= 1.3", lambda r: r <= 1.3),
        (f"sharpness_{m}_sam_over_two_passes", f"{s}.sam", f"{s}.two_passes", None, None),
        (f"sharpness_{m}_two_passes_over_plain", f"{s}.two_passes", f"{s}.plain", None, None),
    ]


FREEZE = [  # a freeze rule's step is the hand-frozen one's: the frozen backward never runs
    (
        "freeze_resnet18_rule_over_by_hand",
        "freeze.resnet18.rule",
        "freeze.resnet18.plain",
        "<= 1.15",
        lambda r: r <= 1.15,
    ),
    ("freeze_resnet18_all_over_by_hand", "freeze.resnet18.all", "freeze.resnet18.plain", None, None),
]
ORTHOGONALIZE = [  # the same update as torch's Muon: <= 1.05x its step
    (
        f"orthogonalize_{m}_over_muon",
        f"orthogonalize.{m}.orthogonalize",
        f"orthogonalize.{m}.muon",
        "<= 1.05",
        lambda r: r <= 1.05,
    )
    for m in orthogonalize.MODELS
]
SCORES = [  # keeping each example's scores: no extra backward, <= 1.3x the plain step
    (f"scores_{m}_over_plain", f"scores.{m}.scores", f"scores.{m}.plain", "<= 1.3", lambda r: r <= 1.3)
    for m in scores.MODELS
]
PENALTY = [  # a shipped penalty against the same penalty by hand (<= 1.05x), and its cost over a plain step
    *(
        (
            f"penalty_{m}_{rule}_over_{hand}",
            f"penalty.{m}.{rule}",
            f"penalty.{m}.{hand}",
            "<= 1.05",
            lambda r: r <= 1.05,
        )
        for m in penalty.MODELS
        for rule, hand in penalty.PAIRS
    ),
    *(
        (f"penalty_{m}_{rule}_over_plain", f"penalty.{m}.{rule}", f"penalty.{m}.plain", None, None)
        for m in penalty.MODELS
        for rule, _ in penalty.PAIRS
    ),
    *(
        (f"penalty_{m}_{rule}_over_{base}", f"penalty.{m}.{rule}", f"penalty.{m}.{base}", None, None)
        for m in penalty.MODELS
        for rule, base in penalty.DP_PAIRS
    ),
]
CURVATURE = [  # one window of 100 steps and its estimate; the target is a whole run's (RUN_TARGET)
    (f"curvature_{m}_every100_over_plain", f"curvature.{m}.every100", f"curvature.{m}.plain", None, None)
    for m in curvature.MODELS
]
INFLUENCE = [  # exact TracIn influence: <= 0.5x Captum's sample-wise mode
    (
        "influence_mnist_over_captum_swg",
        "influence.mnist.gradmod",
        "influence.mnist.captum_swg",
        "<= 0.5",
        lambda r: r <= 0.5,
    ),
    (
        "influence_mnist_projected_over_captum_swg",
        "influence.mnist.projected",
        "influence.mnist.captum_swg",
        None,
        None,
    ),
]
RATIOS: list[Ratio] = [
    *MNIST,
    *PER_SAMPLE,
    *(r for m in per_loss.MODELS for r in _per_loss(m)),
    *(r for m in sharpness.MODELS for r in _sharpness(m)),
    *FREEZE,
    *ORTHOGONALIZE,
    *sam_peers.ratios(),  # each rule <= 1.05x the library's step; LookSAM at k=5 <= 1.3x a plain one
    *SCORES,
    *PENALTY,
    *CURVATURE,
    *INFLUENCE,
]
# Ratios of two contenders on one model instance, run next to each other in every repeat: a
# few percent apart, so from the repeats' own ratios (``paired_ratio``).
PAIRED = {f"per_loss_{m}_{x}_over_plain" for m in per_loss.MODELS for x in WEIGHTINGS}
PAIRED |= {f"orthogonalize_{m}_over_muon" for m in orthogonalize.MODELS}


RUN_TARGET = ("<= 1.10", lambda r: r <= 1.10)  # a whole run at every: 100 against its plain copy (curvature.run_cost)


def run_ratios(runs: dict[str, dict]) -> dict[str, dict]:
    """The ratio of each measured curvature run (``curvature.runs``): one interleaved run, not repeats."""
    target, test = RUN_TARGET
    return {
        f"curvature_{m}_run_over_plain": {
            "value": run["ratio"],
            "numerator": f"curvature.{m}.run",
            "denominator": f"curvature.{m}.plain_copy",
            "clock": "process_time",
            "paired": False,
            "target": target,
            "met": bool(test(run["ratio"])),
        }
        for m, run in runs.items()
    }


def ratios(results: dict[str, dict], device: torch.device) -> dict[str, dict]:
    """Every ratio of ``RATIOS`` whose two contenders were timed, with its target, if any."""
    out = {}
    for name, num, den, target, test in RATIOS:
        if num not in results or den not in results:
            continue
        key = clock(results[num])
        value = results[num][key] / results[den][key]
        if name in PAIRED:
            series = {"median_cpu_s": "cpu_seconds", "median_s": "seconds"}[key]
            value = paired_ratio(results[num][series], results[den][series])
        entry = {"value": value, "numerator": num, "denominator": den, "clock": key, "paired": name in PAIRED}
        if target is not None:
            entry.update(target=target, met=bool(test(value)))
        out[name] = entry
    if device.type == "cuda" and GPU_TARGET[0] in out:
        out[GPU_TARGET[0]].update(target=GPU_TARGET[1], met=bool(GPU_TARGET[2](out[GPU_TARGET[0]]["value"])))
    return out
