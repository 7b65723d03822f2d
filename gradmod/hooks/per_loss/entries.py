"""A rule's entries: each tensor it answers for, with its k task gradients, its part of the
task Gramian, its pieces of the Jacobian and its share of the update ``sum_i w_i g_i``.

* ``LinearEntry``: a Linear answered from its rows. Its task gradients are ``b_i^T a``; where
  the rows are few against the features (``gram_pays``) its Gramian is ``b_i^T (a a^T) b_j``
  and its update ``(sum_i w_i b_i)^T a``: the k weight gradients are never formed.
* ``ParamEntry``: a parameter whose k task gradients the backward forms itself (more rows,
  a convolution, a weight used functionally), in the same kernels as the input gradients.
* ``OutputEntry``: a ``modules:`` rule's output; its update goes on down the backward (the
  ``replace`` map its output's hook reads), not into ``.grad``.

Each entry names the inputs the backward differentiates to (``inputs``), and takes their k
gradients from its place in that list (``take``). Half-precision gradients are taken in
float32 (the Gramian's sums need the range); ``dtype`` keeps the coarsest they came in, whose
rounding the Gramian carries (``methods.rounding.precision``).

Each Gramian is float64 (``gram``): a float32 one's products are summed in chunks in float32,
the chunks' sums in float64, so its rounding stays near float32's epsilon whatever the
number of parameters; summed in float32 alone it grows with it (to 2e-4 of the largest
eigenvalue over 1e7 parameters), where two dependent tasks leave an eigenvalue of that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

Replace = dict[int, tuple[Tensor, Tensor]]  # id(module output) -> (it, the gradient its hook hands on)


@dataclass
class Layer:
    """A Linear whose weight (and bias) a rule owns: answered from (a, b) when the rows pay."""

    module: nn.Module
    rule: Any  # the LossRule that owns it
    names: set[str]  # of "weight", "bias"
    calls: list[tuple[Tensor, GradientEdge]] = field(default_factory=list)  # (input, output's gradient edge)

    def rows_pay(self, k: int) -> bool:
        """Whether this step's calls take the rows' Gram: fewer flops than k weight gradients.
        Else the backward forms its k task gradients directly (autograd's own weight matmul)."""
        m = self.module
        rows = sum(a.numel() // a.shape[-1] for a, _ in self.calls)
        return "weight" in self.names and gram_pays(rows, m.in_features, m.out_features, k)


def gram_pays(n: int, d_in: int, d_out: int, k: int) -> bool:
    """Row Gram (``n^2 (d_in + k d_out)``) against k weight gradients (``k n d_in d_out``)."""
    return n * (d_in + k * d_out) < k * d_in * d_out


class LinearEntry:
    """A Linear answered from its calls' inputs ``A`` ``[N, in]`` and k output gradients ``B``
    ``[k, N, out]``: a layer called several times answers once (its task gradient is the sum
    over the calls)."""

    def __init__(self, layer: Layer, at: int):
        self.rule, self.layer, self.at = layer.rule, layer, at
        self.inputs: list[Any] = [edge for _, edge in layer.calls]
        self.on_rows: list[Tensor] = [getattr(layer.module, n) for n in layer.names]
        self.own: list[Tensor] = []  # no tensor of its own k task gradients
        self.A = self.B = torch.empty(0)
        self.dtype = torch.float64  # the coarsest of its task gradients' and inputs' dtypes

    def take(self, grads: list[Tensor | None]) -> bool:
        """Its calls' output gradients from the backward's; False where none reached it."""
        A, B = [], []
        for (a, _), g in zip(self.layer.calls, grads[self.at : self.at + len(self.inputs)]):
            if g is not None:
                self.dtype = coarsest(self.dtype, g.dtype, a.dtype)
                g = _wide(g)
                A.append(linear_rows(a).to(g.dtype))
                B.append(out_rows(g))
        if not A:
            return False
        self.A, self.B = _cat(A, 0), _cat(B, 1)
        return True

    def gram(self) -> Tensor:
        """``B^T (A A^T) B``, symmetrised: the rounding of ``(A A^T) B`` (each task's apart)
        then leaves two dependent tasks' eigenvalue at 0 to second order."""
        KB = torch.matmul(self.A @ self.A.T, self.B)  # [k, N, out]: the rows' Gram
        G = gram(self.B.flatten(1), KB.flatten(1))
        G = (G + G.T) / 2
        if "bias" in self.layer.names:
            G = G + gram(self.B.sum(1))
        return G

    def pieces(self) -> list[tuple[Tensor, Tensor]]:
        m, out = self.layer.module, []
        if "weight" in self.layer.names:
            out.append((m.weight, (self.B.transpose(1, 2) @ self.A).flatten(1)))
        if "bias" in self.layer.names:
            out.append((m.bias, self.B.sum(1)))
        return out

    def update(self, w: Tensor, replace: Replace) -> None:
        m = self.layer.module
        bw = torch.tensordot(w.to(self.B.dtype), self.B, 1)  # [N, out]
        if "weight" in self.layer.names:
            add_grad(m.weight, (bw.T @ self.A).view_as(m.weight))
        if "bias" in self.layer.names:
            add_grad(m.bias, bw.sum(0))

    def put(self, tensor: Tensor, value: Tensor, replace: Replace) -> None:
        add_grad(tensor, value)


class _OwnGrads:
    """A tensor whose k task gradients ``[k, *shape]`` the backward gives as they are."""

    def __init__(self, rule: Any, tensor: Tensor, at: int, source: Any):
        self.rule, self.tensor, self.at = rule, tensor, at
        self.inputs: list[Any] = [source]
        self.on_rows: list[Tensor] = []
        self.g = torch.empty(0)
        self.dtype = torch.float64  # the dtype its task gradients came in

    def take(self, grads: list[Tensor | None]) -> bool:
        """Its k gradients from the backward's; False where no loss reached it."""
        g = grads[self.at]
        if g is None:
            return False
        self.dtype, self.g = g.dtype, _wide(g)
        return True

    def gram(self) -> Tensor:
        return gram(task_rows(self.g))

    def pieces(self) -> list[tuple[Tensor, Tensor]]:
        return [(self.tensor, task_rows(self.g))]

    def update(self, w: Tensor, replace: Replace) -> None:
        self.put(self.tensor, torch.tensordot(w.to(self.g.dtype), self.g, 1), replace)


class ParamEntry(_OwnGrads):
    """A parameter whose k task gradients the backward forms itself."""

    def __init__(self, rule: Any, param: nn.Parameter, at: int):
        super().__init__(rule, param, at, param)
        self.own: list[Tensor] = [param]

    def put(self, tensor: Tensor, value: Tensor, replace: Replace) -> None:
        add_grad(tensor, value)


class OutputEntry(_OwnGrads):
    """A module output (from its gradient edge): its update replaces the output's gradient
    in the rest of the backward, in the output's own dtype (a half one's Gramian ran in
    float32), as its hook must give."""

    def __init__(self, rule: Any, out: Tensor, at: int):
        super().__init__(rule, out, at, get_gradient_edge(out))
        self.own: list[Tensor] = []

    def batch_rows(self) -> Tensor:
        """Each task's gradient summed over the batch (dim 0), as rows (LibMTL's rep_grad)."""
        return task_rows(self.g.sum(1) if self.g.dim() > 1 else self.g)

    def put(self, tensor: Tensor, value: Tensor, replace: Replace) -> None:
        replace[id(tensor)] = (tensor, value.to(tensor.dtype))


Entry = LinearEntry | ParamEntry | OutputEntry


CHUNK = 1024  # a float32 Gramian's products summed in float32 this many at a time
BLOCK = CHUNK * 4096  # columns per batched product (bounds the copy a strided one may take)


def gram(X: Tensor, Y: Tensor | None = None) -> Tensor:
    """``X Y^T`` (``X X^T`` without ``Y``) of ``[k, n]`` rows, in float64 on their device: in
    float64 where the rows are (or are few: ``CHUNK`` at most); else the products of each
    ``CHUNK`` columns summed in the rows' dtype (one batched matmul), those sums in float64."""
    Y = X if Y is None else Y
    n = X.shape[1]
    if X.dtype == torch.float64 or n <= CHUNK:
        return X.double() @ Y.double().T
    whole = n // CHUNK * CHUNK
    G = (X[:, whole:] @ Y[:, whole:].T).double()  # the columns after the whole chunks
    for at in range(0, whole, BLOCK):
        cols = slice(at, min(at + BLOCK, whole))
        Xc = X[:, cols].reshape(len(X), -1, CHUNK).transpose(0, 1)  # [chunks, k, CHUNK]
        Yc = Y[:, cols].reshape(len(Y), -1, CHUNK).permute(1, 2, 0)  # [chunks, CHUNK, k]
        G += torch.bmm(Xc, Yc).double().sum(0)
    return G


def linear_rows(x: Tensor) -> Tensor:
    """A Linear's input as rows ``[N, features]``: the weight gradient is ``b^T a``."""
    return x.reshape(-1, x.shape[-1])


def out_rows(g: Tensor) -> Tensor:
    """A Linear's output gradients ``[k, ..., out]`` as ``[k, N, out]``, rows matching ``linear_rows``."""
    return g.reshape(g.shape[0], -1, g.shape[-1])


def task_rows(g: Tensor) -> Tensor:
    """``[k, *shape]`` as ``[k, numel]``: one row per task (a 0-d tensor's, a scalar
    parameter's such as a learned temperature, is one number)."""
    return g.reshape(g.shape[0], -1)


def add_grad(p: Tensor, g: Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g.contiguous() if g.is_contiguous() else g.clone(memory_format=torch.contiguous_format)
    else:
        p.grad.add_(g)


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The floating dtype of the largest rounding (an integer input's counts as exact)."""
    floats = [d for d in dtypes if d.is_floating_point] or [torch.float64]
    return max(floats, key=lambda d: torch.finfo(d).eps)


def _wide(g: Tensor) -> Tensor:
    return g.float() if g.dtype in (torch.float16, torch.bfloat16) else g


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)  # one call: no copy
