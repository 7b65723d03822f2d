"""Every article script, run in-process through its ``main(argv)``, with its printed values."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.ndimage import zoom
from test_capture import ARTICLE_TABLE

from gradmod.capture import list_hooks
from gradmod.models import build_model

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# The Russian article's VerboseExecution output for resnet50() on torch.ones(10, 3, 224, 224).
ARTICLE_SHAPES = """\
conv1: torch.Size([10, 64, 112, 112])
bn1: torch.Size([10, 64, 112, 112])
relu: torch.Size([10, 64, 112, 112])
maxpool: torch.Size([10, 64, 56, 56])
layer1: torch.Size([10, 256, 56, 56])
layer2: torch.Size([10, 512, 28, 28])
layer3: torch.Size([10, 1024, 14, 14])
layer4: torch.Size([10, 2048, 7, 7])
avgpool: torch.Size([10, 2048, 1, 1])
fc: torch.Size([10, 1000])
"""


def script(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tensor_hook_basics(capsys):
    result = script("tensor_hook_basics").main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "tensor([0.4000, 0.4000, 0.4000, 0.4000, 0.4000]) tensor([0.2000, 0.2000, 0.2000, 0.2000, 0.2000])"
    )
    assert torch.equal(result["a_grad"], torch.full((5,), 0.4))
    assert torch.equal(result["b_grad"], torch.full((5,), 0.2))
    assert torch.allclose(result["scaled_a_grad"], torch.full((5,), 4.0))
    assert lines[-1] == "hooks on b after remove(): 0"


def test_verbose_shapes_small(capsys):
    shapes = script("verbose_shapes").main(["--batch", "1", "--size", "64"])
    out = capsys.readouterr().out
    assert [n for n, _ in shapes] == [line.split(":")[0] for line in ARTICLE_SHAPES.splitlines()]
    assert out.splitlines()[0] == "conv1: torch.Size([1, 64, 32, 32])"
    assert out.splitlines()[-1] == "fc: torch.Size([1, 1000])"


@pytest.mark.slow
def test_verbose_shapes_prints_the_articles_ten_lines(capsys):
    script("verbose_shapes").main([])
    assert capsys.readouterr().out == ARTICLE_SHAPES


def test_feature_extractor_small(capsys):
    shapes = script("feature_extractor").main(["--batch", "2", "--size", "64"])
    assert (
        capsys.readouterr().out == "{'layer4': torch.Size([2, 2048, 2, 2]), 'avgpool': torch.Size([2, 2048, 1, 1])}\n"
    )
    assert list(shapes) == ["layer4", "avgpool"]


def test_feature_extractor_unknown_layer():
    with pytest.raises(ValueError, match=r"unknown layer 'layer5'; close names: \[.*'layer4'"):
        script("feature_extractor").main(["--batch", "1", "--size", "64", "--layers", "layer5"])


@pytest.mark.slow
def test_feature_extractor_prints_the_articles_shapes(capsys):
    script("feature_extractor").main([])
    assert (
        capsys.readouterr().out == "{'layer4': torch.Size([10, 2048, 7, 7]), 'avgpool': torch.Size([10, 2048, 1, 1])}\n"
    )


def check_clipper(result, out, batch, size):
    assert result["in_range"] and result["finite"] and result["clipped"] > 0
    assert result["min"] == pytest.approx(-0.01) and result["max"] == pytest.approx(0.01)
    assert "every gradient in [-0.01, 0.01]: True" in out
    assert out.splitlines()[1].startswith("loss: nan")  # the article's loss: log of negative logits
    assert re.search(r"tensor\(\[[-\d., \n]+\]\)", out)  # fc.bias.grad[:25]
    # The hooks did what torch.nn.utils.clip_grad_value_ does after one plain backward.
    torch.manual_seed(0)
    plain = build_model("resnet50", in_channels=3, num_classes=1000, image_size=size)
    plain(torch.ones(batch, 3, size, size)).log().mean().backward()
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.01)
    hooked = result["model"]
    for (name, p), q in zip(hooked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert list_hooks(hooked).total == 0


def test_gradient_clipper_small(capsys):
    result = script("gradient_clipper").main(["--batch", "2", "--size", "32"])
    check_clipper(result, capsys.readouterr().out, 2, 32)


@pytest.mark.slow
def test_gradient_clipper_at_the_articles_size(capsys):
    result = script("gradient_clipper").main([])
    check_clipper(result, capsys.readouterr().out, 10, 224)


def test_activation_grad_hooks(capsys):
    result = script("activation_grad_hooks").main([])
    out = capsys.readouterr().out
    verdicts = re.findall(r"^Gradients less than zero: (True|False)$", out, flags=re.M)
    # the article's clamp-then-print, print-then-clamp, then the modules rule
    assert verdicts == ["False", "True", "False"]
    assert result == {"relu_negative": False, "conv_negative": False, "hooks_left": 0}
    assert "plan: [('relu:output', ['min_zero'])]" in out
    # forward hooks run during forward, backward hooks last layer first
    order = [line.strip().split("(")[0] for line in out.splitlines() if "hook(" in line or ":" in line]
    start, end = order.index("forward: start"), order.index("forward: end; backward: start")
    assert order[start + 1 : end] == ["forward_hook", "forward_hook"]
    assert "full_backward_hook(Conv2d, grad_input=[(1, 3, 8, 8)], grad_output=[(1, 10, 4, 4)])" in out


def test_model_summary(capsys):
    text = script("model_summary").main([])
    assert text == ARTICLE_TABLE
    assert capsys.readouterr().out == ARTICLE_TABLE + "\n"


def test_module_apply_init(capsys):
    result = script("module_apply_init").main([])
    out = capsys.readouterr().out
    assert "   4, 5, 2, 6, 3, 1\n" in out
    assert result["apply_order"] == [4, 5, 2, 6, 3, 1]
    assert result["backward_order"] == ["2", "1", "0"]
    assert (result["hooks_before"], result["hooks_after"]) == (6, 0)
    assert "   total before: 6, after: 0" in out
    assert result["init_ok"]
    # forward pre-hook before the forward hook, both before any backward hook
    assert (
        out.index("before ReLU()'s forward")
        < out.index("after ReLU()'s forward")
        < out.index("backward hook on model[")
    )
    assert out.count("bias all zero: True") == 2


def test_gradient_overlay_upsamples_like_the_articles_zoom():
    mod = script("mnist_gradcam")
    torch.manual_seed(0)
    grads = torch.randn(2, 32, 14, 14)
    images = torch.rand(2, 1, 28, 28)
    grad_map, overlay = mod.gradient_overlay(images, grads)
    for i in range(2):
        expected = zoom(grads[i].sum(0).numpy(), np.array((28, 28)) / (14, 14), order=1)
        np.testing.assert_allclose(grad_map[i].numpy(), expected, rtol=1e-4, atol=1e-5)
        cam = expected + images[i, 0].numpy()
        np.testing.assert_allclose(overlay[i].numpy(), cam / cam.max(), rtol=1e-4, atol=1e-5)


def test_mnist_gradcam_quick(capsys, tmp_path):
    argv = ["--epochs", "1", "--train-size", "500", "--out", str(tmp_path), "--data-dir", str(tmp_path)]
    result = script("mnist_gradcam").main(argv)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "the bundled sample of MNIST: 500 train / 1000 test digits, 1 epochs"
    assert re.fullmatch(r"Epoch: 1, Loss: \d\.\d{3}", lines[1])
    assert lines[2].startswith("Validation Acc ")
    assert lines[3:8] == [
        "img: torch.Size([1, 1, 28, 28])",
        "label: torch.Size([1])",
        "output: torch.Size([1, 10])",
        "(14, 14)",
        "(28, 28)",
    ]
    assert "32 overlays from 32 distinct gradients; gradients stored by the recorder: 1" in out
    names = ["feature_maps", "gradients", "gradient_map", "digit", "overlay", "overlays_32", "gradcam_32"]
    for name in names:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each of the 32 panels uses its own image's gradient: compare with one image at a time.
    model, images, preds, grads = result["model"], result["images"], result["preds"], result["grads"]
    acts = []
    handle = model.conv2.register_forward_hook(lambda m, a, o: acts.append(o))
    for i in (0, 5, 31):
        acts.clear()
        logits = model(images[i : i + 1])
        (alone,) = torch.autograd.grad(logits[0, preds[i]], acts[0])
        torch.testing.assert_close(grads[i], alone[0], rtol=1e-4, atol=1e-6)
    handle.remove()
    assert not torch.allclose(grads[0], grads[1])
    assert result["cams"].shape == (32, 28, 28) and (result["cams"] >= 0).all()
    assert list_hooks(model).total == 0


@pytest.mark.slow
def test_mnist_gradcam_default_run_learns(capsys, tmp_path):
    result = script("mnist_gradcam").main(["--out", str(tmp_path), "--data-dir", str(tmp_path)])  # the sample
    assert len(result["losses"]) == 3 and result["losses"][0] > result["losses"][-1]
    assert result["accuracy"] > 0.9
