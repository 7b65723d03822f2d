"""The per-example form of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: the recurrence replayed
once, with the saved input and the output gradients, for the gates' per-example gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gradmod.hooks.per_sample.forms.base import Form, Inputs


class RNNForm(Form):
    """``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: the recurrence replayed once with autograd for
    the gradient of each step's input and hidden projections (``x W_ih^T + b_ih``, ``h W_hh^T
    + b_hh``); example i's weight gradient is then a sum over its steps, as for a Linear
    on a sequence. Every layer and direction, padded or packed sequences (each example's
    recurrence stops at its own length); dropout between layers and ``proj_size`` are refused
    when the layer is set up (``refusal``)."""

    whole_call = True
    takes_packed = True

    def refusal(self, m: nn.Module) -> str | None:
        if getattr(m, "proj_size", 0):
            return "proj_size > 0"
        if m.dropout and m.training and m.num_layers > 1:
            return "dropout between layers (its masks cannot be replayed)"
        return None

    def per_example(self, m, a: Inputs, b: list, names):
        x = a.args[0] if a.args else a.kwargs["input"]
        grads = [g for g, _ in b]
        lengths = None
        if isinstance(x, PackedSequence):  # padded in the sequences' own order; each its own length
            grads[0] = pad_packed_sequence(x._replace(data=grads[0]), batch_first=True)[0]
            x, lengths = pad_packed_sequence(x, batch_first=True)
            lengths = lengths.to(x.device)
        elif isinstance(x, Tensor) and x.dim() == 3:
            x, grads[0] = (t.movedim(0 if m.batch_first else 1, 0) for t in (x, grads[0]))
        else:
            raise ValueError(f"{type(m).__name__}: the per_sample stage takes batched 3-D inputs, not unbatched ones")
        hx = a.args[1] if len(a.args) > 1 else a.kwargs.get("hx")
        x = x.detach().requires_grad_()  # a graph to differentiate
        with torch.enable_grad():
            outs, taps = self._replay(m, x, hx, lengths)
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

    def _replay(self, m, x: Tensor, hx, lengths: Tensor | None = None):
        """Outputs (the output batch first; h_n, c_n as torch gives them) and, per layer and direction,
        (its input, the input projection, the previous hidden states, each step's hidden projection).
        ``lengths``: each example's own length (packed sequences): its state stops there, and
        the reverse direction starts from its own last step."""
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
                seq = _reverse(inp, lengths) if d else inp
                h = h0[j].detach().requires_grad_()
                c = None if c0 is None else c0[j].detach().requires_grad_()
                gi = F.linear(seq, getattr(m, f"weight_ih{sfx}").detach(), _bias(m, f"bias_ih{sfx}"))
                prev, steps, ys = [], [], []
                for t in range(seq.shape[1]):
                    prev.append(h)
                    gh = F.linear(h, getattr(m, f"weight_hh{sfx}").detach(), _bias(m, f"bias_hh{sfx}"))
                    steps.append(gh)
                    h_t, c_t = self._cell(m, gi[:, t], gh, h, c)
                    if lengths is None:
                        h, c = h_t, c_t
                    else:  # a sequence that ended keeps its last state
                        on = (t < lengths).unsqueeze(1)
                        h, c = torch.where(on, h_t, h), None if c is None else torch.where(on, c_t, c)
                    ys.append(h)
                y = torch.stack(ys, 1)
                outs.append(_reverse(y, lengths) if d else y)
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


def _reverse(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Each example's steps in reverse order, within its own length (the rest left in place)."""
    if lengths is None:
        return x.flip(1)
    t = torch.arange(x.shape[1], device=x.device)
    idx = torch.where(t < lengths.unsqueeze(1), lengths.unsqueeze(1) - 1 - t, t)
    return x.gather(1, idx.unsqueeze(2).expand_as(x))


def _bias(m: nn.Module, name: str) -> Tensor | None:
    b = getattr(m, name, None) if m.bias else None
    return None if b is None else b.detach()
