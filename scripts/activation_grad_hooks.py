"""Activation-gradient hooks and module hook signatures (Japanese article, 000).

1. The article's ``myNet`` registers two hooks on ``x = relu(conv(x))`` inside
   ``forward``: ``clamp(min=0)``, then a print. Hooks on one tensor run in registration
   order, so the print sees the clamped gradient: ``Gradients less than zero: False``.
   In the opposite order it sees the raw gradient and prints ``True``.
2. The same without touching ``forward``: a gradmod rule
   ``{"modules": "relu", "transforms": ["min_zero"]}`` transforms the gradient of the
   ReLU's output; a `gradmod.capture.Recorder` attached after it records that gradient
   (its hook runs later), and the one reaching ``conv``.
3. Module hook signatures: ``forward_hook(module, input, output)`` runs *during the
   forward pass*, right after the module's forward; ``full_backward_hook(module,
   grad_input, grad_output)`` runs during backward, once per module, when that module's
   input gradients are ready. The image requires grad here: otherwise ``conv`` has no
   input gradient (``grad_input == (None,)``) and PyTorch warns that the hook fires on
   its output gradients instead.

Where the article is wrong: it says hooks only run during backward; step 3 prints the
forward hook between "forward: start" and "forward: end".

    python scripts/activation_grad_hooks.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import gradmod
from gradmod.capture import Recorder, list_hooks


def shapes(ts) -> list:
    return [None if t is None else tuple(t.shape) for t in ts]


class myNet(nn.Module):  # noqa: N801  (the article's name)
    """The article's model: one 3x8x8 image -> conv (10x4x4 = 160) -> relu -> fc1 (5)."""

    def __init__(self, activation_hooks: str | None = None):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.flatten = lambda x: x.view(-1)
        self.fc1 = nn.Linear(160, 5)
        self.activation_hooks = activation_hooks  # None, "clamp_then_print", "print_then_clamp"

    def forward(self, x):
        x = self.relu(self.conv(x))
        clamp = lambda grad: torch.clamp(grad, min=0)  # noqa: E731
        show = lambda grad: print("Gradients less than zero:", bool((grad < 0).any()))  # noqa: E731
        if self.activation_hooks == "clamp_then_print":
            x.register_hook(clamp)
            x.register_hook(show)
        elif self.activation_hooks == "print_then_clamp":
            x.register_hook(show)
            x.register_hook(clamp)
        return self.fc1(self.flatten(x))


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(0)
    image = torch.randn(1, 3, 8, 8)

    print("1. hooks inside forward, clamp then print (the article):")
    net = myNet("clamp_then_print")
    net(image).sum().backward()
    print("   print then clamp:")
    net.activation_hooks = "print_then_clamp"
    net(image).sum().backward()

    print("2. the same through a modules rule:")
    net.activation_hooks = None
    rules = {"no_negative": {"modules": "relu", "transforms": ["min_zero"]}}
    with gradmod.attach(net, rules) as hooks, Recorder(net, ["relu", "conv"]) as rec:
        print("   plan:", hooks.chains)
        net(image).sum().backward()
        relu_negative = bool((rec.grad("relu") < 0).any())
        conv_negative = bool((rec.grad("conv") < 0).any())
    print("Gradients less than zero:", relu_negative)
    print("   reaching conv's output, less than zero:", conv_negative)

    print("3. module hook signatures:")

    def forward_hook(module, input, output):
        print(f"   forward_hook({type(module).__name__}, input={shapes(input)}, output={tuple(output.shape)})")

    def backward_hook(module, grad_input, grad_output):
        print(
            f"   full_backward_hook({type(module).__name__}, grad_input={shapes(grad_input)}, "
            f"grad_output={shapes(grad_output)})"
        )

    handles = [m.register_forward_hook(forward_hook) for m in (net.conv, net.fc1)]
    handles += [m.register_full_backward_hook(backward_hook) for m in (net.conv, net.fc1)]
    print("   hooks registered:", list_hooks(net).total)
    print("   forward: start")
    out = net(image.requires_grad_())
    print("   forward: end; backward: start")
    out.sum().backward()
    print("   backward: end")
    for h in handles:
        h.remove()
    print("   hooks after remove():", list_hooks(net).total)
    return {"relu_negative": relu_negative, "conv_negative": conv_negative, "hooks_left": list_hooks(net).total}


if __name__ == "__main__":
    main()
