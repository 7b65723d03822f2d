import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18, resnet50
from torchvision.models.feature_extraction import create_feature_extractor

from gradmod.capture import FeatureExtractor, Recorder, grad_cam, list_hooks, summary, summary_rows, trace_shapes
from gradmod.models import MnistCNN

# The article's torchsummary table (Japanese article), verbatim.
ARTICLE_TABLE = """\
----------------------------------------------------------------
        Layer (type)               Output Shape         Param #
================================================================
            Conv2d-1           [-1, 32, 28, 28]             320
            Conv2d-2           [-1, 32, 14, 14]           9,248
            Linear-3                   [-1, 10]          15,690
================================================================
Total params: 25,258
Trainable params: 25,258
Non-trainable params: 0
----------------------------------------------------------------
Input size (MB): 0.00
Forward/backward pass size (MB): 0.24
Params size (MB): 0.10
Estimated Total Size (MB): 0.34
----------------------------------------------------------------"""


class CamNet(nn.Module):
    """conv -> relu -> global average pool -> linear: Grad-CAM has a closed form here.

    d score_c / d A_k(i, j) = W[c, k] / (H * W), so the Grad-CAM weights are W[c] / (H * W).
    """

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean(dim=(2, 3)))


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread, or a busy 2-core machine spends each step handing off work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_trace_shapes_children_and_leaves():
    torch.manual_seed(0)
    model = resnet18(weights=None)
    lines = []
    shapes = trace_shapes(model, torch.ones(2, 3, 64, 64), print_fn=lines.append)
    assert [n for n, _ in shapes] == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1",
        "layer2",
        "layer3",
        "layer4",
        "avgpool",
        "fc",
    ]
    assert lines[0] == "conv1: torch.Size([2, 64, 32, 32])"
    assert lines[-1] == "fc: torch.Size([2, 1000])"
    leaves = trace_shapes(model, torch.ones(1, 3, 64, 64), leaves=True, print_fn=None)
    assert leaves[4] == ("layer1.0.conv1", torch.Size([1, 64, 16, 16]))
    # each BasicBlock calls its one ReLU twice: once per call
    assert sum(n == "layer1.0.relu" for n, _ in leaves) == 2
    assert list_hooks(model).total == 0


def test_trace_shapes_releases_hooks_when_forward_fails():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2))  # second layer's shape is wrong
    lines = []
    with pytest.raises(RuntimeError):
        trace_shapes(model, torch.ones(1, 4), print_fn=lines.append)
    assert lines == ["0: torch.Size([1, 3])"]  # it shows how far the forward got
    assert list_hooks(model).total == 0


def test_trace_shapes_leaves_batchnorm_stats_and_modes_alone():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    model[1].eval()  # a frozen BatchNorm must stay frozen
    stats = model[1].running_mean.clone()
    trace_shapes(model, torch.randn(4, 1, 8, 8), print_fn=None)
    assert torch.equal(model[1].running_mean, stats)
    assert model.training and model[0].training and not model[1].training


def test_feature_extractor_matches_torchvision():
    torch.manual_seed(0)
    model = resnet50(weights=None).eval()
    x = torch.randn(2, 3, 64, 64)
    layers = ["layer2.1.conv2", "layer4", "avgpool", "fc"]
    reference = create_feature_extractor(model, return_nodes=layers)
    with torch.no_grad(), FeatureExtractor(model, layers) as extract:
        ours = extract(x)
        theirs = reference(x)
    assert list(ours) == layers
    for name in layers:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    assert ours["avgpool"].shape == (2, 2048, 1, 1)
    assert list_hooks(model).total == 0


def test_feature_extractor_unknown_layer_lists_close_names():
    model = resnet18(weights=None)
    with pytest.raises(ValueError, match=r"unknown layer 'layer5'; close names: \[.*'layer4'"):
        FeatureExtractor(model, ["layer4", "layer5"])
    assert list_hooks(model).total == 0  # nothing registered before the check failed


def test_feature_extractor_keeps_the_graph():
    model = CamNet()
    with FeatureExtractor(model, ["conv"]) as extract:
        feats = extract(torch.randn(1, 3, 5, 5))
    feats["conv"].sum().backward()
    assert model.conv.weight.grad is not None


def test_recorder_outputs_grads_detached_and_one_grad_per_backward():
    torch.manual_seed(0)
    model = MnistCNN()
    x = torch.randn(3, 1, 28, 28)
    with Recorder(model, ["conv2", "l1"], keep=4) as rec:
        out = model(x)
        out.sum().backward()
        # the gradient of l1's output of out.sum() is all ones
        torch.testing.assert_close(rec.grad("l1"), torch.ones(3, 10))
        torch.testing.assert_close(rec.output("l1"), out.detach())
        a = rec.output("conv2")
        assert a.shape == (3, 32, 14, 14) and not a.requires_grad and a.grad_fn is None
        assert len(rec.grads["conv2"]) == 1 and len(rec.outputs["conv2"]) == 1
        with torch.no_grad():  # forward without backward: an output, no gradient
            model(x)
        assert len(rec.outputs["conv2"]) == 2 and len(rec.grads["conv2"]) == 1
    assert list_hooks(model).total == 0


def test_recorder_gradient_equals_autograd():
    torch.manual_seed(0)
    model = MnistCNN()
    x = torch.randn(2, 1, 28, 28)
    acts = []
    handle = model.conv2.register_forward_hook(lambda m, a, o: acts.append(o))
    out = model(x)
    (expected,) = torch.autograd.grad(out[:, 3].sum(), acts[0])
    handle.remove()
    with Recorder(model, ["conv2"]) as rec:
        model(x)[:, 3].sum().backward()
    torch.testing.assert_close(rec.grad("conv2"), expected)


def test_recorder_copies_before_in_place_ops():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].weight.copy_(-torch.eye(4)), model[0].bias.zero_()
    with Recorder(model, ["0"]) as rec:
        out = model(torch.ones(1, 4))
        stored = rec.output("0")
    # the in-place ReLU zeroed the Linear's output tensor, not the recorder's copy
    assert torch.equal(out, torch.zeros(1, 4)) and torch.equal(stored, -torch.ones(1, 4))


def test_recorder_memory_is_flat_over_many_steps(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    sizes = []
    with Recorder(model, ["0", "2"], keep=3) as rec:
        for step in range(500):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if step >= 2:
                sizes.append(rec.nbytes())
                assert all(len(d) == 3 for d in (*rec.outputs.values(), *rec.grads.values()))
        assert len(rec._tensor_handles) <= 3 * 2
    assert len(set(sizes)) == 1
    assert sizes[0] == 3 * 2 * 8 * (32 + 10) * 4  # 3 steps x (output + grad) x float32
    assert list_hooks(model).total == 0


def test_recorder_ignores_backward_after_remove():
    model = MnistCNN()
    rec = Recorder(model, ["conv2"])
    out = model(torch.randn(1, 1, 28, 28))
    rec.remove()
    out.sum().backward()  # the graph was built while recording
    assert len(rec.grads["conv2"]) == 0


def test_recorder_rejects_bad_keep():
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        Recorder(MnistCNN(), ["conv1"], keep=0)


def hand_cam(model, x, target):
    a = model.conv(x)
    weights = model.fc.weight[target] / (a.shape[2] * a.shape[3])  # N x C
    relu_mask = (a > 0).float()
    # d score / d A_k(i, j) = W[c, k] / (H W) * 1[A_k(i, j) > 0]
    grads = weights[:, :, None, None] * relu_mask
    alpha = grads.mean(dim=(2, 3))
    cam = F.relu((alpha[:, :, None, None] * a).sum(1, keepdim=True))
    return F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


def test_grad_cam_equals_hand_computation():
    torch.manual_seed(0)
    model = CamNet()
    x = torch.randn(5, 3, 7, 9)
    with torch.no_grad():
        predicted = model(x).argmax(1)
        expected = hand_cam(model, x, predicted)
        expected_t2 = hand_cam(model, x, torch.full((5,), 2))
    cams = grad_cam(model, "conv", x)
    torch.testing.assert_close(cams, expected)
    torch.testing.assert_close(grad_cam(model, model.conv, x, target=2), expected_t2)
    assert cams.shape == (5, 7, 9) and (cams >= 0).all() and cams.sum() > 0
    # nothing left behind: no hooks, no parameter gradients, no graph
    assert list_hooks(model).total == 0
    assert all(p.grad is None for p in model.parameters())
    assert not cams.requires_grad


def test_grad_cam_on_mnist_cnn_is_per_image_and_non_negative():
    torch.manual_seed(0)
    model = MnistCNN().eval()
    x = torch.rand(4, 1, 28, 28)
    with torch.no_grad():
        cams = grad_cam(model, "conv2", x)  # works under no_grad too
    assert cams.shape == (4, 28, 28) and (cams >= 0).all()
    one = grad_cam(model, "conv2", x[2:3])
    torch.testing.assert_close(cams[2:3], one)  # a batch gives each image its own map


def test_grad_cam_with_frozen_parameters():
    model = CamNet()
    model.requires_grad_(False)
    cams = grad_cam(model, "conv", torch.randn(2, 3, 6, 6))
    assert cams.shape == (2, 6, 6)


def test_grad_cam_unknown_layer():
    with pytest.raises(ValueError, match="unknown layer 'conv3'"):
        grad_cam(MnistCNN(), "conv3", torch.rand(1, 1, 28, 28))


def test_summary_is_the_articles_table():
    assert summary(MnistCNN(), [[1, 28, 28]]) == ARTICLE_TABLE
    assert summary(MnistCNN(), (1, 28, 28)) == ARTICLE_TABLE
    rows = summary_rows(MnistCNN(), (1, 28, 28))
    assert [(r.layer, r.output_shape, r.params) for r in rows] == [
        ("Conv2d-1", [-1, 32, 28, 28], 320),
        ("Conv2d-2", [-1, 32, 14, 14], 9248),
        ("Linear-3", [-1, 10], 15690),
    ]


def test_summary_counts_frozen_and_shared_parameters_once():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.BatchNorm1d(4))
    model[3].requires_grad_(False)
    text = summary(model, (4,))
    assert "Total params: 28\n" in text  # 20 (Linear, once) + 8 (BatchNorm)
    assert "Trainable params: 20\n" in text and "Non-trainable params: 8\n" in text
    assert [r.layer for r in summary_rows(model, (4,))] == ["Linear-1", "ReLU-2", "Linear-3", "BatchNorm1d-4"]
    assert list_hooks(model).total == 0


def test_list_hooks_sees_every_kind_and_remove_clears_them():
    model = MnistCNN()
    assert list_hooks(model) == ([], 0)
    handles = [
        model.register_forward_pre_hook(lambda m, a: None),
        model.conv1.register_forward_hook(lambda m, a, o: None),
        model.conv1.register_forward_hook(lambda m, a, o: None),
        model.conv2.register_full_backward_hook(lambda m, gi, go: None),
        model.l1.register_full_backward_pre_hook(lambda m, go: None),
        model.l1.bias.register_hook(lambda g: g),
    ]
    entries, total = list_hooks(model)
    assert set(entries) == {
        ("", "_forward_pre_hooks", 1),
        ("conv1", "_forward_hooks", 2),
        ("conv2", "_backward_hooks", 1),
        ("l1", "_backward_pre_hooks", 1),
        ("l1.bias", "_backward_hooks", 1),
    }
    assert total == 6
    for h in handles:
        h.remove()
    assert list_hooks(model).total == 0


def test_list_hooks_on_a_tensor():
    t = torch.ones(3, requires_grad=True)
    assert list_hooks(t).total == 0
    h = (t * 2).register_hook(lambda g: g)  # hook on another tensor: not t's
    h2 = t.register_hook(lambda g: g)
    assert list_hooks(t) == ([("", "_backward_hooks", 1)], 1)
    h.remove(), h2.remove()
    assert list_hooks(t).total == 0
    with pytest.raises(TypeError, match="nn.Module or a Tensor"):
        list_hooks([t])
