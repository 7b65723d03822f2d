"""The ``per_sample`` section of ``python -m benchmarks``: one DP-SGD step (per-example clipping to
norm 1, noise multiplier 1, SGD) on Opacus' MNIST example net and a 784-512-512-10 MLP
(batch 64), torchvision's resnet18 with GroupNorm at 3x32x32 and a small transformer
(Embedding(1000, 128), two pre-norm blocks of MultiheadAttention(128, 4) and a 512-wide
MLP, length 64; batch 32), by each contender:

    plain         forward, backward, SGD step: no per-example gradients
    opacus        Opacus' GradSampleModule + DPOptimizer (its default mode), if installed
    opacus_ghost  Opacus' ghost clipping (GradSampleModuleFastGradientClipping,
                  DPOptimizerFastGradientClipping, DPLossFastGradientClipping), if installed
    gradmod       attach(model, {"dp": per_sample_clip(1.0, 1.0) on "*"}) and after_backward()

Peak memory: each contender runs a few steps in a fresh process, and the growth of its
peak resident set over the set-up is reported (the same measure for every contender).

    python -m benchmarks.sections.per_sample --peak mlp.gradmod   # what the section runs per contender

Plain against gradmod on a loaded machine, the two taking turns run by run (median of 7 runs
of 3 steps per model, one thread):

    python -m benchmarks.sections.per_sample --alternate gpt2,bert,llama,qwen2,t5
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import peak_memory
from gradmod.hooks import attach

BATCH = 64
STEPS = 10  # optimizer steps per timed run
CLIP, SIGMA = 1.0, 1.0
DP = {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": CLIP, "noise_multiplier": SIGMA}]}}


class SampleConvNet(nn.Module):
    """Opacus' MNIST example net (opacus/examples/mnist.py), 26,010 parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return self.fc2(F.relu(self.fc1(x.view(-1, 512))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def resnet18_gn() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int = 128, heads: int = 4, hidden: int = 512):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)).mean(1))


class HFClassifier(nn.Module):
    """A Hugging Face model built from its config (dropout 0: stock dropout sends GPT-2, BERT and
    T5 to a refusal), classifying from the mean of its logits over the sequence."""

    def __init__(self, kind: str, position_ids: bool = False):
        super().__init__()
        import transformers as T

        small = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
        drop0 = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        if kind == "gpt2":
            cfg = T.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
            self.hf = T.GPT2LMHeadModel(cfg)
        elif kind == "bert":
            self.hf = T.BertForMaskedLM(
                T.BertConfig(**small, intermediate_size=512, max_position_embeddings=64, **drop0)
            )
        elif kind == "llama":
            self.hf = T.LlamaForCausalLM(T.LlamaConfig(**small, intermediate_size=512, num_key_value_heads=4))
        elif kind == "qwen2":
            self.hf = T.Qwen2ForCausalLM(T.Qwen2Config(**small, intermediate_size=512, num_key_value_heads=4))
        else:
            cfg = T.T5Config(
                vocab_size=1000, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4, dropout_rate=0.0
            )
            self.hf = T.T5ForConditionalGeneration(cfg)
        self.kind, self.position_ids = kind, position_ids

    def forward(self, idx):
        kw = {"decoder_input_ids": idx[:, :16]} if self.kind == "t5" else {}
        if self.position_ids:  # one row of positions per example: the embedding's call carries the batch
            kw["position_ids"] = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
        return self.hf(input_ids=idx, **kw).logits.mean(1)[:, :10]


def hf(kind: str, position_ids: bool = False) -> Callable[[], nn.Module]:
    return lambda: HFClassifier(kind, position_ids)


def gpt2_stock() -> nn.Module:
    """GPT-2 as Hugging Face returns it, at the sizes above: its default dropout (0.1) and its
    output a ModelOutput holding the key/value cache (``logits_of`` reads the classifier)."""
    import transformers as T

    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=64))


def logits_of(out) -> torch.Tensor:
    """A model's output as the classifier's logits: HFClassifier's reading of a ModelOutput."""
    return out if isinstance(out, torch.Tensor) else out.logits.mean(1)[:, :10]


# Opacus 1.6 runs neither resnet18 (its in-place ReLU after a full backward hook is an autograd
# error) nor the HF models as built; the transformer's nn.MultiheadAttention runs as its
# DPMultiheadAttention (ModuleValidator.fix).
OPACUS_RUNS = ("mnist", "mlp", "transformer")
# name -> (model, one example's shape (None: 64 token ids), batch)
MODELS = {
    "mnist": (SampleConvNet, (1, 28, 28), BATCH),
    "mlp": (mlp, (784,), BATCH),
    "resnet18gn": (resnet18_gn, (3, 32, 32), 32),
    "transformer": (SmallTransformer, None, 32),
    "gpt2": (hf("gpt2"), None, 32),  # HF's default position ids: one row for the whole batch
    "gpt2_ids": (hf("gpt2", position_ids=True), None, 32),
    "gpt2_stock": (gpt2_stock, None, 32),  # as returned: dropout 0.1, the key/value cache in its output
    "bert": (hf("bert"), None, 32),
    "llama": (hf("llama"), None, 32),
    "qwen2": (hf("qwen2"), None, 32),
    "t5": (hf("t5"), None, 32),
}
HF_MODELS = ("gpt2", "gpt2_ids", "gpt2_stock", "bert", "llama", "qwen2", "t5")
CONTENDERS = ("plain", "opacus", "opacus_ghost", "gradmod")


def has_opacus() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def names(hf: bool = True) -> list[str]:
    """``model.contender`` for every contender that can run here (``hf``: the HF models too)."""
    usable = [c for c in CONTENDERS if has_opacus() or not c.startswith("opacus")]
    models = [m for m in MODELS if m not in HF_MODELS or (hf and has_transformers())]
    return [f"{m}.{c}" for m in models for c in usable if m in OPACUS_RUNS or not c.startswith("opacus")]


def setup(name: str, steps: int = STEPS) -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    build, shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randint(0, 1000, (batch, 64), generator=gen)
            if shape is None
            else torch.randn(batch, *shape, generator=gen),
            torch.randint(0, 10, (batch,), generator=gen),
        )
        for _ in range(steps)
    ]
    run = {"plain": _plain, "opacus": _opacus, "opacus_ghost": _opacus_ghost, "gradmod": _gradmod}[contender](
        model, data
    )
    if not contender.startswith("opacus"):
        return run

    def quiet():  # Opacus' modules make torch warn on every step (full backward hooks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run()

    return quiet


def _plain(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(logits_of(model(x)), y).backward()
            opt.step()

    return run


def _gradmod(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = attach(model, DP)

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(logits_of(model(x)), y).backward()
            hooks.after_backward()
            opt.step()

    return run


def _opacus(model, data):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator

    module = GradSampleModule(ModuleValidator.fix(model))  # nn.MultiheadAttention -> DPMultiheadAttention
    opt = DPOptimizer(
        torch.optim.SGD(module.parameters(), lr=0.01),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        expected_batch_size=len(data[0][1]),
    )

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(module(x), y).backward()
            opt.step()

    return run


def _opacus_ghost(model, data):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from opacus.validators import ModuleValidator

    module = GradSampleModuleFastGradientClipping(
        ModuleValidator.fix(model), max_grad_norm=CLIP, use_ghost_clipping=True
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(module.parameters(), lr=0.01),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        expected_batch_size=len(data[0][1]),
    )
    criterion = DPLossFastGradientClipping(module, opt, nn.CrossEntropyLoss())

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            criterion(module(x), y).backward()
            opt.step()

    return run


def peak(name: str, steps: int = 3) -> int:
    """Bytes the peak resident set grows by over ``steps`` steps after the set-up."""
    return peak_memory.peak(setup(name, steps))


def peak_in_subprocess(name: str) -> int:
    """``peak(name)`` in a fresh process."""
    return peak_memory.in_subprocess("benchmarks.sections.per_sample", name)


def alternate(models: list[str], contenders: tuple[str, ...] = ("plain", "gradmod"), rounds: int = 7, steps: int = 3):
    """Median ms per optimizer step of each contender on each model, the contenders taking turns
    run by run (``rounds`` runs of ``steps`` steps each, in one process: a shared machine's load
    moves them alike), and its ratio to the first contender's."""
    out = {}
    for model in models:
        runs = {c: setup(f"{model}.{c}", steps) for c in contenders}
        times: dict[str, list[float]] = {c: [] for c in contenders}
        for run in runs.values():
            run()  # warm-up: the stage's set-up, the first backward's whole check
        for _ in range(rounds):
            for c, run in runs.items():
                start = time.perf_counter()
                run()
                times[c].append(time.perf_counter() - start)
        ms = {c: statistics.median(v) / steps * 1000 for c, v in times.items()}
        out[model] = {c: (ms[c], ms[c] / ms[contenders[0]]) for c in contenders}
    return out


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--alternate":  # --alternate gpt2,bert [rounds]
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        for model, row in alternate(
            sys.argv[2].split(","), rounds=int(sys.argv[3]) if len(sys.argv) == 4 else 7
        ).items():
            print(model, " ".join(f"{c}={ms:.1f}ms ({x:.2f}x)" for c, (ms, x) in row.items()), flush=True)
    else:
        peak_memory.main(__doc__, peak)
