"""A run's start: the user's plugins, this process's device, rank, threads and seeds, the
checked data and the checked model (``gradmod.run.runner`` calls these in its order)."""

from __future__ import annotations

import importlib
import logging
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gradmod.data import Data
from gradmod.labels import Labels
from gradmod.run import host_heap, preflight
from gradmod.run.config import Config
from gradmod.run.factories import build_data, build_tasks, model_factory
from gradmod.run.folder import endings
from gradmod.training.distributed.ranks import rank_threads
from gradmod.training.distributed.strategy import Dist
from gradmod.training.loader import batches_per_epoch, placement
from gradmod.training.precision import check_precision
from gradmod.training.speed import to_channels_last
from gradmod.weight_init import apply_init

log = logging.getLogger("gradmod.run.runner")  # the run's lines keep the name users filter on


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; asking for missing CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"trainer.device={name!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available here; use trainer.device=auto or cpu")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ValueError(f"trainer.device={name!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
    return device


def import_plugins(modules: list[str]) -> None:
    """Import the user's modules named in ``plugins`` (from the current folder, PYTHONPATH or installed)."""
    cwd = str(Path.cwd())
    if modules and cwd not in sys.path:
        sys.path.append(cwd)  # python train.py puts train.py's folder first, not the user's
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(
                f"plugins: cannot import {name!r} ({e}); a plugin is a module importable from "
                "the current folder, PYTHONPATH or an installed package, e.g. my_pkg.transforms"
            ) from None
        except (SystemExit, KeyboardInterrupt) as e:  # a plugin ends no run by itself: this one failed
            what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else "raised KeyboardInterrupt"
            raise ValueError(
                f"plugins: importing {name!r} {what} at {endings.user_frame(e) or 'import'}; a plugin "
                "module may register transforms, not end the run"
            ) from None
        except Exception as e:  # the plugin's own code failed (a SyntaxError names its line itself)
            where = "" if isinstance(e, SyntaxError) else f" at {endings.user_frame(e) or 'import'}"
            raise ValueError(
                f"plugins: importing {name!r} raised {type(e).__name__}{where}: {endings.one_line(str(e))}"
            ) from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def place(cfg: Config) -> Dist:
    """This process's device and rank, threads and seeds."""
    t = cfg.trainer
    dist = Dist.from_env(t.strategy, resolve_device(t.device), tp=t.tp, replicate=t.replicate)
    check_precision(cfg.trainer.precision, dist.device)
    if dist.strategy == "fsdp" and cfg.capture.gradcam:  # the probe copies the whole model's weights
        raise ValueError("capture.gradcam=true with trainer.strategy=fsdp is not supported; use trainer.strategy=ddp")
    dist.start()
    threads = cfg.trainer.threads or rank_threads()  # a rank's share of its node, where torchrun set none
    if threads:
        torch.set_num_threads(threads)
    if cfg.trainer.host_heap == "keep" and not host_heap.keep():
        log.info("trainer.host_heap=keep did not take (the C library is not glibc, or refused it): its defaults stay")
    seed_everything(cfg.seed)
    return dist


def load(cfg: Config, dist: Dist) -> tuple[Data, int | None]:
    """The checked dataset, on the device when it fits (else a DataLoader's worker count)."""
    data = build_data(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    if cfg.capture.gradcam and isinstance(data.test_y, Labels):  # its probe explains one classifier's label
        raise ValueError(
            f"capture.gradcam=true needs one label tensor; data ({data.name}) has labels by task "
            f"({', '.join(data.test_y.keys())}); use capture.gradcam=false"
        )
    preflight.check_data(data, None if cfg.model._target_ else f"model.name={cfg.model.name}")
    _warn_sizes(cfg, data, dist.data_size)
    if placement(cfg.trainer.data_placement, data, dist.device) == "device":
        return data.to(dist.device), None  # batches indexed on the device
    return data, cfg.trainer.loader_workers


def build_model(cfg: Config, data: Data, device: torch.device) -> tuple[nn.Module, bool]:
    """The model on ``device``, checked with the loss and metric on two training examples
    (before any hook); and whether the loss is several named losses."""
    model = model_factory(cfg.model, data)()
    apply_init(model, cfg.init.name)
    model.to(device)
    if cfg.trainer.channels_last:
        to_channels_last(model)  # same Parameter objects: attach before or after is the same
    key = f"model._target_={cfg.model._target_}" if cfg.model._target_ else f"model.name={cfg.model.name}"
    named_losses, metrics = preflight.check_model(
        model, data, build_tasks(cfg.loss, cfg.metric), key, f"loss._target_={cfg.loss._target_}", cfg.trainer.compile
    )
    if named_losses or not metrics.endswith("accuracy"):
        log.info("%s", metrics)  # the classification default goes without saying
    return model, named_losses


def items(data: Data) -> str:
    """What the dataset holds, for log lines: images (N x C x H x W) or examples."""
    return "images" if data.test_x.ndim == 4 else "examples"


def _warn_sizes(cfg: Config, data: Data, world_size: int) -> None:
    """Sizes that train, but not as the user probably meant."""
    n, bs = len(data.train_y), cfg.data.batch_size
    if bs > n:
        log.warning(
            "data.batch_size=%d is larger than the training set (%d %s): each epoch is one batch of %d",
            bs,
            n,
            items(data),
            n,
        )
    per_epoch = batches_per_epoch(n, bs, world_size)
    if cfg.trainer.accumulate > per_epoch:
        log.warning(
            "trainer.accumulate=%d is more than the %d batches of an epoch: each epoch is one optimizer "
            "step over %d batches",
            cfg.trainer.accumulate,
            per_epoch,
            per_epoch,
        )
