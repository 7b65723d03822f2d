"""The torchsummary table of the MNIST CNN (Japanese article, 002, step 2).

`gradmod.capture.summary` builds it with forward hooks on every leaf module and prints,
for the article's ``Net`` (`gradmod.models.MnistCNN`), the article's table exactly:
``Conv2d-1 [-1, 32, 28, 28] 320``, ``Conv2d-2 [-1, 32, 14, 14] 9,248``,
``Linear-3 [-1, 10] 15,690``, ``Total params: 25,258`` and the same sizes in MB.
ReLU and max-pooling are functional in that model, so they have no rows.

No torchsummary needed; unlike it, the probing forward runs in eval mode (BatchNorm
statistics untouched), containers never count a parameter twice, and totals come from
the model's parameters (shared weights once).

    python scripts/model_summary.py [--model mnist_cnn|resnet18|resnet50]
"""

from __future__ import annotations

import argparse

from gradmod.capture import summary
from gradmod.models import MODELS, build_model

INPUTS = {"mnist_cnn": (1, 28, 28), "resnet18": (3, 224, 224), "resnet50": (3, 224, 224)}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="mnist_cnn")
    args = parser.parse_args(argv)

    size = INPUTS[args.model]
    model = build_model(args.model, in_channels=size[0], num_classes=1000 if size[0] == 3 else 10, image_size=size[-1])
    text = summary(model, input_size=[list(size)])  # (channels, height, width), as the article
    print(text)
    return text


if __name__ == "__main__":
    main()
