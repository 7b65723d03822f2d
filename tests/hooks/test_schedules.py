"""Schedules, times and windows (gradmod.hooks.schedules) against hand computations, the
DANN formula and torch's learning-rate schedulers, which define the same curves."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler

from gradmod.hooks.schedules import Length, Time, parse_active, parse_schedule, parse_time

L = Length(steps_per_epoch=10, total_steps=100)


def sched(**spec):
    return parse_schedule(spec, "hooks.r.transforms.0.x")


@pytest.mark.parametrize(
    "text, steps",
    [("500ba", 500), ("2ep", 20), ("0.5dur", 50), (7, 7), ("1.5ep", 15), ("0dur", 0), ("1e2ba", 100)],
)
def test_times_become_steps(text, steps):
    assert parse_time(text, "x").steps(L) == steps


def test_values_by_hand():
    # t = 25 of 100 steps: p = 0.25
    assert sched(schedule="constant", start=3.0).value(57, L) == 3.0
    assert sched(schedule="linear", start=5.0, end=1.0).value(25, L) == 4.0
    assert sched(schedule="linear", start=5.0, end=1.0, until="50ba").value(25, L) == 3.0  # p = 0.5
    assert sched(schedule="linear", start=5.0, end=1.0, until="50ba").value(80, L) == 1.0  # clamped
    assert sched(schedule="linear", start=5.0, end=1.0, **{"from": "1ep"}).value(5, L) == 5.0  # before from
    # cosine at p = 0.5: the midpoint; at p = 0: start; at p = 1: end
    c = sched(schedule="cosine", start=0.1, end=0.0)
    assert c.value(0, L) == 0.1 and c.value(50, L) == pytest.approx(0.05, abs=1e-15) and c.value(100, L) == 0.0
    # exp: 1.5 * 0.5 ** floor((t - 0) / 10)
    e = sched(schedule="exp", start=1.5, gamma=0.5, every="1ep")
    assert [e.value(t, L) for t in (0, 9, 10, 19, 20, 35)] == [1.5, 1.5, 0.75, 0.75, 0.375, 0.1875]
    e2 = sched(schedule="exp", start=2.0, gamma=0.5, every=4, **{"from": 10})
    assert [e2.value(t, L) for t in (0, 9, 10, 13, 14)] == [2.0, 2.0, 2.0, 2.0, 1.0]
    # step: gamma ** milestones reached
    s = sched(schedule="step", start=1.0, gamma=0.1, milestones=["1ep", 30])
    assert [s.value(t, L) for t in (0, 9, 10, 29, 30)] == [1.0, 1.0, 0.1, 0.1, pytest.approx(0.01)]


def test_dann_is_the_papers_ramp():
    """lambda_p = 2 / (1 + exp(-10 p)) - 1, from 0 at p = 0 towards 1, scaled to [start, end]."""
    d = sched(schedule="dann", start=0.0, end=-1.0)
    for t in range(0, 101, 7):
        p = t / 100
        assert d.value(t, L) == pytest.approx(-(2 / (1 + math.exp(-10 * p)) - 1), abs=1e-15)
    assert d.value(0, L) == 0.0
    assert d.value(100, L) == pytest.approx(-0.9999092, abs=1e-7)  # 2/(1+e^-10)-1 by hand
    g = sched(schedule="dann", start=1.0, end=3.0, gamma=5, until="50ba")
    assert g.value(25, L) == pytest.approx(1.0 + 2.0 * (2 / (1 + math.exp(-2.5)) - 1))


def lrs(make, steps):
    """The learning rates a torch scheduler gives for steps 0..steps-1 (base rate 1)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    s = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    return out


def test_curves_equal_torchs_schedulers():
    cos = sched(schedule="cosine", start=1.0, end=0.1, until=40)
    ref = lrs(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=40, eta_min=0.1), 41)
    assert [cos.value(t, L) for t in range(41)] == pytest.approx(ref, abs=1e-12)
    lin = sched(schedule="linear", start=1.0, end=0.25, until=30)
    ref = lrs(lambda o: lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=30), 35)
    assert [lin.value(t, L) for t in range(35)] == pytest.approx(ref, abs=1e-12)
    ex = sched(schedule="exp", start=1.0, gamma=0.7, every=3)
    ref = lrs(lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.7), 20)
    assert [ex.value(t, L) for t in range(20)] == pytest.approx(ref, rel=1e-12)
    st = sched(schedule="step", start=1.0, gamma=0.5, milestones=[4, 9])
    ref = lrs(lambda o: lr_scheduler.MultiStepLR(o, milestones=[4, 9], gamma=0.5), 15)
    assert [st.value(t, L) for t in range(15)] == pytest.approx(ref, rel=1e-12)


def test_windows_are_half_open():
    w = parse_active({"from": "2ep", "until": "5ep"}, "hooks.r.active")
    inside = [t for t in range(100) if w.contains(t, L)]
    assert inside == list(range(20, 50))
    assert [t for t in range(5) if parse_active({"until": 3}, "a").contains(t, L)] == [0, 1, 2]
    assert all(parse_active({"from": "0.9dur"}, "a").contains(t, L) == (t >= 90) for t in range(120))


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"schedule": "warmup", "start": 1}, ["schedule='warmup'", "allowed: constant, linear"]),
        ({"schedule": "linear", "start": 1, "end": 0, "from": 50, "until": 10}, ["until=10ba", "after from=50ba"]),
        ({"schedule": "exp", "start": 1, "gamma": 0.5, "every": -2}, ["every=-2", "> 0"]),
        ({"schedule": "exp", "start": 1, "gamma": 0.5, "every": "0ep"}, ["every='0ep'", "> 0"]),
        ({"schedule": "linear", "start": 1}, ["needs end"]),
        ({"schedule": "linear", "start": 1, "end": 0, "max": 3}, ["unknown key(s) max", "allowed: start, end"]),
        ({"schedule": "linear", "start": "a", "end": 0}, ["start='a'", "finite number"]),
        ({"schedule": "linear", "start": 1, "end": 0, "until": "3 weeks"}, ["until='3 weeks'", "2ep"]),
        ({"schedule": "step", "start": 1, "milestones": "1ep"}, ["milestones='1ep'", "list of times"]),
    ],
)
def test_bad_schedules_are_one_line(spec, words):
    with pytest.raises(ValueError) as e:
        parse_schedule(spec, "hooks.r.transforms.0.x")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("hooks.r.transforms.0.x")
    for w in words:
        assert w in msg


@pytest.mark.parametrize(
    "spec, length, words",
    [
        ({"schedule": "linear", "start": 1, "end": 0}, Length(), ["end of the run", "total_steps"]),
        ({"schedule": "linear", "start": 1, "end": 0, "until": "2ep"}, Length(total_steps=5), ["steps_per_epoch"]),
        ({"schedule": "exp", "start": 1, "gamma": 0.5, "every": "1ep"}, Length(), ["every=1ep", "steps_per_epoch"]),
        ({"schedule": "step", "start": 1, "milestones": ["0.5dur"]}, Length(10), ["milestones.0", "total_steps"]),
        ({"schedule": "linear", "start": 1, "end": 0, "from": "1ep", "until": 5}, L, ["until (5 steps)", "from (10"]),
    ],
)
def test_units_the_run_does_not_know_are_refused(spec, length, words):
    with pytest.raises(ValueError) as e:
        parse_schedule(spec, "w").check(length, "w")
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "spec, length, words",
    [
        ({"schedule": "exp", "start": 1.0, "gamma": 1e308}, Length(total_steps=6), ["gamma=1e+308", "inf at step 2"]),
        ({"schedule": "exp", "start": -2.0, "gamma": 1e200, "every": 3}, Length(total_steps=9), ["-inf at step 6"]),
        ({"schedule": "step", "start": 1.0, "gamma": 1e300, "milestones": [2, 4]}, Length(), ["inf at step 4"]),
        ({"schedule": "linear", "start": -1e308, "end": 1e308, "until": 4}, Length(), ["nan at step 0"]),
    ],
)
def test_a_value_beyond_a_floats_range_is_one_line(spec, length, words):
    """Not an OverflowError from deep inside the first step: refused where the run's length is known."""
    with pytest.raises(ValueError) as e:
        parse_schedule(spec, "hooks.r.transforms.0.x").check(length, "hooks.r.transforms.0.x")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("hooks.r.transforms.0.x: ") and "beyond a float's range" in msg
    for w in words:
        assert w in msg
    ok = parse_schedule({"schedule": "exp", "start": 1.0, "gamma": 1e308}, "x")
    ok.check(Length(total_steps=1), "x")  # 1e308 at the clock's last reading, step 1: finite
    assert ok.value(1, Length()) == 1e308


def test_constant_exp_and_step_in_steps_need_no_length():
    for spec in (
        {"schedule": "constant", "start": 1},
        {"schedule": "exp", "start": 1, "gamma": 0.5, "every": 10},
        {"schedule": "step", "start": 1, "milestones": [5]},
        {"schedule": "linear", "start": 1, "end": 0, "until": 20},
    ):
        parse_schedule(spec, "x").check(Length(), "x")


def test_bad_windows():
    with pytest.raises(ValueError, match=r"^hooks.f.active: until=1ep must be after from=2ep$"):
        parse_active({"from": "2ep", "until": "1ep"}, "hooks.f.active")
    with pytest.raises(ValueError, match="unknown key"):
        parse_active({"start": 1}, "hooks.f.active")
    with pytest.raises(ValueError, match="steps_per_epoch"):
        parse_active({"from": "1ep"}, "hooks.f.active").check(Length(), "hooks.f.active")
    assert str(parse_active({"from": "1ep"}, "a")) == "[1ep, end)"
    assert str(Time(2.0, "ep")) == "2ep"
