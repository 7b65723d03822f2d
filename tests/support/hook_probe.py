"""A Hydra callback for tests: at every job's start, count the gradient hooks alive in
this process (on any module or tensor) and append the count to $GRADMOD_HOOK_PROBE."""

import gc
import os

import torch
from hydra.experimental.callback import Callback


def live_hooks() -> int:
    gc.collect()
    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            n += len(obj._forward_hooks) + len(obj._backward_hooks)
        elif isinstance(obj, torch.Tensor) and obj._backward_hooks:
            n += len(obj._backward_hooks)
    return n


class HookProbe(Callback):
    def on_job_start(self, config, **kwargs) -> None:
        with open(os.environ["GRADMOD_HOOK_PROBE"], "a") as f:
            f.write(f"{live_hooks()}\n")
