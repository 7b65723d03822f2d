"""``centralize`` before a sharpness transform: gradient centralisation of the ascent's
direction, pytorch-optimizer's ``SAM(use_gc=True)`` (and ``LookSAM(use_gc=True)``).

In a sharpness rule, ``[centralize, sam]`` subtracts from each first-pass gradient of two
or more dimensions its mean over all dimensions but the first, in place, once the
sharpness transform took its norm: the move is ``rho gc(g) / ||g||``, as the reference's
(it takes the norm before centralising). The gradient at ``w + e`` is not centralised:
for that, a ``centralize`` rule at stage hook or fused beside it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def centralize_ascent() -> Callable[[list[Tensor]], None]:
    """The form of ``centralize`` at the sharpness stage: in place on a rule's first-pass gradients."""

    @torch.no_grad()
    def bend(grads: list[Tensor]) -> None:
        for g in grads:
            if g.dim() > 1:
                g.sub_(g.mean(dim=tuple(range(1, g.dim())), keepdim=True))

    return bend
