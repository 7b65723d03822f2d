"""VerboseExecution (Russian article, 001, example 1): each layer's output shape.

`gradmod.capture.trace_shapes` hooks every direct child of ResNet-50 (weights=None),
runs ``torch.ones(10, 3, 224, 224)`` once and prints the article's ten lines, from
``conv1: torch.Size([10, 64, 112, 112])`` to ``fc: torch.Size([10, 1000])``.
``--leaves`` traces every leaf module instead (a module called twice prints twice).

Unlike the article's wrapper, the hooks are removed afterwards (it kept them forever, so
every later forward printed again), the pass runs without autograd, and in eval mode so
the BatchNorm running statistics are not changed by the dummy input.

    python scripts/verbose_shapes.py [--batch 10] [--size 224] [--leaves]
"""

from __future__ import annotations

import argparse

import torch

from gradmod.capture import trace_shapes
from gradmod.models import build_model


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--leaves", action="store_true", help="every leaf module, not just direct children")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build_model("resnet50", in_channels=3, num_classes=1000, image_size=args.size).to(args.device)
    dummy_input = torch.ones(args.batch, 3, args.size, args.size, device=args.device)
    return trace_shapes(model, dummy_input, leaves=args.leaves)


if __name__ == "__main__":
    main()
