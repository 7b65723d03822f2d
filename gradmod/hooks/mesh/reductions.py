"""Reductions of DTensor gradients over the device mesh, for any layout.

A DTensor (``fully_shard``, ``parallelize_module``, both, HSDP) holds one piece of a
tensor per rank: on each mesh dimension its placement is ``Shard(d)`` (the tensor is cut
along its dim ``d`` over that dimension's ranks), ``Replicate()`` (every rank there
holds the same values) or ``Partial()`` (the values are a sum still to be reduced). A
reduction of the full tensor (a norm, a sum, an extreme) is therefore each rank's
reduction of its piece, combined over the mesh dimensions the tensor is sharded on, and
never over a replicated one: there each rank already holds the total, and summing would
count it once per replica. Tensors on different meshes (a layer outside tensor
parallelism, next to layers inside it) are reduced on their own meshes, then combined.

What is element-wise stays on each rank's piece (``local``); a per-row reduction (a
weight's output unit, dim 0) is combined only over mesh dimensions that cut the rows.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from gradmod.hooks.mesh.sharded import is_sharded


def local(t: Tensor) -> Tensor:
    """This rank's piece of ``t`` (the same storage: in-place changes reach ``t``); ``t`` if plain."""
    return t.to_local() if is_sharded(t) else t


def settled(t: Tensor) -> Tensor:
    """``t`` without ``Partial`` placements (summed over them), for reading its values."""
    if not is_sharded(t) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])


def shard_dims(t: Tensor, rows: bool = False) -> tuple[int, ...]:
    """The mesh dimensions ``t`` is cut on (``_StridedShard`` too: neither replicated nor
    partial). ``rows``: only those that cut a row (a tensor dim other than 0), all of them
    for a vector or a scalar, which is one unit as a whole."""
    if not is_sharded(t):
        return ()
    out = []
    for d, p in enumerate(t.placements):
        if p.is_replicate() or p.is_partial():
            continue
        if rows and t.dim() > 1 and p.dim % t.dim() == 0:
            continue
        out.append(d)
    return tuple(out)


def _reduce(value: Tensor, t: Tensor, dims: tuple[int, ...], largest: bool = False) -> Tensor:
    """All-reduce ``value`` over each of ``t``'s mesh dimensions ``dims`` (in place): the sum,
    or the largest value. (ReduceOp looked up here: a torch built without distributed has none.)"""
    op = dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM
    for d in dims:
        dist.all_reduce(value, op=op, group=t.device_mesh.get_group(d))
    return value


def mesh_norm(tensors: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type`` norm of all ``tensors`` as one vector, a plain tensor equal on every
    rank. Tensors are grouped by (mesh, dimensions they are cut on); each group's sum of
    powers (max for inf) is reduced over those dimensions, then the groups are combined.
    Collectives run in the order of first appearance, the same on every rank."""
    inf = math.isinf(norm_type)
    groups: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        t = settled(t)
        dims = shard_dims(t)
        key = (t.device_mesh, dims) if dims else (None, ())
        groups.setdefault(key, []).append(t)
    device = local(tensors[0]).device
    parts = []
    for (_, dims), members in groups.items():
        pieces = [local(t) for t in members if local(t).numel()]  # an uneven cut leaves some empty
        if pieces:
            norms = torch.stack([n.to(device).float() for n in torch._foreach_norm(pieces, norm_type)])
            value = (norms.max() if inf else norms.pow(norm_type).sum()).reshape(1)
        else:
            value = torch.zeros(1, device=device)
        parts.append(_reduce(value, members[0], dims, largest=inf) if dims else value)
    total = torch.cat(parts)
    return total.max() if inf else total.sum().pow(1.0 / norm_type)


def unit_norms(x: Tensor, norm_type: float = 2.0) -> Tensor:
    """Per output unit (dim 0) the norm over every other dim, shaped to broadcast over
    ``local(x)``; a vector or a scalar as a whole. Combined over the mesh dimensions that
    cut a row (tensor parallelism's ``Shard(1)``), never over those that cut between rows."""
    x = settled(x)
    piece, dims = local(x), shard_dims(x, rows=True)
    whole = x.dim() <= 1
    over = tuple(range(piece.dim())) if whole else tuple(range(1, piece.dim()))
    if not dims:
        return torch.linalg.vector_norm(piece, norm_type, dim=over, keepdim=not whole)
    inf = math.isinf(norm_type)
    if inf and not piece.numel():  # an uneven cut left this rank no entries: max over nothing is 0
        value = piece.new_zeros(() if whole else (piece.shape[0],) + (1,) * (piece.dim() - 1))
    elif inf:
        value = piece.abs().amax(dim=over, keepdim=not whole)
    else:
        value = torch.linalg.vector_norm(piece, norm_type, dim=over, keepdim=not whole).pow(norm_type)
    value = _reduce(value.float().contiguous(), x, dims, largest=inf)
    return (value if inf else value.pow(1.0 / norm_type)).to(piece.dtype)


def row_means(x: Tensor) -> Tensor:
    """Per row (dim 0) the mean over every other dim of a DTensor of two or more dims,
    shaped to broadcast over ``local(x)``; summed over the mesh dimensions that cut a row."""
    x = settled(x)
    piece, dims = local(x), shard_dims(x, rows=True)
    sums = piece.sum(dim=tuple(range(1, piece.dim())), keepdim=True)
    if dims:
        sums = _reduce(sums.contiguous(), x, dims)
    return sums / math.prod(x.shape[1:])


def like(t: Tensor, piece: Tensor) -> Tensor:
    """A DTensor laid out as ``t`` whose piece on this rank is ``piece``."""
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    return dtensor.from_local(piece, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def first_replica(t: Tensor) -> bool:
    """Whether this rank holds the first copy of its piece of ``t`` (coordinate 0 on every
    mesh dimension ``t`` is not cut on): counting only those counts each piece once."""
    if not is_sharded(t):
        return True
    coordinate = t.device_mesh.get_coordinate() or []
    cut = shard_dims(t)
    return all(c == 0 for d, c in enumerate(coordinate) if d not in cut)


def shard_index(t: Tensor) -> int:
    """Which piece of ``t`` this rank holds, counting only the mesh dimensions ``t`` is cut
    on: replicas of one piece share the index, different pieces never do."""
    coordinate = t.device_mesh.get_coordinate() or []
    index = 0
    for d in shard_dims(t):
        index = index * t.device_mesh.size(d) + coordinate[d]
    return index


def shard_generator(t: Tensor, seed: int) -> torch.Generator:
    """A generator for ``t``'s piece: seeded from ``seed`` (drawn alike on every rank) and the
    piece's index, so pieces draw distinct values, replicas equal ones, and a rerun the same."""
    mixed = (seed ^ (shard_index(t) * 0x9E3779B97F4A7C15)) % (1 << 63)
    return torch.Generator(device=local(t).device).manual_seed(mixed)


def sharded_rows(tensors: list[Tensor], paired: int) -> list[Tensor]:
    """``GradStats`` rows (norm, min, max, mean, frac_negative, nonfinite, frac_clipped)
    of the full tensors behind DTensor gradients, the same on every rank. Each rank
    reduces its pieces to sums, extremes and counts; per (mesh, dimensions cut on) one
    ``all_gather`` per dimension combines them. ``paired``: the first ``paired`` tensors
    are ``pre`` observations, the next ``paired`` their ``post`` partners."""
    tensors = [settled(t) for t in tensors]
    sums = _combined(tensors, _piece_sums([local(t).detach().float().reshape(-1) for t in tensors], paired))
    count = torch.tensor([float(t.numel()) for t in tensors], device=sums.device)
    rows = torch.stack(
        [
            sums[:, 0].sqrt(),
            sums[:, 1],
            sums[:, 2],
            sums[:, 3] / count,
            sums[:, 4] / count,
            sums[:, 5],
            sums[:, 6] / count,
        ],
        1,
    )
    return list(rows.unbind(0))


def _piece_sums(pieces: list[Tensor], paired: int) -> Tensor:
    """This rank's pieces reduced, one row each: (sum of squares, min, max, sum, negatives,
    non-finite, changed from its ``pre`` partner)."""
    inf = torch.full((1,), math.inf, device=pieces[0].device)  # the extremes of an empty piece
    mine = []
    for i, g in enumerate(pieces):
        changed = g.new_zeros(())
        if paired <= i < 2 * paired:
            before = pieces[i - paired]
            changed = ((g != before) & ~(g.isnan() & before.isnan())).sum().float()
        mine.append(
            torch.stack(
                [
                    (g * g).sum(),
                    torch.cat([g, inf]).min(),
                    torch.cat([g, -inf]).max(),
                    g.sum(),
                    (g < 0).sum().float(),
                    (g * 0).isnan().sum().float(),
                    changed,
                ]
            )
        )
    return torch.stack(mine)


def _combined(tensors: list[Tensor], sums: Tensor) -> Tensor:
    """Each rank's rows combined over the mesh dimensions its tensor is cut on."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        dims = shard_dims(t)
        groups.setdefault((t.device_mesh, dims) if dims else (None, ()), []).append(i)
    for (mesh, dims), ix in groups.items():
        block = sums[ix]
        for d in dims:
            group = mesh.get_group(d)
            every = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, block.contiguous(), group=group)
            parts = torch.stack(every)  # (ranks, tensors, 7)
            block = torch.cat(
                [parts[..., :1].sum(0), parts[..., 1:2].amin(0), parts[..., 2:3].amax(0), parts[..., 3:].sum(0)], -1
            )
        sums[ix] = block
    return sums
