"""`log` statistics computed together (gradmod.hooks.stats.rows): each row against torch's own
reductions of its tensor, and the same bits in both stages and however pairs are batched."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach
from gradmod.hooks.stats.rows import BIG, stat_rows
from gradmod.testing.opcount import OpCounter

CLAMP = {"name": "clamp", "min": -1e-4, "max": 1e-4}


def _reference(t: torch.Tensor, before: torch.Tensor | None = None) -> list[float]:
    x = t.double().flatten()
    n = x.numel()
    finite = torch.isfinite(x)
    changed = 0.0
    if before is not None:
        b = before.double().flatten()
        changed = float(((x != b) & ~(x.isnan() & b.isnan())).sum()) / n
    return [
        float(x.norm()),
        float(x.min()),
        float(x.max()),
        float(x.mean()),
        float((x < 0).sum()) / n,
        float((~finite).sum()),
        changed,
    ]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(4, 8, generator=g),
        torch.randn(4, 8, generator=g),
        torch.randn(7, generator=g),
        torch.randn(3, 3, 2, generator=g),
        torch.randn(BIG + 5, generator=g),
        torch.randn(5, generator=g),
    ]
    ts[1][0, 0], ts[3][1, 1, 1], ts[4][7] = math.inf, math.nan, -math.inf
    return ts


def _close(got: list[float], want: list[float]) -> bool:
    return all(
        (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6) for a, b in zip(got, want)
    )


def test_each_row_matches_torch_on_the_tensor_alone():
    ts = _tensors()
    rows, order, _ = stat_rows(ts)
    assert sorted(order) == list(range(len(ts)))
    for i, row in zip(order, rows.tolist()):
        assert _close(row, _reference(ts[i])), (i, row, _reference(ts[i]))
    exact = [[float(ts[i].min()), float(ts[i].max())] for i in order]  # min and max exactly (nan as nan)
    assert str([row[1:3] for row in rows.tolist()]) == str(exact)


def test_pairs_together_give_the_bits_of_pre_then_post_apart_and_count_changes():
    before = _tensors()
    after = [t.clamp(-0.5, 0.5) for t in before]
    together, order, _ = stat_rows(before + after, paired=True)
    pre, pre_order, seen = stat_rows(before, keep="ref")
    post, post_order, _ = stat_rows(after, before=seen)
    apart = dict(zip(pre_order, pre.unbind(0))) | {len(before) + i: r for i, r in zip(post_order, post.unbind(0))}
    for i, row in zip(order, together.unbind(0)):
        assert torch.equal(row.view(torch.int32), apart[i].view(torch.int32)), i  # bits, nan included
    for i, row in zip(post_order, post.tolist()):
        assert _close(row, _reference(after[i], before[i]))
        assert row[6] > 0  # the clamp changed entries of every tensor


def test_changes_count_nan_to_nan_as_none_on_every_path():
    """A big tensor, a same-shape pair and a single: nan kept, nan made, nan replaced, -0.0 to 0.0."""
    before = [torch.randn(BIG + 3), torch.randn(4, 8), torch.randn(4, 8), torch.randn(5)]
    after = [t.clone() for t in before]
    for b, a in zip(before, after):
        flat_b, flat_a = b.view(-1), a.view(-1)
        flat_b[0], flat_a[0] = math.nan, math.nan  # no change
        flat_a[1] = math.nan  # a change
        flat_b[2], flat_a[2] = math.nan, 1.0  # a change
        flat_b[3], flat_a[3] = -0.0, 0.0  # equal: no change
    rows, order, _ = stat_rows(before + after, paired=True)
    n = len(before)
    for i, row in zip(order, rows.tolist()):
        if i >= n:
            assert row[6] * after[i - n].numel() == pytest.approx(2), i
            assert _close(row, _reference(after[i - n], before[i - n]))


@pytest.mark.parametrize("finite", [True, False])
def test_without_host_reads_the_rows_are_the_same_bits(monkeypatch, finite):
    """CUDA's path (no value read back: every non-finite pass taken) against the CPU's (one
    read, the passes only when a min or max is not finite): the same bits, changes included."""
    from gradmod.hooks.mesh import devices

    before = _tensors() if not finite else [t.nan_to_num(0.0, 0.0, 0.0) for t in _tensors()]
    after = [t.clamp(-0.5, 0.5) for t in before]
    calls = {"single": lambda: stat_rows(before), "paired": lambda: stat_rows(before + after, paired=True)}
    read = {k: f() for k, f in calls.items()}
    monkeypatch.setattr(devices, "_ACCELERATOR_PATHS", [True])  # the core treats the CPU as CUDA
    for name, f in calls.items():
        with OpCounter() as ops:
            rows, order, _ = f()
        assert not any("item" in op or "_local_scalar" in op for op in ops.by_op), name
        assert order == read[name][1]
        assert torch.equal(rows.view(torch.int32), read[name][0].view(torch.int32)), name


def test_finite_values_whose_sums_overflow_count_no_non_finite_entry():
    """Rows of huge finite values sum to inf: the exact passes run, and find nothing."""
    ts = [torch.full((4, 8), 3e38), torch.full((4, 8), -3e38), torch.full((BIG + 1,), 3e38)]
    rows, order, _ = stat_rows(ts + [t.clamp(-1e38, 1e38) for t in ts], paired=True)
    for i, row in zip(order, rows.tolist()):
        assert row[5] == 0, i
        assert row[6] == (1.0 if i >= len(ts) else 0.0), i  # every entry clamped


class Mixed(nn.Module):
    """A big weight, same-shape small tensors, and small tensors alone in their shape."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(200, 200)  # 40,000 entries: reduced alone
        self.a = nn.Linear(200, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)  # b's and c's weights and biases: one shape each
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.c(torch.relu(self.b(torch.relu(self.a(torch.relu(self.big(x))))))))


@pytest.mark.parametrize("transforms", [["log"], ["log", CLAMP, "log"]])
def test_both_stages_report_the_same_bits_on_every_path(transforms):
    torch.manual_seed(0)
    model = Mixed()
    stats = {}
    for stage in ("hook", "fused"):
        m = copy.deepcopy(model)
        with attach(m, {"watch": {"params": "*", "transforms": transforms}}, stage=stage) as hooks:
            for seed in range(3):
                g = torch.Generator().manual_seed(seed)
                x, y = torch.randn(8, 200, generator=g), torch.randint(0, 3, (8,), generator=g)
                m.zero_grad(set_to_none=True)
                scale = torch.ones(3) if seed != 1 else torch.tensor([1.0, math.inf, 1.0])  # inf in one step
                F.cross_entropy(m(x) * scale, y).backward()
                hooks.after_backward()
            stats[stage] = hooks.read_stats()
    assert repr(stats["hook"]) == repr(stats["fused"])  # every number to the last digit, nan as nan
    assert any(s["nonfinite"] > 0 for s in stats["hook"].values())
    if len(transforms) > 1:
        assert stats["hook"]["big.weight/post"]["frac_clipped"] > 0


def test_reading_many_windows_together_gives_each_windows_own_bits():
    """``take_all`` folds the ``log`` windows of one length together; each result equals the
    window's own ``take()`` exactly (nan, histograms, a compacted window, an empty one, a
    window of another kind)."""
    import copy

    from gradmod.hooks.fused.group import NormRecord
    from gradmod.hooks.per_loss.record import TaskRecord
    from gradmod.hooks.stats.grad_stats import GradStats, take_all

    g = torch.Generator().manual_seed(0)
    windows: list = []
    for calls in (3, 3, 1, 0, 3, 7, GradStats.COMPACT_AT + 4):
        w = GradStats()
        for c in range(calls):
            t = torch.randn(5, 4, generator=g)
            if len(windows) == 1 and c == 1:
                t[0, 0] = math.nan
            w.observe(t)
        windows.append(w)
    windows[4].observe_histogram(torch.randn(50, generator=g))
    record = NormRecord()
    record.add(torch.tensor(2.0), torch.tensor(0.5))
    record.add(torch.tensor(3.0), torch.tensor(1.0))
    windows.append(record)
    tasks = TaskRecord()  # no rows of its own: a running sum
    tasks.add(["a", "b"], torch.tensor([[4.0, 1.0], [1.0, 9.0]], dtype=torch.float64), torch.tensor([0.4, 0.6]))
    windows.append(tasks)
    alone = [w.take() for w in copy.deepcopy(windows)]
    together = take_all(windows)
    assert [c for c, _ in together] == [c for c, _ in alone] == [3, 3, 1, 0, 3, 7, GradStats.COMPACT_AT + 4, 2, 1]
    for (_, a), (_, b) in zip(alone, together):
        assert (a is None) == (b is None)
        if a is not None:  # exactly equal, nan where nan (its payload aside)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert all(w.calls == 0 for w in windows)  # every window starts afresh


def test_windows_of_batches_read_together_give_each_windows_own_bits():
    """Rows kept as references into their batch's block (``add_from``): windows that saw the
    same batches, one that missed a step (another batch), one past ``COMPACT_AT``: the same
    bits read together as each alone."""
    import copy

    from gradmod.hooks.stats.grad_stats import GradStats, observe_batch, take_all

    g = torch.Generator().manual_seed(0)
    windows = [GradStats() for _ in range(4)]
    for step in range(5):
        seen = windows if step != 2 else windows[:3]  # the last misses a step
        ts = [torch.randn(3, 4, generator=g) for _ in seen[:-1]] + [torch.randn(BIG + 1, generator=g)]
        ts[0][0, 0] = math.nan if step == 3 else ts[0][0, 0]
        observe_batch(seen, ts)
    long = GradStats()
    for _ in range(GradStats.COMPACT_AT + 3):
        observe_batch([long], [torch.randn(5, generator=g)])
    windows.append(long)
    alone = [w.take() for w in copy.deepcopy(windows)]
    together = take_all(windows)
    assert [c for c, _ in together] == [c for c, _ in alone] == [5, 5, 5, 4, GradStats.COMPACT_AT + 3]
    for (_, a), (_, b) in zip(alone, together):  # exactly equal, nan where nan (its payload aside)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert math.isnan(together[0][1][1]) and not math.isnan(together[1][1][1])  # the nan stays its own
