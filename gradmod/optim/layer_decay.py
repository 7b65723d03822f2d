"""Layer-wise learning-rate decay (``optimizer.layer_decay``): the BEiT/ViT fine-tuning recipe,
timm's ``create_optimizer_v2(model, layer_decay=...)``. A parameter at depth ``d`` of a model whose
top is ``top`` trains at ``factor ** (top - d)`` times its group's rate.

The depth is read from the names, as timm's ``group_matcher()`` reads it: a numbered block
(``blocks.N``, ``layers.N``, ``transformer.h.N``, ``layerN.M``: a container whose child is numbered,
or torchvision's ``layerN``) orders the blocks; what comes before the first block (embeddings, a
stem) is depth 0, what follows a block without a number of its own (a final norm) joins it, and the
last layer (the head) is the top. Where names do not tell it, the depths are a list of globs,
shallowest first: ``{factor: 0.75, depths: ["conv1.*", "conv2.*", "l1.*"]}``.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Mapping

from gradmod.hooks.rules.globs import ParamKind, last_layer, matching, shown

KEY = "optimizer.layer_decay"
LR_SCALE = (
    "entry_lr_scale"  # a group's marker: the factor of the base lr it trains at (timm's schedulers read "lr_scale")
)
LIST_FORM = f'{KEY}={{factor: 0.75, depths: ["stem.*", "blocks.0.*", ..., "head.*"]}}'
NUMBERED = re.compile(r"^layer(\d+)$")  # torchvision's ResNet: layer1 ... layer4


def factor_of(value: Any) -> float | None:
    """The decay factor of ``optimizer.layer_decay`` (a number, or a mapping with ``factor``); None: unset."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        extra = sorted(set(value) - {"factor", "depths"})
        if extra or "factor" not in value or "depths" not in value:
            raise ValueError(
                f"{KEY}: {shown(dict(value))} must be a number in (0, 1] or a mapping with factor and depths "
                f"(a list of globs, shallowest first): {LIST_FORM}"
            )
        value = value["factor"]
        where = f"{KEY}.factor"
    else:
        where = KEY
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value <= 1) or math.isnan(value):
        raise ValueError(
            f"{where}: {shown(value)} must be a number in (0, 1]: each depth below the top trains at "
            "factor ** (top - depth) times its rate (timm's layer_decay, e.g. 0.75)"
        )
    return float(value)


def depths(value: Any, names: list[str], kinds: Mapping[str, ParamKind]) -> dict[str, int]:
    """Parameter name -> its depth (0 the shallowest; the top is the largest)."""
    if isinstance(value, Mapping):
        return _listed(value["depths"], names, kinds)
    return _read(names)


def _block(name: str) -> tuple[str, tuple[int, ...]] | None:
    """The numbered block that holds parameter ``name``: its container's path and its numbers
    (``layer1.0.conv1.weight`` -> ``("layer", (1, 0))``); None outside every block. The
    parameter's own module is no block, so ``conv1.weight`` and ``features.3.weight`` are not in one."""
    parts = name.split(".")[:-2]  # the containers above the parameter's own module
    for i, part in enumerate(parts):
        own = NUMBERED.match(part)
        if part.isdigit() or own:
            numbers_ = [int(own.group(1))] if own else [int(part)]
            for after in parts[i + 1 :]:
                if not after.isdigit():
                    break
                numbers_.append(int(after))
            return ".".join([*parts[:i], "layer" if own else ""]).rstrip("."), tuple(numbers_)
    return None


def _read(names: list[str]) -> dict[str, int]:
    blocks = {n: _block(n) for n in names}
    if not any(blocks.values()):
        listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        raise ValueError(
            f"{KEY}: no parameter name tells its depth (numbered blocks: blocks.N, layers.N, layerN, h.N) "
            f"among {listed}; give the depths as globs, shallowest first: {LIST_FORM}"
        )
    stacks: dict[str, int] = {}  # a container's rank in model order: an encoder's blocks before a decoder's
    for b in blocks.values():
        if b is not None:
            stacks.setdefault(b[0], len(stacks))
    ranks = sorted({(stacks[b[0]],) + b[1] for b in blocks.values() if b is not None})
    rank = {key: i + 1 for i, key in enumerate(ranks)}
    head = set(last_layer(names))
    found: dict[str, int] = {}
    current = 0  # before the first block: embeddings, a stem
    for n in names:
        b = blocks[n]
        if b is not None:
            current = rank[(stacks[b[0]],) + b[1]]
        found[n] = len(ranks) + 1 if n in head and b is None else current
    return _dense(found)


def _listed(value: Any, names: list[str], kinds: Mapping[str, ParamKind]) -> dict[str, int]:
    if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{KEY}.depths: {shown(value)} must be a list of globs (or lists of globs), shallowest first")
    found: dict[str, int] = {}
    for d, globs in enumerate(value):
        for n in matching(f"{KEY}.depths.{d}", globs, names, "parameter (see model.named_parameters())", kinds):
            found.setdefault(n, d)  # a name in two depths: the shallower one's
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(
            f"{KEY}.depths: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} in no depth; "
            "every parameter needs one (add a glob to the list, shallowest first)"
        )
    return _dense(found)


def _dense(found: dict[str, int]) -> dict[str, int]:
    """Depths numbered 0, 1, ... with none empty (timm numbers its groups so)."""
    order = {d: i for i, d in enumerate(sorted(set(found.values())))}
    return {n: order[d] for n, d in found.items()}


def by_depth(
    group: dict[str, Any], lr: float, depth: Mapping[str, int], factor: float, name: Mapping[int, str]
) -> list[dict[str, Any]]:
    """``group`` (at rate ``lr``) split by depth, shallowest first: each at ``factor ** (top - depth)``
    times ``lr``, marked ``depth``, its ``entry_lr_scale`` times that factor (for a resume)."""
    top = max(depth.values())
    groups = []
    for d in sorted({depth[name[id(p)]] for p in group["params"]}):
        scale = factor ** (top - d)
        mine = [p for p in group["params"] if depth[name[id(p)]] == d]
        groups.append(
            {**group, "params": mine, "lr": lr * scale, LR_SCALE: group.get(LR_SCALE, 1.0) * scale, "depth": d}
        )
    return groups
