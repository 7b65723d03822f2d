"""The per-example form of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: the recurrence replayed
once, with the saved input and the output gradients, for the gates' per-example gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.hooks.per_sample.form import Form, Inputs


class RNNForm(Form):
    """``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: the recurrence replayed once with autograd for
    the gradient of each step's input and hidden projections (``x W_ih^T + b_ih``, ``h W_hh^T
    + b_hh``); example i's weight gradient is then a sum over its steps, as for a Linear
    on a sequence. Every layer and direction; dropout between layers, ``proj_size`` and
    packed sequences are refused when the layer is set up (``refusal``)."""

    whole_call = True

    def refusal(self, m: nn.Module) -> str | None:
        if getattr(m, "proj_size", 0):
            return "proj_size > 0"
        if m.dropout and m.training and m.num_layers > 1:
            return "dropout between layers (its masks cannot be replayed)"
        return None

    def per_example(self, m, a: Inputs, b: list, names):
        x = a.args[0] if a.args else a.kwargs["input"]
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(
                f"{type(m).__name__}: the per_sample stage takes batched 3-D input tensors "
                "(not packed sequences or unbatched input)"
            )
        hx = a.args[1] if len(a.args) > 1 else a.kwargs.get("hx")
        x = x.movedim(0 if m.batch_first else 1, 0).detach().requires_grad_()  # a graph to differentiate
        with torch.enable_grad():
            outs, taps = self._replay(m, x, hx)
            grads = [g.movedim(0 if m.batch_first else 1, 0) if k == 0 else g for k, (g, _) in enumerate(b)]
            flat = [t for tap in taps.values() for t in (tap[1], *tap[3])]
            got = torch.autograd.grad(outs[: len(grads)], flat, grads, allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, got)]
        return self._weights(taps, got, names)

    @staticmethod
    def _weights(taps: dict, got: list, names) -> dict[str, Tensor]:
        out, k = {}, 0
        for sfx, (inp, _, prev, steps) in taps.items():
            g_in, g_h = got[k], torch.stack(got[k + 1 : k + 1 + len(steps)], 1)
            k += 1 + len(steps)
            parts = {
                f"weight_ih{sfx}": (g_in, inp),
                f"bias_ih{sfx}": (g_in, None),
                f"weight_hh{sfx}": (g_h, prev),
                f"bias_hh{sfx}": (g_h, None),
            }
            for n, (g, x) in parts.items():
                if n in names:
                    out[n] = g.sum(1) if x is None else torch.bmm(g.mT, x)
        return out

    def _replay(self, m, x: Tensor, hx):
        """Outputs (the output batch first; h_n, c_n as torch gives them) and, per layer and direction,
        (its input, the input projection, the previous hidden states, each step's hidden projection)."""
        lstm, dirs = isinstance(m, nn.LSTM), 2 if m.bidirectional else 1
        bsz, size = x.shape[0], m.hidden_size
        if hx is None:
            zeros = x.new_zeros(m.num_layers * dirs, bsz, size)
            hx = (zeros, zeros) if lstm else zeros
        h0, c0 = hx if lstm else (hx, None)
        taps, hs, cs, inp = {}, [], [], x
        for layer in range(m.num_layers):
            outs = []
            for d in range(dirs):
                sfx, j = f"_l{layer}" + ("_reverse" if d else ""), layer * dirs + d
                seq = inp.flip(1) if d else inp
                h = h0[j].detach().requires_grad_()
                c = None if c0 is None else c0[j].detach().requires_grad_()
                gi = F.linear(seq, getattr(m, f"weight_ih{sfx}").detach(), _bias(m, f"bias_ih{sfx}"))
                prev, steps, ys = [], [], []
                for t in range(seq.shape[1]):
                    prev.append(h)
                    gh = F.linear(h, getattr(m, f"weight_hh{sfx}").detach(), _bias(m, f"bias_hh{sfx}"))
                    steps.append(gh)
                    h, c = self._cell(m, gi[:, t], gh, h, c)
                    ys.append(h)
                y = torch.stack(ys, 1)
                outs.append(y.flip(1) if d else y)
                taps[sfx] = (seq, gi, torch.stack(prev, 1), steps)
                hs.append(h)
                cs.append(c)
            inp = torch.cat(outs, -1)
        result = [inp, torch.stack(hs)] + ([torch.stack(cs)] if lstm else [])
        return result, taps

    @staticmethod
    def _cell(m, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None):
        if isinstance(m, nn.LSTM):
            i, f, g, o = (gi + gh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if isinstance(m, nn.GRU):
            ir, iz, i_n = gi.chunk(3, -1)
            hr, hz, h_n = gh.chunk(3, -1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(i_n + r * h_n)
            return (1 - z) * n + z * h, None
        act = torch.tanh if m.nonlinearity == "tanh" else torch.relu
        return act(gi + gh), None


def _bias(m: nn.Module, name: str) -> Tensor | None:
    b = getattr(m, name, None) if m.bias else None
    return None if b is None else b.detach()
