"""``scores``: each training example's gradient norm over its rule's tensors (GraNd) and the
norm of its error vector ``softmax(output) - onehot(label)`` (EL2N), kept under the
example's index in the dataset (Paul et al. 2021, "Deep Learning on a Data Diet").

The per_sample stage forms each example's norm anyway (to clip it, for ``log``); ``scores``
keeps them instead of dropping them, on the device, until ``take_scores`` hands them over
(the Trainer once per epoch, into ``scores.csv``). No extra backward: EL2N comes from the
outputs of the training forward itself. A loop tells the stage which examples a batch
holds with ``see_batch(index, target)`` before the forward (the Trainer does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks.score_columns import INDEX, KEPT, LABEL

STATE_KEY = "per_sample_scores"  # the pending rows in HookSet.state_dict()
SEE_BATCH = "call hooks.stage('per_sample').see_batch(index, target) before each training forward (the Trainer does)"


class Scores:
    """``scores``: GraNd and EL2N per training example, by dataset index, at the per_sample
    stage (``PerSampleStage.take_scores`` reads them)."""

    name = "scores"

    def __init__(self) -> None:
        self._index: Tensor | None = None
        self._target: Tensor | None = None
        self._output: Tensor | None = None
        self._rows: list[Tensor] = []  # per backward [B, 4] float64, the columns of KEPT: index, label, grand, el2n
        self._ended: list[Tensor] = []  # rows of epochs ended (a checkpoint between epochs holds none)

    def __call__(self, grad: Tensor) -> None:
        raise TypeError(
            "'scores' keeps each example's gradient norm: it runs at stage 'per_sample' (set up by attach), "
            "not on a batch gradient"
        )

    def see_batch(self, index: Tensor, target: Tensor) -> None:
        """The next training forward's examples: their dataset indices and labels."""
        for name, t in (("index", index), ("target", target)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
                got = f"a {t.dim()}-d {t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"scores: see_batch's {name} must be a 1-d integer tensor (one per example); got {got}"
                )
        if len(index) != len(target):
            raise ValueError(
                f"scores: see_batch got {len(index)} indices and {len(target)} labels; one each per example"
            )
        self._index, self._target = index, target

    def see_output(self, output: Any) -> None:
        """The training forward's output: the logits EL2N is taken from."""
        if not isinstance(output, Tensor) or output.dim() != 2:
            got = f"a {output.dim()}-d tensor" if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(
                f"scores: EL2N needs the model's output as one [batch, classes] tensor of logits; got {got}"
            )
        self._output = output.detach()

    def add(self, norms: Tensor) -> None:
        """One backward's per-example gradient norms (``[B]``, in the batch's order)."""
        index, target, output = self._index, self._target, self._output
        self._index = self._target = self._output = None  # a batch is scored once
        if index is None or target is None:
            raise ValueError(
                f"scores: a backward of {len(norms)} examples came without their dataset indices; {SEE_BATCH}"
            )
        if output is None or len(index) != len(norms) or len(output) != len(norms):
            raise ValueError(
                f"scores: see_batch named {len(index)} examples, the backward had {len(norms)}"
                f"{'' if output is None else f' and the forward {len(output)}'}; {SEE_BATCH}"
            )
        dtype = torch.promote_types(norms.dtype, torch.float64)
        el2n = error_norms(output, target.to(output.device))
        columns = (index.to(norms.device), target.to(norms.device), norms, el2n.to(norms.device))
        self._rows.append(torch.stack([c.to(dtype) for c in columns], 1))

    def end_epoch(self) -> None:
        """The rows so far belong to an ended epoch: no longer part of a checkpoint's state."""
        self._ended, self._rows = self._ended + self._rows, []

    def take(self) -> Tensor:
        """The rows kept since the last take (``[N, 4]``, the columns of ``KEPT``), and a fresh start."""
        rows = self._ended + self._rows
        self._ended, self._rows = [], []
        return torch.cat(rows) if rows else torch.zeros(0, len(KEPT), dtype=torch.float64)

    def pending(self) -> Tensor | None:
        """The rows of the epoch in progress, on the host (a checkpoint's), or None."""
        return torch.cat(self._rows).cpu() if self._rows else None

    def restore(self, rows: Tensor | None, device: Any = None) -> None:
        self._rows = [] if rows is None else [rows.to(device)]


def error_norms(output: Tensor, target: Tensor) -> Tensor:
    """EL2N: each example's ``|softmax(output) - onehot(target)|``, in float32 or better."""
    p = output.to(torch.promote_types(output.dtype, torch.float32)).softmax(1)
    p = p.scatter_add(1, target.long()[:, None], torch.full_like(p[:, :1], -1.0))
    return torch.linalg.vector_norm(p, dim=1)


def keeper(rules: list) -> Scores | None:
    """The one rule's ``scores`` (None: no rule keeps scores); two rules keeping them is refused."""
    keeping = [r for r in rules if r.scores is not None]
    if len(keeping) > 1:
        raise ValueError(
            f"hooks: per_sample rules {', '.join(r.name for r in keeping)} both keep scores; one rule may "
            "(scores.csv holds one GraNd per example): select all their parameters in one"
        )
    return keeping[0].scores if keeping else None


def watch_outputs(model: nn.Module, scores: Scores | None, following: Callable[[], bool]) -> list:
    """A forward hook handing ``scores`` the output of each training forward (none without scores)."""
    if scores is None:
        return []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if following():
            scores.see_output(output)

    return [model.register_forward_hook(hook)]


class KeepsScores:
    """The per_sample stage's side of ``scores``: the batch's examples in, the rows out, and
    the rows of an epoch in progress in checkpoints. ``scores``: the keeping rule's, or None."""

    scores: Scores | None = None

    @property
    def keeps_scores(self) -> bool:
        return self.scores is not None

    def see_batch(self, index: Tensor, target: Tensor) -> None:
        """The dataset indices and labels of the examples of the next training forward."""
        if self.scores is None:
            raise ValueError("see_batch: no per_sample rule keeps scores (transforms: [scores])")
        self.scores.see_batch(index, target)

    def take_scores(self) -> dict[str, Tensor]:
        """The rows kept since the last take, on the host: ``index`` and ``label`` (int64),
        ``grand`` and ``el2n`` (float64), one entry per example seen (an example seen twice,
        twice); empty without a rule keeping scores."""
        rows = self.scores.take().cpu() if self.scores is not None else torch.zeros(0, len(KEPT))
        out = dict(zip(KEPT, rows.double().unbind(1)))
        return {k: v.long() if k in (INDEX, LABEL) else v for k, v in out.items()}

    def end_epoch(self) -> None:
        if self.scores is not None:
            self.scores.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: self.scores.pending()} if self.scores is not None else {}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        if self.scores is not None:
            self.scores.restore(state.get(STATE_KEY), device)
