"""Gradient clipping with parameter hooks (Russian article, 001, example 3).

The article's ``gradient_clipper(model, 0.01)`` becomes one gradmod rule,
``{"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}``,
attached to ResNet-50 (weights=None). With the article's dummy input and loss
(``pred.log().mean()``), it prints the loss, ``fc.bias.grad[:25]`` (values such as
``-0.0100``, clipped) and checks that every parameter's gradient lies in [-0.01, 0.01].
The values differ from the article's: the weights are random.

Where the article is wrong or silent:

* Its hook calls ``grad.clamp_(-val, val)``, changing the gradient in place, which the
  tensor-hook contract forbids; gradmod's ``clamp`` returns a new tensor.
* ``pred.log()`` is NaN for every negative logit, so the loss prints ``nan``; the
  gradients are still finite, because d log(x)/dx = 1/x is computed for every x. The
  script keeps that loss (it is the article's) and says so.
* A hook clamps each backward's gradient before it is accumulated into ``.grad``, so with
  several backward passes per step the sum can exceed the bound; one backward here.

    python scripts/gradient_clipper.py [--batch 10] [--size 224] [--val 0.01]
"""

from __future__ import annotations

import argparse

import torch

import gradmod
from gradmod.models import build_model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--val", type=float, default=0.01)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build_model("resnet50", in_channels=3, num_classes=1000, image_size=args.size).to(args.device)
    rules = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -args.val, "max": args.val}]}}
    dummy_input = torch.ones(args.batch, 3, args.size, args.size, device=args.device)
    with gradmod.attach(model, rules) as hooks:
        print(f"clamp({-args.val}, {args.val}) on {len(hooks.chains)} parameters")
        pred = model(dummy_input)
        loss = pred.log().mean()  # NaN wherever pred < 0; its gradient 1/pred is finite
        loss.backward()
    print(f"loss: {loss.item()} (log is NaN for the {int((pred < 0).sum())} negative logits of {pred.numel()})")
    print(model.fc.bias.grad[:25])

    grads = [p.grad for p in model.parameters()]
    lo, hi = min(g.min().item() for g in grads), max(g.max().item() for g in grads)
    finite = all(torch.isfinite(g).all() for g in grads)
    in_range = -args.val <= lo and hi <= args.val
    clipped = sum(int((g.abs() == args.val).sum()) for g in grads)
    print(
        f"every gradient in [{-args.val}, {args.val}]: {in_range} (min {lo:.4f}, max {hi:.4f}, "
        f"all finite: {finite}, {clipped:,} entries at the bound)"
    )
    return {
        "in_range": in_range,
        "finite": finite,
        "min": lo,
        "max": hi,
        "clipped": clipped,
        "loss": loss.item(),
        "model": model,
    }


if __name__ == "__main__":
    main()
