"""Tensor hooks, the first example of the Japanese article (000): a.grad and b.grad.

    a = ones(5, requires_grad=True); b = 2 * a; b.retain_grad(); c = b.mean(); c.backward()

prints a.grad = 0.4 and b.grad = 0.2 everywhere, as in the article. Then a tensor hook
with the documented contract, ``hook(grad) -> Tensor | None`` returning a new tensor
(never changing ``grad`` in place), and `gradmod.capture.list_hooks` showing it registered and,
after ``handle.remove()``, gone.

Where the article is wrong: it says hooks only run during backward. Tensor hooks do, but
module forward hooks run during the forward pass (see scripts/activation_grad_hooks.py).

    python scripts/tensor_hook_basics.py
"""

from __future__ import annotations

import argparse

import torch

from gradmod.capture import list_hooks


def main(argv=None) -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)

    a = torch.ones(5, requires_grad=True)
    b = 2 * a
    b.retain_grad()  # b is not a leaf: without this its .grad is not kept
    c = b.mean()
    c.backward()
    print(a.grad, b.grad)  # dc/db = 1/5, dc/da = 2/5

    # A hook returns a new gradient; autograd uses it for everything upstream of b.
    a2 = torch.ones(5, requires_grad=True)
    b2 = 2 * a2
    handle = b2.register_hook(lambda grad: grad * 10)
    print("hooks on b:", list_hooks(b2).entries)
    b2.mean().backward()
    print("a.grad with b's gradient scaled by 10:", a2.grad)
    handle.remove()
    print("hooks on b after remove():", list_hooks(b2).total)
    return {"a_grad": a.grad, "b_grad": b.grad, "scaled_a_grad": a2.grad}


if __name__ == "__main__":
    main()
