"""FeatureExtractor (Russian article, 001, example 2): outputs of named layers.

`gradmod.capture.FeatureExtractor` on ResNet-50 (weights=None) with
``layers=["layer4", "avgpool"]`` and ``torch.ones(10, 3, 224, 224)`` prints the
article's line ``{'layer4': torch.Size([10, 2048, 7, 7]), 'avgpool': torch.Size([10, 2048, 1, 1])}``.
An unknown layer name is a ValueError listing close names (``--layers layer5`` shows it).

Unlike the article's class, the hooks are kept as handles and removed on exit (the
article's stayed on the model), and each call returns fresh outputs, not the previous
call's dictionary.

    python scripts/feature_extractor.py [--batch 10] [--layers layer4 avgpool]
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradmod.capture import FeatureExtractor
from gradmod.models import build_model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--layers", nargs="+", default=["layer4", "avgpool"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build_model("resnet50", in_channels=3, num_classes=1000, image_size=args.size).to(args.device)
    dummy_input = torch.ones(args.batch, 3, args.size, args.size, device=args.device)
    # no_grad: only the shapes are wanted, so no graph is kept for the features.
    with FeatureExtractor(model, args.layers) as resnet_features, torch.no_grad():
        features = resnet_features(dummy_input)
    print({name: output.shape for name, output in features.items()})
    return {name: output.shape for name, output in features.items()}


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad --layers name: one line, not a traceback
        sys.exit(f"error: {e}")
