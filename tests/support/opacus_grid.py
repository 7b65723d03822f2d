"""The per-layer configurations Opacus 1.6 tests its grad samplers on (tests/grad_samples/),
as a deterministic grid: each family's parameter ranges and filters, sampled with a seeded
generator instead of hypothesis. A configuration is (family, label, build) where ``build()``
gives (module, inputs tuple, batch dim, packed)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_sequence


def expand(c: int) -> int:
    return c * 2


def shrink(c: int) -> int:
    return max(1, c // 2)


class Unpacked(nn.Module):
    """An RNN's output tensor (Opacus' adapter: the tuple's first element), packed or not."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out = self.rnn(x)[0]
        return out.data if isinstance(out, PackedSequence) else out


class StackedAttention(nn.Module):
    """Query, key and value stacked in the last dim (Opacus' adapter), sequence first."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        q, k, v = x.unbind(-1)
        return self.attn(q, k, v)[0]


class Bag(nn.Module):
    def __init__(self, bag: nn.EmbeddingBag):
        super().__init__()
        self.bag = bag

    def forward(self, idx, offsets):
        return self.bag(idx, offsets)


def _packed(n: int, t: int, d: int, batch_first: bool, sort: bool, rng: random.Random) -> PackedSequence:
    lengths = [rng.randint(1, t) for _ in range(n)]
    if sort:
        lengths.sort(reverse=True)
    padded = pad_sequence([torch.randn(n_, d) for n_ in lengths], batch_first=batch_first)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first, enforce_sorted=sort)


def _conv(rng: random.Random, dims: int) -> dict[str, Any] | None:
    cfg = dict(N=rng.randint(0, 4), C=rng.choice([1, 3, 32]), out=rng.choice([expand, shrink]))
    if dims == 1:
        size = [rng.randint(6, 10)]
        cfg.update(k=rng.randint(2, 3), s=rng.randint(1, 2), pad=rng.choice([0, 1, 2, "same", "valid"]))
        cfg.update(dil=rng.randint(1, 2), g=rng.randint(1, 12))
    elif dims == 2:
        size = [rng.randint(11, 17), rng.randint(11, 17)]
        cfg.update(k=rng.randint(2, 4), s=rng.randint(1, 2), pad=rng.choice([0, 2, "same", "valid"]))
        cfg.update(dil=rng.randint(1, 3), g=rng.randint(1, 16))
    else:
        size = [rng.randint(3, 6), rng.randint(6, 10), rng.randint(6, 10)]
        cfg.update(k=rng.choice([2, 3, (1, 2, 3)]), s=rng.choice([1, 2, (1, 2, 3)]))
        cfg.update(pad=rng.choice([0, 2, (1, 2, 3), "same", "valid"]), dil=rng.choice([1, (1, 2, 2)]))
        cfg.update(g=rng.randint(1, 16))
    out = cfg["out"](cfg["C"])
    if cfg["pad"] == "same" and cfg["s"] != 1 or cfg["C"] % cfg["g"] or out % cfg["g"]:
        return None
    cls = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]

    def build():
        conv = cls(cfg["C"], out, cfg["k"], stride=cfg["s"], padding=cfg["pad"], dilation=cfg["dil"], groups=cfg["g"])
        return conv, (torch.randn(cfg["N"], cfg["C"], *size),), 0, False

    return {
        "label": f"N{cfg['N']} C{cfg['C']}->{out} k{cfg['k']} s{cfg['s']} p{cfg['pad']} d{cfg['dil']} g{cfg['g']}",
        "build": build,
    }


def _linear(rng):
    n, z, h, w, dim, bias, first = (rng.randint(0, 4), rng.randint(1, 4), rng.randint(1, 3), rng.randint(10, 17),
                                    rng.randint(2, 4), rng.random() < 0.5, rng.random() < 0.5)  # fmt: skip
    if dim == 2 and not first:
        return None
    shape = [[n, w], [n, z, w], [n, z, h, w]][dim - 2]

    def build():
        x = torch.randn(shape)
        return nn.Linear(w, w + 2, bias=bias), (x if first else x.transpose(0, 1),), 0 if first else 1, False

    return {"label": f"N{n} {shape} bias={bias} batch_first={first}", "build": build}


def _embedding(rng):
    n, t, q, r, v, d, dim, first = (rng.randint(0, 4), rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 2),
                                    rng.randint(2, 32), rng.randint(10, 17), rng.randint(2, 4), rng.random() < 0.5)  # fmt: skip
    size = [[n, t], [n, t, q], [n, t, q, r]][dim - 2]
    return {
        "label": f"{size} V{v} D{d} batch_first={first}",
        "build": lambda: (nn.Embedding(v, d), (torch.randint(0, v, size),), 0 if first else 1, False),
    }


def _embedding_bag(rng):
    n, sz, v, d, mode = (
        rng.randint(4, 8),
        rng.randint(3, 7),
        rng.randint(10, 32),
        rng.randint(10, 17),
        rng.choice(["sum", "mean"]),
    )

    def build():
        sizes = torch.randint(1, sz + 1, (n,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        idx = torch.cat([torch.randperm(v)[:s] for s in sizes.tolist()])
        return Bag(nn.EmbeddingBag(v, d, mode=mode)), (idx, offsets), 0, False

    return {"label": f"N{n} sz{sz} V{v} D{d} {mode}", "build": build}


def _group_norm(rng):
    n, c, h, w, g = rng.randint(0, 4), rng.randint(1, 8), rng.randint(5, 10), rng.randint(4, 8), rng.choice([1, 4, "C"])
    g = c if g == "C" else g
    if c % g:
        return None
    return {
        "label": f"N{n} C{c} {h}x{w} groups{g}",
        "build": lambda: (nn.GroupNorm(g, c), (torch.randn(n, c, h, w),), 0, False),
    }


def _norm(cls):
    def make(rng):
        n, z, h, w, dim, nd = (rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3), rng.randint(5, 10),
                               rng.randint(2, 4), rng.randint(1, 3))  # fmt: skip
        if nd >= dim:
            return None
        shape = [[n, w], [n, z, w], [n, z, h, w]][dim - 2]
        normalized = shape[-nd:]
        return {
            "label": f"{shape} over {normalized}",
            "build": lambda: (cls(normalized), (torch.randn(shape),), 0, False),
        }

    return make


def _instance_norm(dims):
    def make(rng):
        n, c = rng.randint(1, 4), rng.randint(1, 3)
        size = [rng.randint(5, 10), rng.randint(4, 8), rng.randint(3, 6)][:dims]
        cls = [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d][dims - 1]
        return {
            "label": f"N{n} C{c} {size}",
            "build": lambda: (cls(c, affine=True, track_running_stats=False), (torch.randn(n, c, *size),), 0, False),
        }

    return make


def _sequence_bias(rng):
    from opacus.layers import SequenceBias

    n, t, d, first = rng.randint(0, 4), rng.randint(10, 20), rng.randint(4, 8), rng.random() < 0.5
    shape = [n, t, d] if first else [t, n, d]
    return {
        "label": f"{shape} batch_first={first}",
        "build": lambda: (SequenceBias(d, first), (torch.randn(shape),), 0 if first else 1, False),
    }


def _attention(rng):
    from opacus.layers import DPMultiheadAttention

    n, t, p, bias, bias_kv, zero_attn, kv = (rng.randint(1, 4), rng.randint(16, 20), rng.choice([1, 2]), rng.random() < 0.5,
                                             rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5)  # fmt: skip
    kw = dict(
        bias=bias,
        add_bias_kv=bias_kv,
        add_zero_attn=zero_attn,
        dropout=0.0,
        kdim=4 if kv else None,
        vdim=4 if kv else None,
    )
    return {
        "label": f"N{n} T{t} heads{p} " + " ".join(f"{k}={v}" for k, v in kw.items()),
        "build": lambda: (StackedAttention(DPMultiheadAttention(4, p, **kw)), (torch.randn(t, n, 4, 3),), 1, False),
    }


def _rnn(rng):
    from opacus.layers import DPGRU, DPLSTM, DPRNN

    cls = rng.choice([DPRNN, DPGRU, DPLSTM, nn.RNN, nn.GRU, nn.LSTM])
    n, t, d, h, layers = rng.randint(1, 3), rng.randint(1, 3), rng.randint(4, 5), rng.randint(8, 10), rng.choice([1, 2])
    bias, first, bidi, packed, sort = (rng.random() < 0.5 for _ in range(5))
    seed = rng.random()

    def build():
        rnn = Unpacked(cls(d, h, num_layers=layers, bias=bias, batch_first=first, bidirectional=bidi))
        x = (
            _packed(n, t, d, first, sort, random.Random(seed))
            if packed
            else torch.randn(*([n, t] if first else [t, n]), d)
        )
        return rnn, (x,), 0 if first else 1, packed

    label = f"{cls.__name__} N{n} T{t} D{d} H{h} layers{layers} bias={bias} batch_first={first} bidi={bidi}"
    return {"label": label + (f" packed sorted={sort}" if packed else ""), "build": build}


FAMILIES: dict[str, Callable[[random.Random], dict | None]] = {
    "conv1d": lambda rng: _conv(rng, 1),
    "conv2d": lambda rng: _conv(rng, 2),
    "conv3d": lambda rng: _conv(rng, 3),
    "linear": _linear,
    "embedding": _embedding,
    "embedding_bag": _embedding_bag,
    "group_norm": _group_norm,
    "layer_norm": _norm(nn.LayerNorm),
    "rms_norm": _norm(nn.RMSNorm),
    "instance_norm1d": _instance_norm(1),
    "instance_norm2d": _instance_norm(2),
    "instance_norm3d": _instance_norm(3),
    "sequence_bias": _sequence_bias,
    "dp_multihead_attention": _attention,
    "dp_rnn": _rnn,
}


def grid(per_family: int, seed: int = 0) -> list[tuple[str, str, Callable]]:
    """``per_family`` configurations of each family (Opacus' filters applied), deterministic."""
    out = []
    for family, make in FAMILIES.items():
        rng, found, tries = random.Random(f"{seed}-{family}"), [], 0
        while len(found) < per_family and tries < 1000:
            tries += 1
            cfg = make(rng)
            if cfg is not None and cfg["label"] not in {c["label"] for c in found}:
                found.append(cfg)
        out += [(family, c["label"], c["build"]) for c in found]
    return out
