"""The checkpoint callback: save every N epochs and/or steps, restore before ``fit``.

A checkpoint holds the model, the Trainer's state (position in the data order, optimizer,
GradScaler, history), the hooks' state (``log`` buffers in progress), every callback's
``state_dict`` under its key, the RNG states, the config and the hook plan.
``gradmod.run.folder.checkpoint_file`` writes and verifies the files.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.training.callbacks import Callback

log = logging.getLogger(__name__)

FORMAT = 2


class Checkpointer(Callback):
    """Writes ``folder/step-*.pt`` every ``every_epochs`` epochs (and at the last) and every
    ``every_steps`` optimizer steps, keeping the newest ``keep``. ``writes=False`` (ranks
    > 0) saves nothing: rank 0 holds the same state (under FSDP2, gathered from every
    rank). ``config``: the run's config (a dict) saved with each checkpoint; ``run``: the
    run id in each file's header, so that pruning keeps this run's newest ``keep`` and
    never touches another run's files.
    ``started``: the ``time.perf_counter()`` at which this process began the run; with the
    seconds a restored checkpoint carries, ``seconds()`` is the run's time over all its processes."""

    def __init__(
        self,
        folder: Path,
        *,
        every_epochs: int = 1,
        every_steps: int = 0,
        keep: int = 2,
        epochs: int = 0,
        config: Any = "",
        plan: Any = None,
        writes: bool = True,
        run: str | None = None,
        started: float | None = None,
    ):
        self.folder, self.every_epochs, self.every_steps, self.keep = Path(folder), every_epochs, every_steps, keep
        self.epochs, self.config, self.plan, self.writes, self.run = epochs, config, plan, writes, run
        self.started = time.perf_counter() if started is None else started
        self.seconds_before = 0.0  # the earlier processes' time, up to the restored checkpoint

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started

    def on_step_end(self, trainer) -> None:
        if self.every_steps and trainer.step % self.every_steps == 0:
            self.save(trainer)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        epoch = record["epoch"]
        if self.every_epochs and (epoch % self.every_epochs == 0 or epoch == self.epochs):
            self.save(trainer)

    def save(self, trainer) -> Path | None:
        """Write a checkpoint (FSDP2: every rank must call, to gather the full state to rank 0)."""
        sharded = trainer.dist.strategy == "fsdp"
        if not self.writes and not sharded:
            return None
        model, position = trainer.dist.model_state(trainer.model), trainer.state_dict()
        if not self.writes:
            return None
        state = {
            "format": FORMAT,
            "model": model,
            "trainer": position,
            "hooks": trainer.hooks.state_dict() if trainer.hooks is not None else {},
            "callbacks": {cb.key: cb.state_dict() for cb in trainer.callbacks},
            "rng": ckpt.rng_state(),
            "config": self.config,
            "hook_plan": self.plan,
            "seconds": self.seconds(),
            "world_size": trainer.dist.world_size,
        }
        state["step"] = state["trainer"]["step"]
        path = ckpt.save(self.folder, state, self.keep, run=self.run)
        log.debug("checkpoint %s (epoch %d, batch %d)", path, state["trainer"]["epoch"], state["trainer"]["batch"])
        return path

    def restore_from(self, trainer, found: tuple[Path, dict[str, Any]] | None) -> Path | None:
        """Load a checkpoint ``(path, state)`` found by ``checkpoint.find``; None: start fresh."""
        if found is None:
            return None
        path, state = found
        if state.get("format") != FORMAT:
            raise ValueError(
                f"trainer.resume: {path} was written by another gradmod version "
                f"(format {state.get('format')}, this one reads {FORMAT}); start a new run"
            )
        if state.get("hook_plan") != self.plan:
            log.warning("resuming from %s, whose hook plan differs from this run's", path)
        try:  # every state before any file is written: a misfit refuses the resume cleanly
            trainer.dist.load_model_state(trainer.model, state["model"])
            trainer.load_state_dict(state["trainer"])
            if trainer.hooks is not None:
                trainer.hooks.load_state_dict(state["hooks"], trainer.device)
            for cb in trainer.callbacks:
                if cb.key in state["callbacks"]:
                    cb.load_state_dict(state["callbacks"][cb.key])
                else:  # a callback this run added: it may refuse what the earlier steps did without it
                    cb.on_missing_state(state["trainer"]["step"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(
                f"trainer.resume: {path} does not fit this run's model, optimizer, scheduler or "
                f"rules ({type(e).__name__}: {' '.join(str(e).split())})"
            ) from None
        self.seconds_before = float(state.get("seconds", 0.0))
        ckpt.set_rng_state(state["rng"])
        trainer.resumed_from = path
        pos = state["trainer"]
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, pos["epoch"], pos["batch"], pos["step"])
        return path
