"""Many processes: DistributedDataParallel (``ddp``) or FSDP2 (``fsdp``), gloo on the CPU,
nccl on GPUs.

``torchrun --nproc_per_node=N train.py trainer.strategy=ddp`` starts N copies of the job;
torchrun (or SLURM, through submitit) tells each its rank in the environment. Every rank
builds the same model from the same seed. Under ``ddp`` the hook rules are attached to the
*plain* model (names without DDP's ``module.`` prefix), then it is wrapped in DDP; under
``fsdp`` the model is sharded first (``fully_shard`` replaces the parameters, keeping their
names) and the rules are attached to it. Each rank trains on its own share of every
epoch's seeded permutation, evaluates its share of the test set and the results are
averaged, so every rank holds the same numbers; rank 0 alone writes the run folder, and
checkpoints hold the full state (FSDP2 gathers it to rank 0), read back by every rank.
Under ``fsdp``, ``tp`` > 1 first applies the model's tensor-parallel plan on a last mesh
dimension (its ranks share every batch) and ``replicate`` > 1 makes FSDP2 hybrid (HSDP).

Where the stages run (the all-reduce averages gradients over the ranks):

* ``hook``: the tensor hook runs on each rank's *local* gradient before it reaches
  ``.grad``; DDP's reducer reads ``.grad`` afterwards, so the step uses the mean of the
  transformed local gradients, e.g. ``mean_r clamp(g_r)``.
* ``fused``: runs after ``backward()`` returns, when DDP has already averaged ``.grad``:
  ``clamp(mean_r g_r)``. Under FSDP2 the same, on each rank's shard of the averaged
  gradient (norms are reduced over the shards); the ``hook`` stage is refused there.
* ``per_sample``: DDP's all-reduce never runs (every backward under ``no_sync``); the
  clipped sums are all-reduced once, with one noise draw (``gradmod.training.stage_sync``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmod.training.distributed import peers
from gradmod.training.distributed.ranks import env_rank, follower_overrides  # noqa: F401  (importable from here too)

STRATEGIES = ("single", "ddp", "fsdp")


@dataclass
class Dist:
    """This process's place in the run. ``Dist()`` is a single process."""

    strategy: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp: int = 1  # ranks of one tensor-parallel group (fsdp): they share every batch
    replicate: int = 1  # HSDP: replicas of each shard (fsdp)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run folder."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index: the ranks of a tensor-parallel group share it."""
        return self.rank // self.tp

    @property
    def data_size(self) -> int:
        """How many parts each batch and the test set are cut into (the data-parallel ranks)."""
        return self.world_size // self.tp

    @property
    def part(self) -> slice:
        """This rank's part of a tensor indexed along dim 0 (every element exactly once per
        data-parallel rank; a tensor-parallel group's ranks get the same part)."""
        return slice(self.data_rank, None, self.data_size)

    @classmethod
    def from_env(cls, strategy: str, device: torch.device, tp: int = 1, replicate: int = 1) -> Dist:
        """Read the rank from the environment and check it and the layout; starts nothing."""
        if strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy={strategy!r} is not a strategy; allowed: {', '.join(STRATEGIES)}")
        world = int(os.environ.get("WORLD_SIZE", 1))
        layout(strategy, world, tp, replicate)
        if strategy == "single":
            if world > 1:
                raise ValueError(
                    f"trainer.strategy=single but this is one of {world} processes (WORLD_SIZE); "
                    "add trainer.strategy=ddp"
                )
            return cls(device=device)
        if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
            import submitit  # SLURM tasks (hydra/launcher=slurm): same variables as torchrun

            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        if "RANK" not in os.environ:
            raise ValueError(
                f"trainer.strategy={strategy} needs the process environment torchrun sets (RANK, "
                "WORLD_SIZE, MASTER_ADDR); run: torchrun --nproc_per_node=N train.py "
                f"trainer.strategy={strategy}"
            )
        rank, world, local = env_rank(), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        if device.type == "cuda":
            device = torch.device("cuda", local)  # one GPU per process
            torch.cuda.set_device(device)
        return cls(strategy, rank, world, local, device, tp, replicate)

    def start(self) -> Dist:
        """Join the process group (a single process: nothing to join)."""
        if self.strategy != "single" and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            peers.note()  # a rank that dies later is named, not the connection it broke
        return self

    def wrap(self, model: nn.Module, find_unused: bool = False) -> nn.Module:
        """``model`` in DDP, or sharded in place by FSDP2 (single: ``model`` itself).

        DDP: attach hooks before, so that DDP sees gradients the hooks transformed;
        ``find_unused``: some backward reaches only part of the parameters (a ``freeze``
        rule switches ``requires_grad``). FSDP2: attach after (``fully_shard`` replaces the
        parameters); wrapping twice is wrapping once."""
        if self.strategy == "single":
            return model
        self.start()
        if self.strategy == "fsdp":
            return model if is_fsdp(model) else shard(model, self.mesh(model))
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids, find_unused_parameters=find_unused)

    def mesh(self, model: nn.Module):
        """FSDP2's device mesh: None for plain FSDP (the world, one dimension); else
        (replicate, shard) for HSDP, with ``model``'s tensor-parallel plan applied on a last
        ``tp`` dimension first (the ranks of a tp group are consecutive)."""
        if self.tp == 1 and self.replicate == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shard_size = self.world_size // (self.tp * self.replicate)
        sizes = {"replicate": self.replicate, "shard": shard_size, "tp": self.tp}
        names = tuple(n for n, k in sizes.items() if k > 1 or n == "shard")
        mesh = init_device_mesh(self.device.type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        if self.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh["tp"], tp_plan(model, self.tp))
        return mesh["replicate", "shard"] if self.replicate > 1 else mesh["shard"]

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a pickled broadcast; single: ``obj``)."""
        if self.strategy == "single":
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def agree(self, value: int) -> int:
        """The largest ``value`` of all ranks, on every rank (a signal to stop, 0 for none)."""
        if self.strategy == "single":
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The full model state dict for a checkpoint; FSDP2 gathers it (every rank calls,
        rank 0 gets it, in host memory; the others get {})."""
        if self.strategy != "fsdp":
            return unwrap(model).state_dict()
        dcp = _dcp()
        return dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a full state dict; FSDP2: every rank keeps its shard of it."""
        if self.strategy != "fsdp":
            unwrap(model).load_state_dict(state)
            return
        dcp = _dcp()
        dcp.set_model_state_dict(model, state, options=dcp.StateDictOptions(full_state_dict=True))

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """As ``model_state`` for the optimizer (FSDP2: keyed by parameter name)."""
        if self.strategy != "fsdp":
            return optimizer.state_dict()
        dcp = _dcp()
        return dcp.get_optimizer_state_dict(
            model, optimizer, options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if self.strategy != "fsdp":
            optimizer.load_state_dict(state)
            return
        dcp = _dcp()
        dcp.set_optimizer_state_dict(model, optimizer, state, options=dcp.StateDictOptions(full_state_dict=True))

    def mean(self, values: list[float], weight: float = 1.0) -> list[float]:
        """The ``weight``-weighted mean over ranks of per-rank values; the same on every rank."""
        if self.strategy == "single":
            return list(values)
        t = torch.tensor([*(v * weight for v in values), weight], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t[:-1] / t[-1]).tolist()

    def close(self) -> None:
        if self.strategy != "single" and dist.is_initialized():
            peers.forget()
            dist.destroy_process_group()


def _dcp():
    """torch.distributed.checkpoint's state-dict helpers, imported when FSDP2 needs them
    (a second of start-up that no other run pays)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def is_fsdp(model: nn.Module) -> bool:
    module = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    return module is not None and isinstance(model, module.FSDPModule)


def layout(strategy: str, world: int, tp: int, replicate: int) -> None:
    """One line for a layout that cannot be: tensor parallelism or HSDP without fsdp, or
    sizes whose product does not divide the processes."""
    for key, value in (("tp", tp), ("replicate", replicate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{key}={value!r} must be an int >= 1")
    if (tp > 1 or replicate > 1) and strategy != "fsdp":
        raise ValueError(
            f"trainer.tp={tp} trainer.replicate={replicate} need trainer.strategy=fsdp (FSDP2 with tensor "
            f"parallelism or HSDP), not {strategy}"
        )
    if world % (tp * replicate):
        raise ValueError(
            f"trainer.tp={tp} x trainer.replicate={replicate} does not divide the {world} processes (WORLD_SIZE); "
            f"use a world size that is a multiple of {tp * replicate}"
        )


def tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """The model's tensor-parallel plan (its ``tp_plan()``); one line for a model without one."""
    plan = getattr(model, "tp_plan", None)
    if not callable(plan):
        raise ValueError(
            f"trainer.tp={tp}: the model ({type(model).__name__}) has no tensor-parallel plan (a tp_plan() "
            "method giving parallelize_module's plan); use model=tiny_gpt, or trainer.tp=1"
        )
    return plan()


def shard(model: nn.Module, mesh=None) -> nn.Module:
    """``fully_shard`` per block, then the root: each child module that holds parameters
    is one unit, and each item of a child ``Sequential`` or ``ModuleList`` (ResNet's
    residual blocks); what is left (parameters of the root itself) goes with the root.
    A unit's parameters are gathered for its forward and backward, then freed. ``mesh``:
    FSDP2's (HSDP's 2-D one; None: the world)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        items = list(child) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        for unit in items:
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (its state dict has no ``module.`` prefix); FSDP2 keeps the module."""
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: nn.Module, skip: bool):
    """DDP's ``no_sync()`` when ``skip`` (a micro-batch before the last of a step): the
    gradient accumulates locally and is all-reduced once, with the last micro-batch.
    FSDP2: the same, reduce-scattered once."""
    if skip and isinstance(model, DDP):
        return model.no_sync()
    if skip and is_fsdp(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()
