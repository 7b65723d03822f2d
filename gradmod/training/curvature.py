"""The curvature rule in training: every ``every`` optimizer steps, the top Hessian eigenvalues
and the trace of the training loss over the rule's parameters (``gradmod.hooks.curvature``), on a
fixed probe batch (the first ``batch`` training examples, one training batch's worth unless
given), with a line each in the log.

A rule whose one transform is ``curvature`` observes, it transforms no gradient: ``split_rules``
takes it out of the rules ``attach`` gets, so the training steps between estimates run as
without it. Each estimate is a row (step, learning rate, the groups' eigenvalues, trace, standard
error, products, residual); the epoch's record carries the latest as ``<rule>/<group>/top1...``,
``trace``, ``trace_se``, ``hvps`` and ``residual`` (so metrics.csv, TensorBoard and MLflow have
them). An estimate whose Lanczos stopped at ``iterations`` before its residual fell below ``tol``
says so in its log line. The rows live in the callback's state, so a resumed run draws all of them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from gradmod.data import as_float
from gradmod.hooks.hessian.estimate import GroupCurvature, check, curvature, select_groups
from gradmod.hooks.losses import total
from gradmod.training.callbacks import Callback

log = logging.getLogger("gradmod.curvature")

NAME = "curvature"


@dataclass(frozen=True)
class CurvatureRule:
    """One rule's settings (the transform's arguments), checked as read."""

    rule: str
    params: Any = "*"
    exclude: Any = None
    every: int = 100
    k: int = 1
    iterations: int = 20
    probes: int = 0
    per: str = "glob"
    batch: int | None = None  # None: one training batch's worth, so an estimate costs the same steps at any batch size
    tol: float = 5e-3
    mode: str = "eval"
    seed: int = 0


def split_rules(rules: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, list[CurvatureRule]]:
    """(the rules ``attach`` takes, the curvature rules): a rule holding ``curvature`` holds it alone."""
    if not rules:
        return (dict(rules) if rules is not None else None), []
    rest, found = {}, []
    for name, spec in rules.items():
        listed = _transforms(spec)
        if not any(_name(t) == NAME for t in listed):
            rest[name] = spec
            continue
        found.append(_read(name, spec, listed))
    return rest, found


def _transforms(spec: Any) -> list[Any]:
    t = spec.get("transforms") if isinstance(spec, Mapping) else None
    return [t] if isinstance(t, (str, Mapping)) else list(t) if isinstance(t, (list, tuple)) else []


def _name(t: Any) -> Any:
    return t.get("name") if isinstance(t, Mapping) else t


def _read(name: str, spec: Mapping[str, Any], listed: list[Any]) -> CurvatureRule:
    where = f"hooks.{name}"
    if len(listed) != 1:
        raise ValueError(f"{where}: curvature observes and transforms nothing; give it a rule of its own")
    others = sorted(k for k in ("modules", "active", "stage", "rows") if spec.get(k) is not None)
    if others:
        raise ValueError(
            f"{where}: a curvature rule takes params and exclude (globs); {', '.join(others)} is not allowed"
        )
    args = {k: v for k, v in (listed[0] if isinstance(listed[0], Mapping) else {}).items() if k != "name"}
    known = {f.name for f in fields(CurvatureRule)} - {"rule", "params", "exclude"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(
            f"{where}: curvature has no argument {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )
    rule = CurvatureRule(name, spec.get("params") or "*", spec.get("exclude"), **args)
    for key, what, null in (
        ("every", "optimizer steps between two estimates", ""),
        ("batch", "training examples in the probe batch", " or null (one training batch)"),
    ):
        value = getattr(rule, key)
        if value is None and null:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be an int >= 1 ({what}){null}")
    check(
        per=rule.per, k=rule.k, iterations=rule.iterations, probes=rule.probes, mode=rule.mode, tol=rule.tol, rule=name
    )
    return rule


def check_rules(rules: list[CurvatureRule], model: torch.nn.Module) -> None:
    """Each rule's globs against the model: a pattern matching nothing is one line."""
    for r in rules:
        select_groups(model, r.params, r.exclude, r.per, r.rule)


class Estimates:
    """The estimates of some curvature rules in any loop (gradmod's trainer, the Lightning and
    Transformers callbacks): ``rows``, one per estimate and group, ``{step, lr, rule, group,
    top1.., trace, trace_se, hvps, residual}``; ``latest``, each group's newest values by
    ``<rule>/<group>/<field>``; the eigenvectors that warm-start the next estimate."""

    def __init__(self, rules: list[CurvatureRule]):
        self.rules = rules
        self.rows: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}
        self._warm: dict[str, dict[str, GroupCurvature]] = {}

    def due(self, step: int) -> list[CurvatureRule]:
        return [r for r in self.rules if step % r.every == 0]

    def columns(self, model) -> dict[str, None]:
        """Every ``<rule>/<group>/<field>`` key the rules will fill, empty."""
        out = {}
        for r in self.rules:
            groups = select_groups(model, r.params, r.exclude, r.per, r.rule)
            fields_ = [
                *(f"top{i + 1}" for i in range(r.k)),
                *(("trace", "trace_se") if r.probes else ()),
                "hvps",
                "residual",
            ]
            out |= {f"{r.rule}/{g}/{f}": None for g in groups for f in fields_}
        return out

    def estimate(self, due: list[CurvatureRule], model, loss_fn, probe, step: int, lr: float, forward=None) -> dict:
        """Each rule in ``due`` on ``probe(rule)`` (its probe batch, ``(x, y)``), with
        ``loss_fn(forward(x), y)`` (``forward``: default ``model(x)``); a line each in the log;
        returns this estimate's values by ``<rule>/<group>/<field>``."""
        now = {}
        for r in due:
            began = time.perf_counter()
            got = curvature(
                model,
                loss_fn,
                probe(r),
                r.params,
                exclude=r.exclude,
                per=r.per,
                k=r.k,
                iterations=r.iterations,
                probes=r.probes,
                tol=r.tol,
                seed=r.seed + step,
                mode=r.mode,
                warm=self._warm.get(r.rule),
                rule=r.rule,
                forward=forward,
            )
            self._warm[r.rule] = got
            for group, g in got.items():
                row = {"step": step, "lr": lr, "rule": r.rule, "group": group, "hvps": g.hvps, "residual": g.residual}
                row |= {f"top{i + 1}": v for i, v in enumerate(g.eigenvalues)}
                row |= {"trace": g.trace, "trace_se": g.trace_se} if r.probes else {}
                self.rows.append(row)
                now |= {f"{r.rule}/{group}/{k}": v for k, v in row.items() if k not in _KEYS}
            log.info("%s", _line(r, step, lr, got, time.perf_counter() - began))
        self.latest |= now
        return now


class Curvature(Callback):
    """gradmod's trainer: estimates at the first step (0) and every ``every`` steps after, on the
    first ``batch`` training examples (default: one training batch's worth); ``rows`` as ``Estimates``'."""

    key = "curvature"

    def __init__(self, rules: list[CurvatureRule]):
        self.rules = rules
        self.estimates = Estimates(rules)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.estimates.rows

    def on_fit_start(self, trainer) -> None:
        self.estimates.latest = self.estimates.columns(trainer.model)
        if trainer.step == 0:
            self._estimate(trainer, list(self.rules))

    def on_step_end(self, trainer) -> None:
        due = self.estimates.due(trainer.step)
        if due:
            self._estimate(trainer, due)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        record.update(self.estimates.latest)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimates.rows = list(state.get("rows", []))

    def _estimate(self, trainer, due: list[CurvatureRule]) -> None:
        def probe(r: CurvatureRule) -> tuple[Any, Any]:
            n = r.batch or trainer.settings.batch_size
            x, y = trainer.data.train_x[:n], trainer.data.train_y[:n]
            return as_float(x.to(trainer.device)), y.to(trainer.device) if hasattr(y, "to") else y

        self.estimates.estimate(
            due,
            trainer.model,
            lambda out, target: total(trainer.tasks.losses(out, target)),
            probe,
            trainer.step,
            first_lr(trainer.optimizer),
        )


def first_lr(optimizer) -> float:
    """The first parameter group's learning rate (NaN without one)."""
    return next((float(g["lr"]) for g in getattr(optimizer, "param_groups", ()) if "lr" in g), math.nan)


_KEYS = ("step", "lr", "rule", "group")


def _line(r: CurvatureRule, step: int, lr: float, got: Mapping[str, GroupCurvature], seconds: float) -> str:
    """``curvature at step 200 (2/lr 20): * top 12.3, trace 512 +- 30; 14 products in 0.8 s``; a group
    whose residual stayed above ``tol``: ``* top 12.3 (not converged in 20 Lanczos steps: residual 0.012 of
    the value, tol 0.005)``."""
    parts = []
    for group, g in got.items():
        text = f"{group} top {', '.join(f'{v:.4g}' for v in g.eigenvalues)}"
        if g.residual > r.tol:
            text += f" (not converged in {r.iterations} Lanczos steps: residual {g.residual:.2g} of the value, tol {r.tol:g})"
        if g.trace is not None:
            text += f", trace {g.trace:.4g} +- {g.trace_se:.2g}"
        parts.append(text)
    hvps = sum(g.hvps for g in got.values())
    edge = f" (2/lr {2 / lr:.4g})" if lr > 0 else ""
    return f"{r.rule} at step {step}{edge}: {'; '.join(parts)}; {hvps} products in {seconds:.2f} s"
