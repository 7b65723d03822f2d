"""Iteration counts and step sizes of the per_loss methods and sharpness transforms: a value
that would hang a step, overflow it or make it nan is one line when the rule is built,
naming the argument, the value and what is allowed; the bounds themselves are accepted."""

from __future__ import annotations

import math
import time

import pytest
from torch import nn

from gradmod.hooks import attach
from gradmod.hooks.validators import LOG_START, LOG_STEP, MAX_COUNT, MAX_STEP

COUNT = f"a whole number from 1 to {MAX_COUNT}"  # an iteration count a step runs through
PERIOD = "a whole number from 1 to 9007199254740992"  # every so many steps (2**53)
STEP = f"a number > 0.0 and <= {MAX_STEP}"  # a step size that must move
COEF = f"a number >= 0.0 and <= {MAX_STEP}"  # a step size or coefficient that may be 0
SAM = f">= 0 and <= {MAX_STEP}"  # a sharpness transform's step
LOG = f"a number >= 0.0 and <= {LOG_STEP}"  # an Adam step on log-scales
START = f"a number >= {-LOG_START} and <= {LOG_START}"  # a log-scale's start

# (transform and its other arguments, the argument, its bad value, what the message allows)
TABLE = [
    ({"name": "sdmgrad"}, "n_iter", 1e308, COUNT),  # hung the first step
    ({"name": "sdmgrad"}, "n_iter", math.inf, COUNT),  # int(inf): a traceback
    ({"name": "sdmgrad"}, "n_iter", 10**5, COUNT),  # half a millisecond each: a minute a step
    ({"name": "sdmgrad"}, "n_iter", 2.5, COUNT),
    ({"name": "mgda"}, "max_iters", math.inf, COUNT),
    ({"name": "nash_mtl"}, "optim_niter", 1e308, COUNT),
    ({"name": "fairgrad", "alpha": 1.0}, "max_iters", math.inf, COUNT),
    ({"name": "nash_mtl"}, "update_weights_every", math.inf, PERIOD),
    ({"name": "excess_mtl"}, "n_warmup_steps", 1e308, "a whole number from 0 to 9007199254740992"),
    ({"name": "krum", "n_byzantine": 0}, "n_selected", 1.5, PERIOD),
    ({"name": "trimmed_mean"}, "trim_number", math.inf, "a whole number from 0 to 9007199254740992"),
    ({"name": "sdmgrad"}, "lr", math.inf, STEP),  # nan weights at the first step
    ({"name": "sdmgrad"}, "lambda_", 1e308, COEF),
    ({"name": "modo"}, "gamma", math.inf, STEP),
    ({"name": "modo"}, "rho", math.inf, COEF),
    ({"name": "excess_mtl"}, "robust_step_size", math.inf, STEP),
    ({"name": "excess_mtl"}, "robust_step_size", 1e308, STEP),
    ({"name": "famo"}, "lr", math.inf, COEF),
    ({"name": "famo"}, "weight_decay", math.inf, COEF),
    ({"name": "cagrad"}, "c", 1e308, COEF),  # c**2 overflowed: a traceback
    ({"name": "cosmos", "lambda_": 1.0, "weights": [0.5, 0.5]}, "lambda_", math.inf, COEF),
    ({"name": "pbi", "theta": 1.0, "weights": [0.5, 0.5]}, "theta", 1e308, COEF),
    ({"name": "imtll"}, "lr", math.inf, LOG),
    ({"name": "imtll"}, "lr", 1e308, LOG),  # exp of the log-scale overflowed: a traceback
    ({"name": "imtll"}, "init", 1e308, START),
    ({"name": "uw"}, "lr", 1e308, LOG),
    ({"name": "uw"}, "init", -1e308, START),
    ({"name": "sam", "rho": 0.05}, "every", math.inf, PERIOD),
    ({"name": "looksam", "rho": 0.05}, "k", 1e308, PERIOD),
    ({"name": "sam"}, "rho", 1e308, SAM),  # nan parameters at the first step
    ({"name": "asam", "rho": 0.5}, "eta", 1e308, SAM),
    ({"name": "friendly_sam"}, "sigma", 1e308, SAM),  # too large for a float32 scalar: a traceback
    ({"name": "gsam", "lr_max": 1.0}, "rho_min", math.inf, SAM),
]


def _rule(spec: dict) -> dict:
    return {"r": {"params": "*", "transforms": [spec]}}


@pytest.mark.parametrize("spec, arg, value, allowed", TABLE, ids=lambda v: v["name"] if isinstance(v, dict) else str(v))
def test_a_bad_count_or_step_is_one_line_when_the_rule_is_built(spec, arg, value, allowed):
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        attach(nn.Linear(4, 3), _rule({**spec, arg: value}))
    msg = str(e.value)
    assert "\n" not in msg and f"'{spec['name']}'" in msg
    assert f"{arg}={value!r} must be " in msg and msg.endswith(allowed), msg
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "sdmgrad", "n_iter": MAX_COUNT, "lr": MAX_STEP, "lambda_": MAX_STEP},
        {"name": "sdmgrad", "n_iter": 20.0},  # a sweep's float of whole value
        {"name": "mgda", "max_iters": MAX_COUNT},
        {"name": "modo", "gamma": MAX_STEP, "rho": 0.0},
        {"name": "imtll", "lr": LOG_STEP, "init": -LOG_START},
        {"name": "uw", "lr": 0.0, "init": LOG_START},
        {"name": "krum", "n_byzantine": 0, "n_selected": 2.0},
        {"name": "sam", "rho": MAX_STEP, "every": 10**9},
        {"name": "friendly_sam", "sigma": MAX_STEP},
    ],
    ids=lambda s: s["name"],
)
def test_the_bounds_themselves_are_accepted(spec):
    attach(nn.Linear(4, 3), _rule(spec)).remove()
