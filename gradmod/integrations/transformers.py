"""gradmod's hook rules inside Hugging Face Transformers' ``Trainer``: ``GradmodCallback``.

In a Trainer step: backward per micro-batch (hook-stage rules run here), unscaling and
HF's own ``max_grad_norm`` clipping, ``on_pre_optimizer_step`` (the fused stage runs
here, once per optimizer step under gradient accumulation), ``optimizer.step()``. The
rules are attached at ``on_train_begin`` and removed at ``on_train_end``; their state
(zclip's running statistics, ``log`` buffers) travels in HF checkpoints.

HF calls user callbacks after its reporting integrations and gives them no Trainer:
``add_to(trainer, rules)`` puts the callback first, so the ``grad/<tensor>/<field>``
entries its ``on_log`` adds reach ``report_to`` and ``state.log_history``; the console
gets one line per log instead of them (``ConsoleLine``).

A curvature rule is estimated, not attached (``gradmod.integrations.curvature_probe``): on the first
``inputs`` dict the model is called with, its loss the model's own (the output's ``loss``);
each estimate makes HF log at its step, its values joining that log; the one before the first
step is logged through the Trainer (``Trainer.log``, which ``add_to`` gives the callback). Its rows
and probe batch travel in checkpoints with the rules' state.
Needs ``pip install "gradmod[transformers]"``.
"""

from __future__ import annotations

import math
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from gradmod.hooks import HookSet, load_rules, stages
from gradmod.integrations.curvature_probe import Probe
from gradmod.integrations.support import attach_for, flat_stats, refuse_private, sources, stats_line

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback
except ImportError as e:  # the optional extra is missing
    raise ImportError(
        'gradmod.integrations.transformers needs Transformers: pip install "gradmod[transformers]"'
    ) from e

# model -> the callbacks training it, to warn when several would share HF's checkpoint entry.
_TRAINING: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet] = weakref.WeakKeyDictionary()


class GradmodCallback(TrainerCallback, ExportableState):
    """Apply gradmod rules to a Trainer's model: a mapping, a ``hooks/*.yaml`` path, a
    shipped file's name (``"log"``) or a list of these merged by rule name.

    ``stage``: the default stage of rules that set none (``hook`` or ``fused``).
    ``log_every``: steps between reads of the ``log`` statistics at HF's log events
    (default: ``logging_steps``); each read is one host sync. ``total_steps``,
    ``steps_per_epoch``: the run's length for schedules and windows in ``dur`` or ``ep``
    (default: HF's ``max_steps`` and its steps per epoch). The step clock is HF's
    ``global_step``, so a resumed train continues the schedules. A curvature rule's
    estimates are ``curvature_rows``.
    """

    def __init__(
        self,
        rules: Mapping[str, Any] | str | Path | list,
        stage: str = stages.DEFAULT,
        log_every: int | None = None,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
    ):
        self.rules, self.stage, self.log_every = load_rules(rules), stage, log_every
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        refuse_private("Transformers' Trainer", self.rules, stage)  # at add_to, not at train()
        self.sources = sources(rules)  # for the line that refuses two callbacks on one tensor
        self.hooks: HookSet | None = None
        self.rule_state: dict[str, Any] = {}  # HF sets it from a checkpoint (JSON-ready form)
        self.curvature_state: dict[str, Any] = {}  # likewise: the curvature rows and probe batch
        self.probe = Probe(self.rules)
        self._trainer: Callable[[], Any] = lambda: None  # add_to's Trainer (weakly), to log step 0
        self._logging_step0 = False
        self._pending: dict[str, Any] = {}  # curvature values for the next log
        self._catch: Any = None  # the forward pre-hook that keeps the first inputs

    @property
    def curvature_rows(self) -> list[dict[str, Any]]:
        """One row per curvature estimate and group: ``{step, lr, rule, group, top1.., trace, trace_se, hvps, residual}``."""
        return self.probe.estimates.rows

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._detach(model)  # a train() that raised never reached on_train_end
        peers = {cb.sources: cb.hooks for cb in _TRAINING.get(model, ()) if cb is not self and cb.hooks is not None}
        max_steps = getattr(state, "max_steps", None)
        total = self.total_steps or (max_steps if max_steps and max_steps > 0 else None)
        per_epoch = self.steps_per_epoch
        epochs = math.ceil(getattr(state, "num_train_epochs", 0) or 0)
        if per_epoch is None and total and epochs and total % epochs == 0:
            per_epoch = total // epochs
        self.probe.check(model)
        rest = self.probe.rest  # the curvature rules are estimated, not attached
        hooks = attach_for(
            "Transformers' Trainer", model, rest, self.stage, args.fp16, (self.sources, peers), total, per_epoch
        )
        if any(stages.get(s.name).in_place for s in hooks.stages) and args.max_grad_norm and args.max_grad_norm > 0:
            warnings.warn(
                f"max_grad_norm={args.max_grad_norm}: HF clips the gradients before gradmod's fused "
                "rules see them; set max_grad_norm=0 to leave clipping to the rules",
                stacklevel=2,
            )
        self.hooks = hooks
        if self.rule_state:
            hooks.load_state_dict(_from_json(self.rule_state), next(model.parameters()).device)
            self.rule_state = {}
        self._restore_curvature(state)
        _warn_shared_checkpoint(self, model, args)
        if self.probe and self.probe.batch is None:
            self._catch = model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _restore_curvature(self, state) -> None:
        if self.curvature_state:
            self.probe.load_state_dict(_from_json(self.curvature_state))
            self.curvature_state = {}
        elif self.probe and state.global_step > 0 and not self.probe.estimates.rows:
            warnings.warn(
                f"resuming at step {state.global_step} without the curvature rows before it: "
                "TrainingArguments(restore_callback_states_from_checkpoint=True) restores them and the probe batch",
                stacklevel=3,
            )

    def _keep(self, module, args, kwargs) -> None:
        """The Trainer's first call ``model(**inputs)``: its inputs are the probe batch."""
        self.probe.keep(dict(kwargs))
        self._catch.remove()
        self._catch = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.hooks is not None and self.hooks.timed:
            self.hooks.set_step(int(state.global_step))  # accumulated micro-batches share it

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.hooks is not None and self.hooks.needs_after_backward:
            _unscale_once(optimizer)
            self.hooks.after_backward()
        if self.probe and state.global_step == 0:  # the weights before the first optimizer step
            now = self._curvature(state, model, optimizer)
            if now:  # no log event comes at step 0: a log of its own
                self._log_step0(state, now)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        now = self._curvature(state, model, optimizer) if self.probe else {}
        if now:
            self._pending |= now
            control.should_log = True  # HF logs at the estimate's step; on_log adds its values

    def _log_step0(self, state, now: dict[str, Any]) -> None:
        """Through ``Trainer.log`` (``log_history`` and every callback's ``on_log``, so ``report_to``'s
        integrations); without add_to's Trainer, a ``log_history`` record only."""
        trainer = self._trainer()
        if trainer is None:
            state.log_history.append({**now, "step": 0})
            return
        self._logging_step0 = True  # on_log passes these values through, reading no rule statistics
        try:
            trainer.log(dict(now))
        finally:
            self._logging_step0 = False

    def _curvature(self, state, model, optimizer) -> dict[str, Any]:
        return self.probe.run(model, _own_loss, state.global_step, optimizer, lambda b: (b, None), lambda b: model(**b))

    def on_log(self, args, state, control, logs=None, **kwargs):
        every = self.log_every or state.logging_steps
        if logs is None or self._logging_step0:
            return
        flat, self._pending = dict(self._pending), {}
        if self.hooks is not None and self.hooks.observers() and not state.global_step % every:
            flat |= flat_stats(self.hooks)
        if not flat:
            return
        logs.update(flat)  # the dict the reporting integrations receive after this callback
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(flat)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._detach(model)

    def _detach(self, model) -> None:
        if self.hooks is not None:
            self.rule_state = _to_json(self.hooks.state_dict())
            self.hooks.remove()
            self.hooks = None
        if self._catch is not None:
            self._catch.remove()
            self._catch = None
        if model in _TRAINING:
            _TRAINING[model].discard(self)

    def state(self) -> dict[str, Any]:
        """What HF saves in ``trainer_state.json`` and restores (only with
        ``restore_callback_states_from_checkpoint=True``) as ``GradmodCallback(**args)``."""
        live = _to_json(self.hooks.state_dict()) if self.hooks is not None else self.rule_state
        return {
            "args": {
                "rules": _to_json(self.rules),
                "stage": self.stage,
                "log_every": self.log_every,
                "total_steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch,
            },
            "attributes": {"rule_state": live, "curvature_state": self._curvature_json()},
        }

    def _curvature_json(self) -> dict[str, Any]:
        if not self.probe:
            return {}
        return self.curvature_state or _to_json(self.probe.state_dict())  # restored, not yet applied: as it came


def add_to(
    trainer,
    rules: Mapping[str, Any] | str | Path | list,
    stage: str = stages.DEFAULT,
    log_every: int | None = None,
    total_steps: int | None = None,
    steps_per_epoch: int | None = None,
) -> GradmodCallback:
    """A ``GradmodCallback`` placed first in ``trainer``'s callbacks, before the reporting
    integrations, so its ``grad/...`` entries reach them; also after a checkpoint restore,
    which HF does by re-creating the callback at the end of the list."""
    callback = GradmodCallback(rules, stage, log_every, total_steps, steps_per_epoch)
    callback._trainer = weakref.ref(trainer)
    trainer.callback_handler.callbacks.insert(0, callback)
    _before_printer(trainer.callback_handler.callbacks, ConsoleLine())
    load = getattr(trainer, "_load_callback_state", None)
    if load is not None and not getattr(load, "keeps_gradmod_first", False):

        def load_then_put_first() -> None:
            load()
            handler = trainer.callback_handler
            ours = [cb for cb in handler.callbacks if isinstance(cb, GradmodCallback)]
            for cb in ours:  # HF's restore made them anew
                cb._trainer = weakref.ref(trainer)
            handler.callbacks = ours + [cb for cb in handler.callbacks if not isinstance(cb, GradmodCallback)]

        load_then_put_first.keeps_gradmod_first = True
        trainer._load_callback_state = load_then_put_first
    return callback


class ConsoleLine(TrainerCallback):
    """Just before HF's printer (``ProgressCallback`` or ``PrinterCallback``): the
    ``grad/...`` entries leave the dict it prints (``report_to``'s integrations and the
    callbacks before this one have had them; ``log_history`` keeps them), and one line
    says what was logged where, instead of a dict of thousands of characters per log."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        grads = {key: logs.pop(key) for key in [k for k in (logs or {}) if k.startswith("grad/")]}
        if grads and state.is_world_process_zero:
            tqdm.write(stats_line(grads, state.global_step, args.report_to))


def _before_printer(callbacks: list, line: ConsoleLine) -> None:
    printers = [i for i, cb in enumerate(callbacks) if isinstance(cb, (ProgressCallback, PrinterCallback))]
    if not any(isinstance(cb, ConsoleLine) for cb in callbacks):
        callbacks.insert(printers[0] if printers else len(callbacks), line)


def _own_loss(output: Any, _: Any) -> Any:
    """The loss a curvature rule estimates under HF: the model's own, its output's ``loss``."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError("curvature under Transformers' Trainer: the model returns no loss; give its inputs labels")
    return loss


def _unscale_once(optimizer) -> None:
    """fp16: unscale the gradients unless HF's clipping already did (releases before
    5.x skip it with max_grad_norm=0); the scaler then skips its own unscale."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    inner = optimizer.optimizer
    from torch.amp.grad_scaler import OptState

    if scaler._per_optimizer_states[id(inner)]["stage"] is OptState.READY:
        scaler.unscale_(inner)


def _warn_shared_checkpoint(callback: GradmodCallback, model, args) -> None:
    peers = _TRAINING.setdefault(model, weakref.WeakSet())
    peers.add(callback)
    if len(peers) > 1 and args.save_strategy != "no":
        warnings.warn(
            "Transformers' checkpoints restore the state of one GradmodCallback per Trainer only; "
            "give one callback several rule sources instead, e.g. GradmodCallback(['zclip', 'log'])",
            stacklevel=3,
        )


def _to_json(value: Any) -> Any:
    """Rules and their state in a form ``json`` writes: plain dicts and lists, tensors as
    dtype and nested lists (exact for float32 and float64 through Python floats)."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value
