"""T5's relative position bias as an Embedding call with the batch, so its closed form applies.

The first attention block of each T5 stack looks its bias up in an Embedding of relative
position buckets (``[T, T]`` ids: no batch), adds it to every example's scores and hands it
to the later blocks; its per-example gradient would otherwise need the block, or the stack,
replayed per example. Once the stage is set up, such a block is given its ``position_bias``
from the same lookup on the bucket ids expanded to the batch (``[B, T, T]``), the values
unchanged (the stage compares the model's outputs once, with and without, before relying on
it): the bias Embedding is then an ordinary batched Embedding call. Found by what the module
has (``has_relative_attention_bias``, ``relative_attention_bias``, ``_relative_position_bucket``),
so copies of T5's attention are found too (each checked as above); nothing is imported.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradmod.hooks.trace.first_forward import Trace, same_output, trace


def _relative(m: nn.Module) -> bool:
    return (
        bool(getattr(m, "has_relative_attention_bias", False))
        and isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
        and callable(getattr(m, "_relative_position_bucket", None))
    )


def _has_past(kwargs: dict) -> bool:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    length = getattr(cache, "get_seq_length", None)
    return cache is not None and (length is None or int(length()) > 0)


class BatchedBias:
    """Pre-hooks that pass each relative-bias block a ``position_bias`` looked up with the batch."""

    def __init__(self, modules: list[nn.Module]):
        self.on = True
        self.handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True) for m in modules]

    def _pre(self, m: nn.Module, args: tuple, kwargs: dict):
        if not self.on or torch._C._are_functorch_transforms_active():
            return None  # a replay (torch.func) looks the bias up as T5 does, and so does generation's
        # later steps (a cache with a past); evaluation too gets the batched lookup (the same values,
        # and the stage's Embedding call always carries the batch)
        hidden = args[0] if args else kwargs.get("hidden_states")
        given = len(args) > 2 or any(kwargs.get(k) is not None for k in ("position_bias", "key_value_states"))
        if not isinstance(hidden, Tensor) or hidden.dim() != 3 or given or _has_past(kwargs):
            return None
        bsz, length = hidden.shape[:2]
        pos = torch.arange(length, device=hidden.device)
        buckets = m._relative_position_bucket(  # type: ignore[operator]
            pos[None, :] - pos[:, None],  # key position minus query position, as T5's compute_bias
            bidirectional=not getattr(m, "is_decoder", False),
            num_buckets=m.relative_attention_num_buckets,
            max_distance=m.relative_attention_max_distance,
        )
        values = m.relative_attention_bias(buckets.expand(bsz, length, length))  # type: ignore[operator]
        return args, {**kwargs, "position_bias": values.permute(0, 3, 1, 2)}  # [B, heads, T, T]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def traced(model: nn.Module, args: tuple, kwargs: dict, watched: set[int], declared: int | None):
    """The trace of the model's first forward, with T5's relative biases looked up per example
    where that leaves its outputs as they were; returns (trace or None, hook handles to keep)."""
    blocks = [m for m in model.modules() if _relative(m) and id(m.relative_attention_bias.weight) in watched]
    if not blocks:
        return trace(model, args, kwargs, watched, declared), []
    batched = BatchedBias(blocks)
    found: Trace | None = trace(model, args, kwargs, watched, declared)
    batched.on = False
    alike = found is not None and not found.packed and same_output(model, args, kwargs, found)
    batched.on = alike
    if alike:
        return found, batched.handles
    batched.remove()  # the lookup changed what the model computes: T5's own, replayed per example
    return trace(model, args, kwargs, watched, declared), []
