"""Models for sweep tests, given by ``model._target_=tests.support.sweep_models.NAME``."""

import os
import signal

from torch import nn


def tiny(die: bool = False) -> nn.Module:
    """A linear classifier of 1x28x28 images; ``die=true``: the process kills itself with
    SIGKILL while the run builds it, as the OOM killer would."""
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def mlp() -> nn.Module:
    """Two linear layers: parameter names ``1.*`` and ``3.*``, unlike any shipped model's."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), nn.ReLU(), nn.Linear(16, 10))


def dies_once(marker: str) -> nn.Module:
    """``tiny``, but the first job to build it (the one that makes the file ``marker``) kills
    its own process with SIGKILL, as the OOM killer would; later jobs train."""
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return tiny()
    return tiny(die=True)


def waits(pid_file: str = "", wait: bool = False) -> nn.Module:
    """``tiny``; ``wait=true``: writes the pid of the launcher's process that runs this job
    (the training's parent) to ``pid_file`` and sleeps until a test kills that process."""
    if wait:
        import time

        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getppid()))
        os.replace(pid_file + ".tmp", pid_file)
        time.sleep(120)
    return tiny()
