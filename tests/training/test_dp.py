"""DP-SGD in the trainer: Poisson sampling, the per_sample stage's divisor and accumulation,
privacy accounting against independent accountants, model.norm, and ``+hooks=dp`` runs.

The per-example reference is ``torch.func`` (``vmap(grad)``); epsilon is checked against
Google's ``dp-accounting`` RDP accountant when installed, and always against a hand-written
RDP of the sampled Gaussian mechanism at integer orders.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_FAKE, compose_config, free_port, spawn_ranks
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks import attach
from gradmod.models import build_model
from gradmod.training.callbacks import Callback
from gradmod.training.loader import poisson_batches, poisson_steps
from gradmod.training.trainer import Trainer, TrainerSettings

try:
    import opacus  # noqa: F401
except ImportError:
    opacus = None
# Accounting needs Opacus (the privacy extra); sampling, the stage and the models do not.
needs_opacus = pytest.mark.skipif(opacus is None, reason="the privacy extra: pip install 'gradmod[privacy]'")

NO_NOISE = "hooks.dp.transforms=[{name: per_sample_clip, max_norm: 1.0}]"


# -- Poisson sampling ------------------------------------------------------------------------


def _labels(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n)


def test_poisson_batches_draw_each_example_independently_with_rate_q():
    n, q, steps = 200, 0.05, 600
    x, y = _labels(n)
    drawn = [yb for _, yb in poisson_batches(x, y, q, steps, torch.Generator().manual_seed(0))]
    assert len(drawn) == steps and all(len(b.unique()) == len(b) for b in drawn)
    sizes = torch.tensor([len(b) for b in drawn], dtype=torch.float64)
    # Batch size ~ Binomial(n, q): mean n q, variance n q (1 - q) (a fixed-size sampler has none).
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert 0.7 < sizes.var() / (n * q * (1 - q)) < 1.3
    counts = torch.bincount(torch.cat(drawn), minlength=n).double()  # each ~ Binomial(steps, q)
    assert abs(counts.mean() - steps * q) < 0.5
    assert 0.7 < counts.var() / (steps * q * (1 - q)) < 1.3


def test_poisson_shards_splits_resume_and_loader_path_agree():
    x, y = _labels(50)
    state = torch.Generator().manual_seed(3).get_state()

    def draw(**kw):
        g = torch.Generator()
        g.set_state(state)
        return [yb for _, yb in poisson_batches(x, y, 0.2, 4, g, **kw)]

    whole = draw()
    ranks = [draw(part=(r, 2)) for r in range(2)]
    for s, batch in enumerate(whole):  # the ranks split every global batch between them
        assert sorted(torch.cat([ranks[0][s], ranks[1][s]]).tolist()) == sorted(batch.tolist())
    split = draw(split=3)  # accumulation: the step's one Poisson batch in three parts
    assert len(split) == 12
    assert all(torch.equal(torch.cat(split[3 * s : 3 * s + 3]), whole[s]) for s in range(4))
    assert all(torch.equal(a, b) for a, b in zip(draw(split=3, start=5), split[5:], strict=True))  # resumed mid-epoch
    assert all(torch.equal(a, b) for a, b in zip(draw(loader_workers=0), whole, strict=True))  # host-memory path
    assert poisson_steps(60, 10) == (1 / 6, 6) and poisson_steps(60, 5, world=2, accumulate=3) == (0.5, 2)


# -- the per_sample stage in the Trainer -----------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _data(n: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g) * 2, torch.randint(0, 3, (n,), generator=g)


def _dp_rules(noise: float = 0.0, max_norm: float = 0.3) -> dict:
    return {
        "dp": {
            "params": "*",
            "transforms": [{"name": "per_sample_clip", "max_norm": max_norm, "noise_multiplier": noise}],
        }
    }


class _Grads(Callback):
    """The gradients the optimizer steps on (after the per_sample stage)."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer) -> bool:
        self.seen.append([p.grad.clone() for p in trainer.model.parameters()])  # None: no gradient, a failure
        return False


def _train(model, *, batch_size: int, accumulate: int = 1, noise: float = 0.0, sampling: str = "poisson", callbacks=()):
    x, y = _data()
    hooks = attach(model, _dp_rules(noise))
    settings = TrainerSettings(batch_size=batch_size, accumulate=accumulate, sampling=sampling, log_every=2**62)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        settings,
        hooks=hooks,
        callbacks=list(callbacks),
        generator=torch.Generator().manual_seed(7),
    )
    trainer.train_epoch(x, y)
    hooks.remove()
    return trainer


def test_poisson_step_is_clipped_sum_over_expected_batch_size():
    model, grads = _model(), _Grads()
    _train(model, batch_size=8, callbacks=[grads])
    ref = _model()  # hand computation: the same masks, per-example gradients by torch.func
    x, y = _data()
    q, steps = poisson_steps(len(y), 8)
    g = torch.Generator().manual_seed(7)
    params = {k: v.detach() for k, v in ref.named_parameters()}
    loss = lambda p, xi, yi: F.cross_entropy(functional_call(ref, p, (xi[None],)), yi[None])  # noqa: E731
    sizes = []
    for s in range(steps):
        idx = (torch.rand(len(y), generator=g) < q).nonzero().flatten()
        sizes.append(len(idx))
        per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[idx], y[idx])
        norms = torch.stack([v.flatten(1).square().sum(1) for v in per.values()]).sum(0).sqrt()
        factor = (0.3 / (norms + 1e-6)).clamp(max=1.0)
        want = {k: torch.einsum("b,b...->...", factor, v) / 8 for k, v in per.items()}  # / expected, not len(idx)
        for got, (k, w) in zip(grads.seen[s], want.items()):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6, msg=f"step {s} {k}")
        with torch.no_grad():
            for k, p in params.items():
                p -= 0.5 * want[k]
    assert any(n != 8 for n in sizes)  # the divisor is the expected batch, not the count drawn


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_accumulation_under_poisson_equals_one_large_batch(noise):
    # Same q = 8/40 per step: one Poisson batch per step, split in two micro-batches; the
    # noise is drawn once per step, so even with noise the runs agree.
    torch.manual_seed(11)
    whole = _model()
    torch.manual_seed(11)
    _train(whole, batch_size=8, noise=noise)
    parts = _model()
    torch.manual_seed(11)
    _train(parts, batch_size=4, accumulate=2, noise=noise)
    for p, q in zip(whole.parameters(), parts.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_empty_poisson_step_still_adds_noise():
    # q = 1/20 over 20 examples: some steps draw nobody; the step must still release noise
    # (a step without an update would tell that the batch was empty).
    x, y = _data(20)
    g = torch.Generator().manual_seed(7)
    sizes = [int((torch.rand(20, generator=g) < 0.05).sum()) for _ in range(20)]
    assert 0 in sizes
    model, grads = _model(), _Grads()
    hooks = attach(model, _dp_rules(noise=1.0))
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerSettings(batch_size=1, sampling="poisson"),
        hooks=hooks,
        callbacks=[grads],
        generator=torch.Generator().manual_seed(7),
    ).train_epoch(x, y)
    hooks.remove()
    assert len(grads.seen) == 20
    for n, step in zip(sizes, grads.seen):
        assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in step), f"a step of {n} examples"


def test_noise_std_is_sigma_c_over_expected_batch():
    # Zero input: every per-example gradient of the first layer's weight is 0, so its
    # gradient is pure noise N(0, (sigma C / B)^2) with B the expected batch size.
    model = nn.Linear(50, 40, bias=False)
    x, y = torch.zeros(100, 50), torch.randint(0, 40, (100,))
    hooks = attach(model, _dp_rules(noise=2.0, max_norm=0.5))
    grads = _Grads()
    settings = TrainerSettings(batch_size=25, sampling="poisson")
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        settings,
        hooks=hooks,
        callbacks=[grads],
        generator=torch.Generator().manual_seed(0),
    )
    trainer.train_epoch(x, y)
    hooks.remove()
    sample = torch.cat([g[0].flatten() for g in grads.seen])  # 4 steps x 2000 draws
    assert abs(sample.mean()) < 4 * 0.04 / math.sqrt(len(sample))
    assert sample.std().item() == pytest.approx(2.0 * 0.5 / 25, rel=0.05)


# -- accounting ------------------------------------------------------------------------------


def _rdp_integer_orders(sigma: float, q: float, steps: int, delta: float) -> float:
    """Mironov, Talwar and Zhang (2019): the sampled Gaussian's RDP at integer orders a,
    log A_a = log sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)), converted
    to (epsilon, delta) as in Balle et al. (2020)."""
    best = math.inf
    for a in range(2, 256):
        terms = [
            math.lgamma(a + 1)
            - math.lgamma(k + 1)
            - math.lgamma(a - k + 1)
            + (a - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * sigma**2)
            for k in range(a + 1)
        ]
        top = max(terms)
        rdp = steps * (top + math.log(sum(math.exp(t - top) for t in terms))) / (a - 1)
        eps = rdp - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        best = min(best, eps)
    return best


@needs_opacus
@pytest.mark.parametrize("sigma,q,steps", [(1.1, 1 / 6, 12), (1.0, 0.01, 1000), (2.0, 0.004, 2500)])
def test_epsilon_matches_independent_accountants(sigma, q, steps):
    from gradmod.training.privacy import PrivacyCallback

    cb = PrivacyCallback("rdp", 1e-5, sigma, q)
    for _ in range(steps):
        cb.on_step_end(None)
    eps = cb.epsilon()
    hand = _rdp_integer_orders(sigma, q, steps, 1e-5)
    assert eps <= hand * (1 + 1e-9) and hand < eps * 1.03  # Opacus also tries fractional orders
    try:
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError:
        return
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


@needs_opacus
def test_prv_epsilon_matches_a_privacy_loss_distribution():
    from gradmod.training.privacy import PrivacyCallback

    sigma, q, steps = 1.0, 0.01, 1000
    prv, rdp = PrivacyCallback("prv", 1e-5, sigma, q), PrivacyCallback("rdp", 1e-5, sigma, q)
    for _ in range(steps):
        prv.on_step_end(None)
        rdp.on_step_end(None)
    eps = prv.epsilon()
    assert eps < rdp.epsilon()  # the tighter accountant
    restored = PrivacyCallback("prv", 1e-5, sigma, q)
    restored.load_state_dict(prv.state_dict())
    assert restored.accountant.history == prv.accountant.history and restored.steps == steps
    try:
        import dp_accounting
        from dp_accounting.pld import pld_privacy_accountant
    except ImportError:
        return
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert eps == pytest.approx(pld.get_epsilon(1e-5), rel=0.02)


def test_accountant_missing_is_one_line(monkeypatch):
    import sys

    from gradmod.training.privacy import make_accountant

    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    with pytest.raises(ValueError, match=r"^a per_sample rule adds noise.*pip install \"gradmod\[privacy\]\""):
        make_accountant("rdp")


@needs_opacus
def test_per_sample_refused_under_other_strategies():
    from gradmod.app.config_store import validate
    from gradmod.run import dp

    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp"))
    cfg.trainer.strategy = "fsdp"  # a strategy the per_sample stage does not know
    with pytest.raises(
        ValueError,
        match=r"^hooks.dp: the per_sample stage runs under trainer.strategy=single\|ddp "
        r"only, not fsdp$",
    ):
        dp.check(cfg)


# -- model.norm ------------------------------------------------------------------------------


def test_group_norm_resnet_has_no_batchnorm_and_the_same_parameters():
    group = build_model("resnet18", 3, 10, 32, norm="group")
    batch = build_model("resnet18", 3, 10, 32, norm="batch")
    norms = [m for m in group.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in group.modules())
    assert all(m.num_groups == min(32, m.num_channels) for m in norms)
    assert [(n, p.shape) for n, p in group.named_parameters()] == [(n, p.shape) for n, p in batch.named_parameters()]


# -- through train.py ------------------------------------------------------------------------


def _run(out, *overrides):
    from gradmod.app.cli import run

    summary = run(compose_config(*TINY_FAKE, *overrides), out)
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


RESUMABLE_DP = ["+hooks=dp", "trainer.checkpoint_every_steps=4", "trainer.checkpoint_keep=10"]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """An uninterrupted ``+hooks=dp`` run: 2 epochs of 6 Poisson steps, a checkpoint every 4."""
    out = tmp_path_factory.mktemp("dp")
    return out, *_run(out, *RESUMABLE_DP)


@needs_opacus
def test_dp_run_reports_epsilon_per_epoch_and_in_the_summary(dp_run):
    from opacus.accountants import RDPAccountant

    _, summary, metrics = dp_run
    block = summary["privacy"]
    assert set(block) == {"epsilon", "delta", "accountant", "noise_multiplier", "sample_rate", "steps", "history"}
    assert block["history"] == [[1.1, pytest.approx(10 / 60), 12]]
    assert (block["accountant"], block["delta"], block["noise_multiplier"]) == ("rdp", 1e-5, 1.1)
    assert block["sample_rate"] == pytest.approx(10 / 60) and block["steps"] == summary["steps"] == 12
    for record in metrics:  # epsilon after every epoch: the accountant over the steps so far
        acc = RDPAccountant()
        acc.history = [(1.1, 10 / 60, record["step"])]
        assert record["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert metrics[0]["epsilon"] < metrics[1]["epsilon"] == pytest.approx(block["epsilon"])


@needs_opacus
def test_resumed_dp_run_equals_uninterrupted(tmp_path, dp_run):
    full_dir, full, full_metrics = dp_run
    first = full_dir / "checkpoints" / "step-000000004.pt"
    resumed, metrics = _run(tmp_path, *RESUMABLE_DP, f"trainer.resume={first}")
    assert resumed["resumed_from"] == str(first)
    assert resumed["privacy"] == full["privacy"]
    assert [m["epsilon"] for m in metrics] == [m["epsilon"] for m in full_metrics]
    a, b = torch.load(full_dir / "model.pt"), torch.load(tmp_path / "model.pt")
    for k in a:  # the same Poisson batches and the same noise after the resume
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@needs_opacus
def test_target_epsilon_fills_the_rules_noise():
    from opacus.accountants import RDPAccountant

    from gradmod.app.config_store import validate
    from gradmod.run import dp

    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp", NO_NOISE, "privacy.target_epsilon=2", "trainer.epochs=3"))
    rules, privacy = dp.prepare(cfg, train_size=1000, world_size=1)
    assert (privacy.rule, privacy.sample_rate, privacy.steps) == ("dp", 0.01, 300)
    assert rules["dp"]["transforms"] == [
        {"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": privacy.noise_multiplier}
    ]
    assert cfg.hooks["dp"]["transforms"][0].get("noise_multiplier") is None  # the config itself is left alone
    eps = []
    for sigma in (privacy.noise_multiplier, privacy.noise_multiplier * 0.98):
        acc = RDPAccountant()
        acc.history = [(sigma, 0.01, 300)]
        eps.append(acc.get_epsilon(1e-5))
    assert 1.95 < eps[0] <= 2.0 < eps[1]  # the smallest multiplier that fits (Opacus' bisection, within 0.01)


@needs_opacus
@pytest.mark.slow
def test_target_epsilon_picks_the_noise_multiplier(tmp_path):
    from opacus.accountants import RDPAccountant

    summary, _ = _run(tmp_path, "+hooks=dp", NO_NOISE, "privacy.target_epsilon=4")
    block = summary["privacy"]
    assert 3.95 < block["epsilon"] <= 4.0  # Opacus' bisection stops within 0.01 below the target
    less = RDPAccountant()  # a little less noise would overshoot: the multiplier is the smallest that fits
    less.history = [(block["noise_multiplier"] * 0.98, 10 / 60, 12)]
    assert less.get_epsilon(1e-5) > 4.0


@needs_opacus
def test_resnet18_with_group_norm_trains_privately(tmp_path):
    summary, _ = _run(
        tmp_path,
        "+hooks=dp",
        "model=resnet18",
        "model.norm=group",
        "data.channels=3",
        "data.image_size=16",
        "data.train_size=8",
        "data.test_size=4",
        "data.batch_size=4",
        "trainer.epochs=1",
        "trainer.checkpoint_every=0",
    )
    assert summary["status"] == "ok" and summary["privacy"]["steps"] == 2
    assert math.isfinite(summary["train_loss"])


# -- DDP: 2 gloo processes -------------------------------------------------------------------


def _ddp_dp_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    from gradmod.training.distributed.strategy import Dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        for sampling, accumulate in (("poisson", 1), ("poisson", 2), ("shuffle", 1)):
            model = _model()
            hooks = attach(model, _dp_rules(noise=1.0))
            net = dist.wrap(model)
            calls = []  # DDP's bucketed all-reduce: must never run (it would average unclipped gradients)
            net.register_comm_hook(calls, _counting_allreduce)
            torch.manual_seed(11)  # the noise's generator: rank 0 draws, as a single process would
            x, y = _data()
            settings = TrainerSettings(
                batch_size=4 // accumulate, accumulate=accumulate, sampling=sampling, log_every=2**62
            )
            trainer = Trainer(
                model,
                torch.optim.SGD(model.parameters(), lr=0.5),
                settings,
                hooks=hooks,
                dist=dist,
                net=net,
                generator=torch.Generator().manual_seed(7),
            )
            trainer.train_epoch(x, y)
            hooks.remove()
            torch.save(
                {"params": [p.detach() for p in model.parameters()], "calls": len(calls), "steps": trainer.step},
                os.path.join(out, f"{sampling}{accumulate}_rank{rank}.pt"),
            )
    finally:
        dist.close()


def _counting_allreduce(calls: list, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls.append(1)
    return allreduce_hook(None, bucket)


@pytest.mark.slow
def test_ddp_sums_clipped_gradients_over_ranks_and_draws_noise_once(tmp_path):
    # 2 ranks with per-rank batch 4 = one process with batch 8: the same Poisson (or shuffled)
    # examples per step, (sum of their clipped gradients + one noise draw) / 8.
    spawn_ranks(_ddp_dp_worker, 2, free_port(), str(tmp_path))
    for sampling, accumulate in (("poisson", 1), ("poisson", 2), ("shuffle", 1)):
        ranks = [torch.load(tmp_path / f"{sampling}{accumulate}_rank{r}.pt") for r in range(2)]
        single = _model()
        torch.manual_seed(11)
        trainer = _train(single, batch_size=8, noise=1.0, sampling=sampling)
        assert ranks[0]["steps"] == trainer.step == 5 and ranks[0]["calls"] == ranks[1]["calls"] == 0
        for p, a, b in zip(single.parameters(), ranks[0]["params"], ranks[1]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # every rank holds the same parameters
            torch.testing.assert_close(a, p.detach(), rtol=1e-5, atol=1e-6, msg=f"{sampling} accumulate={accumulate}")


@needs_opacus
@pytest.mark.slow
def test_torchrun_dp_run(tmp_path):
    """``torchrun --nproc_per_node=2 train.py trainer.strategy=ddp +hooks=dp``: rank 0's summary
    accounts the global sample rate."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    port = free_port()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(port),
        str(ROOT / "train.py"),
        "trainer.strategy=ddp",
        "+hooks=dp",
        f"hydra.run.dir={run_dir}",
        *TINY_FAKE,
        "data.batch_size=5",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    block = json.loads((run_dir / "summary.json").read_text())["privacy"]
    assert block["sample_rate"] == pytest.approx(10 / 60) and block["steps"] == 12


# -- a privacy claim is true or absent --------------------------------------------------------


@needs_opacus
@pytest.mark.parametrize("target, words", [(1e308, "bounds nothing"), (1e-9, "unreachable")])
def test_a_target_epsilon_out_of_reach_is_one_line_in_under_a_second(target, words):
    import time

    from gradmod.training.privacy import noise_for_epsilon

    start = time.perf_counter()
    with pytest.raises(ValueError, match=words) as err:
        noise_for_epsilon(target, 1e-5, 0.01, 1000, "rdp")
    assert time.perf_counter() - start < 1.0 and "\n" not in str(err.value)


@needs_opacus
def test_target_epsilon_replaces_the_shipped_noise_and_says_so(caplog):
    from gradmod.app.config_store import validate
    from gradmod.run import dp

    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp", "privacy.target_epsilon=3"))
    dp.check(cfg)
    with caplog.at_level("INFO"):
        rules, privacy = dp.prepare(cfg, train_size=60, world_size=1)
    assert rules["dp"]["transforms"][0]["noise_multiplier"] == privacy.noise_multiplier != 1.1
    assert "replacing hooks.dp's noise_multiplier=1.1" in caplog.text
    assert "privacy.delta=1e-05 is not below" not in caplog.text
    small = validate(compose_config(*TINY_FAKE, "+hooks=dp", "privacy.delta=0.05"))
    with caplog.at_level("WARNING"):
        dp.prepare(small, train_size=60, world_size=1)
    assert "privacy.delta=0.05 is not below 1 / training set size (60 examples)" in caplog.text


@needs_opacus
def test_the_accountant_composes_steps_of_different_noise_and_rate():
    from opacus.accountants import RDPAccountant

    from gradmod.training.privacy import PrivacyCallback

    cb = PrivacyCallback("rdp", 1e-5, 1.1, 0.1)
    for _ in range(5):
        cb.on_step_end(None)
    cb.noise_multiplier, cb.sample_rate = 0.8, 0.05
    for _ in range(7):
        cb.on_step_end(None)
    ref = RDPAccountant()
    ref.history = [(1.1, 0.1, 5), (0.8, 0.05, 7)]
    assert cb.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12) and cb.steps == 12


@needs_opacus
def test_a_resume_that_would_make_the_claim_false_is_refused():
    from gradmod.training.privacy import PrivacyCallback

    cb = PrivacyCallback("rdp", 1e-5, 1.1, 0.1)
    with pytest.raises(ValueError, match="4 steps ran without noise"):
        cb.on_missing_state(4)
    cb.on_missing_state(0)  # a fresh start has nothing to account
    state = PrivacyCallback("prv", 1e-5, 1.1, 0.1).state_dict()
    with pytest.raises(ValueError, match="privacy accountant was 'prv', this run's is 'rdp'"):
        cb.load_state_dict(state)
    for key, value in (("delta", 1e-6), ("sampling", "shuffle")):
        with pytest.raises(ValueError, match=f"privacy {key} was"):
            cb.load_state_dict({**cb.state_dict(), key: value})
    with pytest.raises(ValueError, match="steps without noise"):
        cb.load_state_dict({**cb.state_dict(), "history": [[0.0, 0.1, 3]]})


@needs_opacus
def test_a_target_run_extended_keeps_its_noise_and_says_the_target_is_exceeded():
    from gradmod.hooks.per_sample.stats import PerSampleClip
    from gradmod.training.privacy import PrivacyCallback

    first = PrivacyCallback("rdp", 1e-5, 0.9, 0.1, target_epsilon=3.0)
    for _ in range(200):
        first.on_step_end(None)
    clip = PerSampleClip(1.0, 1.2)  # the extended plan's (larger) noise
    again = PrivacyCallback("rdp", 1e-5, 1.2, 0.1, target_epsilon=3.0, clip=clip)
    again.load_state_dict(first.state_dict())
    assert again.noise_multiplier == clip.noise_multiplier == 0.9
    for _ in range(200):
        again.on_step_end(None)
    block = again.summary()
    assert block["target_epsilon"] == 3.0 and block["target_exceeded"] == (block["epsilon"] > 3.0)
    assert block["noise_multiplier"] == 0.9


def test_interrupted_and_diverged_endings_carry_the_epsilon_spent():
    from gradmod.run.folder.endings import summary_of
    from gradmod.training.nonfinite import Diverged

    error = Diverged("loss nan", step=3)
    error.privacy = {"epsilon": 1.5, "steps": 3}
    assert summary_of(error, 1.0)["privacy"] == {"epsilon": 1.5, "steps": 3}
    assert "privacy" not in summary_of(Diverged("loss nan", step=3), 1.0)


@needs_opacus
def test_resuming_a_run_without_noise_under_a_target_is_refused(tmp_path):
    from gradmod.app.cli import run

    _run(tmp_path / "plain", "+hooks=dp", NO_NOISE, "trainer.checkpoint_every_steps=4", "trainer.epochs=1")
    first = tmp_path / "plain" / "checkpoints" / "step-000000004.pt"
    with pytest.raises(ValueError, match="4 steps ran without noise"):
        run(
            compose_config(*TINY_FAKE, "+hooks=dp", NO_NOISE, "privacy.target_epsilon=3", f"trainer.resume={first}"),
            tmp_path / "resumed",
        )


def test_dp_plots_show_per_example_norms_and_the_fraction_of_examples_clipped(tmp_path, monkeypatch):
    from gradmod.hooks.per_sample.stats import ClipRecord
    from gradmod.reporting import plots

    record = ClipRecord()
    record.add_norms(torch.tensor([0.5, 2.0, 3.0]), 1.0)
    record.add_norms(torch.tensor([4.0]), 1.0)
    calls, window = record.take()
    stats = ClipRecord.summarize(calls, window.tolist())
    assert stats == {"frac_clipped": 0.75, "examples": 4, "calls": 2, "norm_mean": 2.375, "norm_max": 4.0}
    seen = []
    monkeypatch.setattr(
        plots,
        "_finish",
        lambda fig, axes, path: seen.append([(ax.get_title(), ax.get_ylabel(), len(ax.lines)) for ax in axes]),
    )
    rows = [(1, {"dp/per_sample_clip": stats}), (2, {"dp/per_sample_clip": stats})]
    plots.plot_grad_norms(rows, tmp_path / "a.png")
    plots.plot_frac_clipped(rows, tmp_path / "b.png")
    (norms,), (clipped,) = seen
    assert norms[1] == "per-example gradient L2 norm" and norms[2] == 2  # mean and max
    assert clipped[1] == "fraction of examples clipped" and clipped[2] == 1


@needs_opacus
def test_bf16_and_tensorboard_with_a_dp_rule(tmp_path):
    pytest.importorskip("tensorboard")
    summary, metrics = _run(
        tmp_path, "+hooks=dp", "trainer.precision=bf16", "logger=tensorboard", "trainer.epochs=1", "trainer.log_every=2"
    )
    assert summary["status"] == "ok" and summary["precision"] == "bf16"
    assert summary["privacy"]["epsilon"] == pytest.approx(metrics[-1]["epsilon"])
    assert summary["privacy"]["epsilon"] > 0


def test_model_norm_group_replaces_a_target_models_batchnorm():
    pytest.importorskip("torchvision")
    from gradmod.run.config import ModelConfig
    from gradmod.run.factories import model_factory

    cfg = ModelConfig(name="target", _target_="torchvision.models.resnet18", norm="group", args={"num_classes": 3})
    model = model_factory(cfg, None)()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 20


@needs_opacus
def test_each_epoch_of_a_dp_run_says_its_epsilon_on_the_console(caplog):
    from gradmod.training.privacy import PrivacyCallback

    cb = PrivacyCallback("rdp", 1e-5, 1.1, 0.1)
    for _ in range(10):
        cb.on_step_end(None)
    record = {"epoch": 1}
    with caplog.at_level("INFO", logger="gradmod.training.privacy"):
        cb.on_epoch_end(None, record)
    assert f"epoch 1: epsilon {record['epsilon']:.4f} at delta 1e-05 after 10 steps (rdp accountant)" in caplog.text


# -- a scheduled noise multiplier ---------------------------------------------------------------

EXP_NOISE = "hooks.dp.transforms.0.noise_multiplier={schedule: exp, start: 1.5, gamma: 0.5, every: 1ep}"


@needs_opacus
def test_a_noise_schedule_reaches_the_accountant_step_by_step(tmp_path):
    """Epoch 1 at sigma 1.5, epoch 2 at 0.75: epsilon is Opacus' RDP accountant over that history."""
    from opacus.accountants import RDPAccountant

    summary, metrics = _run(tmp_path, "+hooks=dp", EXP_NOISE)
    q = summary["privacy"]["sample_rate"]
    for epoch, record in enumerate(metrics, start=1):
        acc = RDPAccountant()
        acc.history = [(1.5, q, 6), (0.75, q, 6)][:epoch]
        assert record["epsilon"] == acc.get_epsilon(1e-5)  # exactly: the same history
    assert metrics[-1]["grad_stats"]["dp/per_sample_clip.noise_multiplier"] == {"value": 0.75}


@needs_opacus
def test_a_target_epsilon_scales_a_noise_schedule():
    from opacus.accountants import RDPAccountant

    from gradmod.app.config_store import validate
    from gradmod.run import dp

    steps = "hooks.dp.transforms.0.noise_multiplier={schedule: step, start: 2.0, gamma: 0.7, milestones: [1ep, 2ep]}"
    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp", steps, "privacy.target_epsilon=3", "trainer.epochs=3"))
    rules, privacy = dp.prepare(cfg, train_size=1000, world_size=1)
    sched = rules["dp"]["transforms"][0]["noise_multiplier"]
    scale = sched["start"] / 2.0
    assert sched["milestones"] == ["1ep", "2ep"] and len(privacy.sigmas) == 300
    assert privacy.sigmas[0] == sched["start"] and privacy.sigmas[150] == pytest.approx(scale * 2.0 * 0.7)

    def eps(k: float) -> float:
        acc = RDPAccountant()
        acc.history = [(s * k, 0.01, 100) for s in (privacy.sigmas[0], privacy.sigmas[100], privacy.sigmas[200])]
        return acc.get_epsilon(1e-5)

    assert 2.99 <= eps(1.0) <= 3.0 < eps(0.98)  # the smallest scale that fits, within 0.01


def test_a_noise_schedule_that_reaches_zero_is_refused():
    from gradmod.app.config_store import validate
    from gradmod.run import dp

    to_zero = "hooks.dp.transforms.0.noise_multiplier={schedule: linear, start: 1.0, end: 0.0, until: 6}"
    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp", to_zero))
    with pytest.raises(ValueError, match=r"^hooks.dp.noise_multiplier: the schedule reaches 0 at step 6; every"):
        dp.prepare(cfg, train_size=60, world_size=1)
    smooth = "hooks.dp.transforms.0.noise_multiplier={schedule: cosine, start: 2.0, end: 1.0}"
    cfg = validate(compose_config(*TINY_FAKE, "+hooks=dp", smooth, "trainer.epochs=20"))
    with pytest.raises(ValueError, match=r"cosine schedule gives 120 distinct noise multipliers .* use exp or step"):
        dp.prepare(cfg, train_size=60, world_size=1)


FROM_ZERO = [
    "{schedule: dann, start: 0.0, end: 1.0}",
    "{schedule: linear, start: 0.0, end: 1.0}",
    "{schedule: cosine, start: 0.0, end: 1.0}",
    "{schedule: step, start: 0.0, gamma: 2.0, milestones: [1ep]}",
]


@pytest.mark.parametrize("schedule", FROM_ZERO, ids=lambda s: s.split(",")[0].split()[-1])
def test_a_noise_schedule_that_starts_at_zero_is_refused_before_training(tmp_path, schedule):
    """Its first steps would get no noise: no privacy claim holds, so the run is refused, not
    trained without an epsilon."""
    from gradmod.app.cli import run

    with pytest.raises(ValueError) as e:
        run(compose_config(*TINY_FAKE, "+hooks=dp", f"hooks.dp.transforms.0.noise_multiplier={schedule}"), tmp_path)
    assert str(e.value) == (
        "hooks.dp.noise_multiplier: the schedule reaches 0 at step 0; every step needs noise > 0 "
        "for a privacy claim (start the schedule above 0)"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_attach_refuses_a_noise_schedule_that_starts_at_zero():
    """In a loop of one's own too: the first steps would get no noise and later ones would,
    and the rule would escape the check that the noise covers every trained parameter."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    ramp = {"schedule": "linear", "start": 0.0, "end": 1.0, "until": 10}
    rule = {"params": "0.*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": ramp}]}
    with pytest.raises(
        ValueError,
        match=r"^hooks.dp: per_sample_clip's noise_multiplier=linear\(start=0, end=1, "
        r"until=10ba\) is 0 at the first step, .* \(start the schedule above 0",
    ):
        attach(model, {"dp": rule})
    ramp["start"] = 0.5  # noisy from the first step: then every trained parameter must be in the rule
    with pytest.raises(ValueError, match=r"^hooks.dp: with noise every trained parameter must be in that rule"):
        attach(model, {"dp": rule})
    rule["params"] = "*"
    attach(model, {"dp": rule}).remove()
