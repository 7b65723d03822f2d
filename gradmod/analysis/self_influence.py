"""TracIn self-influence of a finished run's training examples (Pruthi et al. 2020, "TracInCP").

For each checkpoint c the run saved (``<run>/checkpoints``, read by ``checkpoint_file``), with
the learning rate ``lr_c`` its optimizer held, example i scores ``sum_c lr_c |g_i(w_c)|^2``:
``g_i`` the gradient of its own cross-entropy loss over every parameter of the model at the
checkpoint's weights, the model in eval mode. The run's hook rules are not applied: the plain
loss gradient, as Captum's ``TracInCP.self_influence`` takes it (the reference the tests
compare with). The norms come from the per_sample stage (``scores``), a batch at a time, with
no per-example gradient formed where a closed form exists.

High self-influence marks examples the model had to bend to fit: mislabelled or ambiguous
ones come first.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.data import Data, as_float
from gradmod.hooks.hookset import attach
from gradmod.hooks.score_columns import GRAND, INDEX
from gradmod.reporting import run_summary
from gradmod.run.config import CharTextDataConfig, DataConfig, FakeDataConfig, KeepConfig, ModelConfig
from gradmod.run.factories import build_data, model_factory
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.folder.claim import HOLDER
from gradmod.run.folder.score_files import one_label_each

log = logging.getLogger("gradmod.scores")

SCORES = {"self_influence": {"params": "*", "transforms": ["scores"]}}  # its kind puts it where examples count


@dataclass(frozen=True)
class Checkpoint:
    """One saved state of the run: its step, its learning rate, its model weights."""

    path: Path
    step: int
    lr: float
    model: dict[str, Tensor]


def run_checkpoints(run: Path, what: str = "self-influence") -> list[Path]:
    """The run's checkpoints, oldest first; a ``ValueError`` naming what is missing (``what``
    needs them)."""
    run = Path(run)
    if not run.is_dir():
        raise ValueError(f"{run} is not a folder; give the run folder a gradmod run wrote")
    if not (run / ".gradmod" / "run.json").is_file():
        raise ValueError(f"{run} is not a gradmod run folder (no .gradmod/run.json); give the folder a run wrote")
    refuse_running(run)
    found = ckpt.checkpoints(run / "checkpoints")
    if not found:
        raise ValueError(
            f"{run} has no checkpoints (checkpoints/step-*.pt); {what} needs the run's checkpoints: "
            "train with trainer.checkpoint_every=1 and trainer.checkpoint_keep=EPOCHS to keep one per epoch"
        )
    return found


def refuse_running(run: Path) -> None:
    """A run still training (a process holds its folder's lock) is refused: it adds checkpoints
    and prunes the oldest as it goes (``trainer.checkpoint_keep``), so a sum over what is there
    now is not the run's, and the folder is that process's to write."""
    if not run_summary.in_use(run):
        return
    try:
        pid = (run / ".gradmod" / HOLDER).read_text().strip() or "unknown"
    except OSError:
        pid = "unknown"
    raise ValueError(
        f"{run} is still training (pid {pid} holds its lock): its checkpoints are not all there yet and "
        "the oldest may still be pruned; score it once the run has ended"
    )


def warn_unended(run: Path, checkpoints: int) -> None:
    """One warning where no ending is written (the run was killed, or its summary is gone):
    nothing holds the folder any more, so its checkpoints are scored as they are."""
    summary = run_summary.read(run)
    status = summary.get("status") if isinstance(summary, dict) else None
    if status is None or status == "killed":
        why = "summary.json is missing or unreadable" if status is None else "the run was killed while training"
        log.warning("warning: %s has no ending (%s): scoring the %d checkpoints it left", run, why, checkpoints)


def read_checkpoint(path: Path) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint's weights and learning rate, and the run's config it carries."""
    try:
        state = ckpt.load(path)
    except ckpt.CheckpointError as e:
        raise ValueError(str(e)) from None
    try:
        groups, model, config = state["trainer"]["optimizer"]["param_groups"], state["model"], state["config"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path}: not a training checkpoint of a gradmod run (no {e})") from None
    rates = {float(g["lr"]) for g in groups}
    if len(rates) != 1:
        raise ValueError(
            f"checkpoint {path}: its optimizer's parameter groups have learning rates {sorted(rates)}; "
            "TracIn takes one learning rate per checkpoint"
        )
    return Checkpoint(Path(path), int(state["step"]), rates.pop(), model), config


def check_weights(model: nn.Module, checkpoints: list[Checkpoint], what: str) -> None:
    """Every checkpoint holds ``model``'s weights (``what``: the model's name), else one line
    naming the file that does not: self-influence sums over every checkpoint of the folder."""
    mine = model.state_dict()
    for c in checkpoints:
        missing = [k for k in mine if k not in c.model]
        extra = [k for k in c.model if k not in mine]
        shapes = [
            f"{k} is {_shape(c.model[k])} there, {_shape(v)} in the run's"
            for k, v in mine.items()
            if k in c.model and _shape(c.model[k]) != _shape(v)
        ]
        found = [f"it lacks {', '.join(missing[:3])}"] if missing else []
        found += [f"it holds {', '.join(extra[:3])} besides"] if extra else []
        found += shapes[:3]
        if found:
            raise ValueError(
                f"checkpoint {c.path} is not of this run's model ({what}): {'; '.join(found)}; move it out of "
                f"{c.path.parent}, whose every checkpoint is scored"
            )


def _shape(t: Any) -> str:
    return "x".join(map(str, t.shape)) if hasattr(t, "shape") else type(t).__name__


def run_data(config: dict[str, Any], run: Path, data_dir: str | None = None) -> Data:
    """The run's training data, rebuilt from its config (``data_dir``: where it lies now, else the
    run's own); refused where it is not the dataset the run trained on (its ``summary.json``)."""
    section = dict(config["data"])
    section["keep"] = KeepConfig(**section.get("keep", {}))  # the share a pruned run trained on
    cls = {"fake": FakeDataConfig, "char_text": CharTextDataConfig}.get(section.get("name"), DataConfig)
    where = data_dir if data_dir is not None else config["data_dir"]
    data = build_data(cls(**section), data_dir=where, seed=config["seed"])
    summary = _summary(run)
    trained = (summary.get("dataset"), summary.get("train_size"))
    if trained[0] is not None and trained != (data.name, len(data.train_y)):
        raise ValueError(
            f"{run} trained on {trained[0]} ({trained[1]} examples) but data_dir={where!r} gives {data.name} "
            f"({len(data.train_y)}); give --data-dir where the run's data lies"
        )
    if not one_label_each(data.train_y):
        raise ValueError(
            f"{run}: self-influence needs one class label per training example; {data.name} has other labels"
        )
    return data


def run_model(config: dict[str, Any], data: Data) -> Callable[[], nn.Module]:
    return model_factory(ModelConfig(**config["model"]), data)


def _summary(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def squared_norms(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int = 100,
    device: torch.device | None = None,
    done: Callable[[int], None] | None = None,
) -> Tensor:
    """Each training example's squared gradient norm of its cross-entropy loss over every
    parameter of ``model`` (eval mode), float64 on the host, in the order of ``y``; ``done``
    is told the examples done after each batch."""
    device = device or torch.device("cpu")
    model.to(device).eval()
    out = torch.zeros(len(y), dtype=torch.float64)
    with attach(model, SCORES) as hooks:
        stage = hooks.keeping_scores  # the SCORES rule keeps them
        for start in range(0, len(y), batch_size):
            index = torch.arange(start, min(start + batch_size, len(y)))
            xb, yb = as_float(x[index].to(device)), y[index].to(device)
            stage.see_batch(index.to(device), yb)
            F.cross_entropy(model(xb), yb).backward()
            hooks.after_backward()
            model.zero_grad(set_to_none=True)
            if done is not None:
                done(start + len(index))
        rows = stage.take_scores()
    out[rows[INDEX]] = rows[GRAND].square()
    return out


def self_influence(
    build: Callable[[], nn.Module],
    checkpoints: list[Checkpoint],
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int = 100,
    device: torch.device | None = None,
    progress: Callable[[int, Checkpoint, int], None] | None = None,
) -> Tensor:
    """``sum_c lr_c |g_i(w_c)|^2`` over ``checkpoints``, for every example of (x, y);
    ``progress(k, c, examples)``: checkpoint ``k`` (from 0) has that many examples done
    (0 as it starts, then after each batch)."""
    total = torch.zeros(len(y), dtype=torch.float64)
    for k, c in enumerate(checkpoints):
        done = None if progress is None else lambda n, k=k, c=c: progress(k, c, n)
        if done is not None:
            done(0)
        model = build()
        model.load_state_dict(c.model)
        total += c.lr * squared_norms(model, x, y, batch_size=batch_size, device=device, done=done)
    return total


@torch.no_grad()
def predictions(model: nn.Module, x: Tensor, *, batch_size: int = 100, device: torch.device | None = None) -> Tensor:
    """The class ``model`` (eval mode) gives each of ``x``."""
    device = device or torch.device("cpu")
    model.to(device).eval()
    parts = [model(as_float(x[i : i + batch_size].to(device))).argmax(1).cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
