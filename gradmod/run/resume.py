"""What a resumed run may change: the checkpoint's config against the new one.

Must match (else one error naming each difference; ``trainer.resume_accept=[key, ...]``
accepts the named keys, or everything below a named prefix such as ``data``): what decides
the model, the data and its split, the data order, what the gradients go through (the
rules and their order), the loss and the learning-rate schedule (with a scheduler, whose
plan spans the run, ``trainer.epochs`` too). May change (applied, each difference logged):
everything else, e.g. ``trainer.epochs`` without a scheduler (never below the epochs the
checkpoint has begun), ``trainer.log_every``, checkpoint keys, ``logger``, and the
optimizer's hyperparameters, which are written into the restored optimizer's parameter
groups (``weight_decay`` not into the ``no_decay`` group, which stays at 0; not into what an
``optimizer.groups`` entry set itself; ``lr`` times a group's ``lr_scale``).

A difference the command line asked for is an INFO line; one it did not (``asked``: the keys
its overrides set) is a default that moved since the checkpoint (a shipped default changed
between releases, or a config file's value), applied all the same, and a WARNING naming the
key, the checkpoint's value and the new one.
"""

from __future__ import annotations

import logging
from typing import Any, Collection

import torch

from gradmod.optim.param_groups import set_base_argument
from gradmod.optim.spec import PLAN_KEYS

log = logging.getLogger(__name__)

MUST_MATCH = (
    "model",
    "data",
    "seed",
    "hooks",
    "init",
    *(f"optimizer.{k}" for k in PLAN_KEYS),  # what decides the optimizers and their groups
    "loss",
    "scheduler",
    "trainer.accumulate",
    "trainer.hook_stage",
    "trainer.precision",
    "trainer.strategy",
    "trainer.tp",  # with the world size: each rank's share of the data order
    "trainer.replicate",
)
HOOK_ORDER = "hooks._order_"  # rules on one tensor chain in config order: their order must match too
NOT_ARGUMENTS = ("_target_", "_partial_")
RESUME_KEYS = ("trainer.resume", "trainer.resume_accept", "trainer.start_over")  # the resume itself, not a default
UNSET = "<unset>"  # a key one of the two configs lacks (a key added or removed between releases)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf} for a nested dict (lists and other values are leaves)."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def compare(
    saved: dict[str, Any], new: dict[str, Any], accept=(), asked: Collection[str] | None = None
) -> dict[str, tuple[Any, Any]]:
    """The differences a resume may apply ({key: (old, new)}); a ``ValueError`` naming every
    must-match difference that ``accept`` does not name. ``asked``: the keys (or prefixes: a
    group such as ``optimizer``) the command line sets; a difference outside them is a default
    that moved, said in a WARNING. None: not known (a config built in Python), every
    difference as asked."""
    saved = saved or {}
    old, cur = _comparable(saved), _comparable(new)
    diffs = {
        k: (old.get(k, UNSET), cur.get(k, UNSET))
        for k in sorted(old.keys() | cur.keys())
        if not _same(old.get(k, UNSET), cur.get(k, UNSET))
    }
    must = MUST_MATCH + (("trainer.epochs",) if saved.get("scheduler") else ())  # the schedule's plan
    refused = [k for k in diffs if _under(k, must) and not _under(k, accept)]
    if refused:
        listed = "; ".join(f"{k}: {diffs[k][0]!r} -> {diffs[k][1]!r}" for k in refused)
        raise ValueError(
            f"trainer.resume: the checkpoint's run differs in what must match ({listed}); "
            f"resume with the same values, or accept them with trainer.resume_accept=[{','.join(refused)}]"
        )
    for k, (a, b) in diffs.items():
        if asked is not None and _moved_default(k, a, b, must, asked):
            log.warning(
                "resume: the default %s moved since the checkpoint: %r -> %r, and this command line does not set it; "
                "the run continues with the new value (give %s=%r to keep the checkpoint's)",
                *(k, a, b, k, a),
            )
        else:
            log.info("resume: %s %r -> %r%s", k, a, b, " (accepted)" if _under(k, must) else "")
    return diffs


def _same(old: Any, new: Any) -> bool:
    """Equal, or a key one config lacks that the other leaves unset (a key added since the checkpoint)."""
    return old == new or (old is UNSET and new is None) or (new is UNSET and old is None)


def _moved_default(key: str, old: Any, new: Any, must: tuple[str, ...], asked: Collection[str]) -> bool:
    """A difference no one asked for: a key both configs have, that may change, is not the
    resume's own, and the command line does not set."""
    return UNSET not in (old, new) and not _under(key, (*must, *RESUME_KEYS, *asked))


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened config, plus the order of the rules when both configs name the same ones."""
    flat = flatten(config)
    if isinstance(config.get("hooks"), dict):
        flat[HOOK_ORDER] = list(config["hooks"])
    return flat


def check_epochs(path: Any, state: dict[str, Any], epochs: int) -> None:
    """A resume must not end before the epochs the checkpoint has done or begun."""
    pos = state.get("trainer", {})
    begun = int(pos.get("epoch", 1)) - (0 if pos.get("batch") else 1)
    if epochs < begun:
        raise ValueError(
            f"trainer.epochs={epochs} is fewer than the {begun} epoch(s) checkpoint {path} has done "
            f"or begun; resume with trainer.epochs={begun} or more"
        )


def apply_optimizer(optimizer: torch.optim.Optimizer, diffs: dict[str, tuple[Any, Any]]) -> None:
    """Write changed optimizer hyperparameters (``optimizer.lr``, ...) into the param groups,
    over the values the checkpoint's optimizer state restored, into the groups that take them
    from the base optimizer (``gradmod.optim.param_groups.set_base_argument``)."""
    for key, (_, value) in diffs.items():
        name = key.partition(".")[2]
        if key.startswith("optimizer.") and name not in NOT_ARGUMENTS:
            set_base_argument(optimizer, name, value)
