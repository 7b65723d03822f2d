"""nn.Module hooks and apply (Korean article, 003).

1. A forward hook on ``model[1]`` (the ReLU) of ``Sequential(Linear(10, 5), ReLU(),
   Linear(5, 1))`` prints the module and its output; a forward *pre*-hook prints before
   the module's forward.
2. A full backward hook on each layer prints as backward reaches it: once per module,
   last layer first.
3. Hook inspection with `gradmod.capture.list_hooks` (the module's ``_forward_hooks``,
   ``_backward_hooks``, ... and a tensor's ``_backward_hooks``), before and after
   ``remove()``: nothing is left behind.
4. ``module.apply`` visits in post-order: for the tree 1(2(4,5),3(6)) it prints
   ``4, 5, 2, 6, 3, 1``.
5. ``MyModel`` (``linear1 = Linear(10, 20)``, ``linear2 = Linear(20, 30)``) initialised
   with `gradmod.weight_init.apply_init(model, "xavier")`: xavier-uniform weights inside
   +-sqrt(6 / (fan_in + fan_out)) and zero biases (``gradmod/conf/init/xavier.yaml`` for training).

Where the article is wrong: it says a forward hook runs *before* the forward pass (that is
``register_forward_pre_hook``; step 1 prints the pre-hook, then the forward hook with the
output), and that a full backward hook runs once after the whole backward pass with every
layer's gradients (step 2 prints one call per module, during backward).

    python scripts/module_apply_init.py
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from gradmod.capture import list_hooks
from gradmod.weight_init import apply_init


class Node(nn.Module):
    """A module labelled with a number, holding child nodes: a tree to watch `apply` walk."""

    def __init__(self, label: int, *children: Node):
        super().__init__()
        self.label = label
        for i, child in enumerate(children):
            self.add_module(f"child{i}", child)


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(10, 20)
        self.linear2 = nn.Linear(20, 30)

    def forward(self, x):
        return self.linear2(self.linear1(x))


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 1))

    print("1. a forward pre-hook and a forward hook on model[1], full backward hooks on every layer")

    def my_forward_pre_hook(module, input):
        print(f"   before {module}'s forward, input: {input[0].detach()}")

    def my_forward_hook(module, input, output):
        print(f"   after {module}'s forward, output: {output.detach()}")

    backward_order = []

    def my_backward_hook(module, grad_input, grad_output):
        backward_order.append(module.name)
        print(f"   backward hook on model[{module.name}] ({module}), grad_output {tuple(grad_output[0].shape)}")

    relu_layer = model[1]
    handles = [
        relu_layer.register_forward_pre_hook(my_forward_pre_hook),
        relu_layer.register_forward_hook(my_forward_hook),
    ]
    for name, layer in model.named_children():
        layer.name = name
        handles.append(layer.register_full_backward_hook(my_backward_hook))
    x = torch.randn(1, 10, requires_grad=True)  # so the first Linear has an input gradient
    print("   forward:")
    out = model(x)
    handles.append(out.register_hook(lambda grad: grad))  # a tensor hook, to inspect below
    print("2. backward: each module's hook as backward reaches it")
    out.sum().backward()

    print("3. hooks registered, then after remove():")
    listing = list_hooks(model)
    for entry in listing.entries:
        print(f"   model[{entry.name}].{entry.kind}: {entry.count}")
    print(f"   out._backward_hooks: {len(out._backward_hooks)}")
    for h in handles:
        h.remove()
    after = list_hooks(model).total + list_hooks(out).total
    print(f"   total before: {listing.total + 1}, after: {after}")

    print("4. apply order on the tree 1(2(4,5),3(6)):")
    tree = Node(1, Node(2, Node(4), Node(5)), Node(3, Node(6)))
    order = []
    tree.apply(lambda m: order.append(m.label))
    print("  ", ", ".join(map(str, order)))

    print("5. MyModel with apply_init(model, 'xavier'):")
    my_model = apply_init(MyModel(), "xavier")
    init_ok = True
    for name, layer in my_model.named_children():
        bound = math.sqrt(6 / (layer.in_features + layer.out_features))
        w_max = layer.weight.abs().max().item()
        bias_zero = bool((layer.bias == 0).all())
        init_ok &= w_max <= bound and bias_zero
        print(f"   {name}: max |weight| {w_max:.3f} <= bound {bound:.3f}: {w_max <= bound}, bias all zero: {bias_zero}")
    return {
        "backward_order": backward_order,
        "hooks_before": listing.total + 1,
        "hooks_after": after,
        "apply_order": order,
        "init_ok": init_ok,
    }


if __name__ == "__main__":
    main()
