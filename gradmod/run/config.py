"""The typed config of a run: dataclasses that give every key its type, default and check.

Plain dataclasses (no Hydra, no OmegaConf): ``gradmod.app`` registers them as Hydra
structured configs, so a typo fails while composing, and builds them with
``OmegaConf.to_object``; ``__post_init__`` checks values, so a bad one fails before any
work. Python users can build them directly: ``Config(model=ModelConfig("mnist_cnn"), ...)``.

Each field's default and its one-line doc (the comment on its line) are the source:
``gradmod/conf/`` restates them where users read them (``gradmod/conf/trainer/default.yaml`` lists
every trainer key with its comment), ``--help`` lists the keys from these classes, and
``tests/run/test_config_defaults.py`` holds the files equal to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from gradmod.hooks import score_columns  # torch-free
from gradmod.reporting.loggers import LOGGERS
from gradmod.run import checks
from gradmod.run.checks import (
    ACCOUNTANTS,
    DATASETS,
    INITS,
    MODELS,
    NORMS,
    SAMPLINGS,
    at_least,
    choice,
    finite,
    target_node,
    target_or_choice,
)

MISSING: Any = "???"  # OmegaConf's mark for a value that must be given


@dataclass
class ModelConfig:
    """A shipped model by ``name``, or ``_target_`` called with ``args`` (on the command line:
    the node's own extra keys, ``+model.width=64``) and nothing else. ``norm``: the
    normalisation, batch | group (``gradmod.models``; a ``_target_`` model's BatchNorm
    layers are replaced by GroupNorm, ``gradmod.hooks.groupnorm.replace_batchnorm``)."""

    name: str = MISSING
    norm: str = "batch"  # batch (BatchNorm2d) | group (GroupNorm(min(32, C), C): each example on its own, as +hooks=dp needs)
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        target_or_choice("model", self, MODELS)
        choice("model.norm", self.norm, NORMS)


KEEP_WHICH = ("random", "hardest", "easiest")  # gradmod.run.keep
KEEP_SCORES = tuple(score_columns.SCORES)  # scores.csv's grand and el2n, self_influence.csv's score


@dataclass
class KeepConfig:
    """``data.keep``: train on a share of the training set, chosen at random or by a score file
    (``gradmod.run.keep``; docs/guide/scores.md)."""

    fraction: float = 1.0  # (0, 1]: the share of the training examples kept (1: all of them)
    which: str = "random"  # random (seeded by seed) | hardest (the highest scores) | easiest (the lowest)
    score: Optional[str] = None  # grand | el2n (from scores.csv) | self_influence (from self_influence.csv)
    scores: Optional[str] = None  # the scoring run's folder, or the score file itself
    epoch: Optional[int] = None  # scores.csv: the epoch whose scores rank the examples | null: the file's last
    per_class: bool = False  # true: the share taken within each class (round(fraction x its count)), by the same order

    def __post_init__(self):
        if not (0 < self.fraction <= 1):
            raise ValueError(f"data.keep.fraction={self.fraction} must be in (0, 1]: the share of examples kept")
        choice("data.keep.which", self.which, KEEP_WHICH)
        if self.score is not None:
            choice("data.keep.score", self.score, KEEP_SCORES)
        if self.which != "random" and (self.score is None or self.scores is None):
            raise ValueError(
                f"data.keep.which={self.which} needs data.keep.score ({' | '.join(KEEP_SCORES)}) and "
                "data.keep.scores (the scoring run's folder or its score file); or data.keep.which=random"
            )
        if self.epoch is not None:
            at_least("data.keep.epoch", self.epoch, 1)


@dataclass
class DataConfig:
    """A shipped dataset by ``name``, or ``_target_`` called with ``args`` returning
    ``(train, test)`` (``gradmod.run.factories.build_data``)."""

    name: str = MISSING
    batch_size: int = 100  # the article's batch size
    fallback: bool = True  # offline: use the bundled 5,000-digit sample (with a warning)
    n_test: int = 1000  # test examples made from the bundled 5,000-digit sample's held-out digits (mnist_sample, multi_mnist, mnist falling back)
    sampling: str = "auto"  # shuffle | poisson (each example joins each step with q) | auto: poisson under DP noise
    keep: KeepConfig = field(default_factory=KeepConfig)  # a share of the training set, by score or at random
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        target_or_choice("data", self, DATASETS)
        choice("data.sampling", self.sampling, SAMPLINGS)
        at_least("data.batch_size", self.batch_size, 1)
        at_least("data.n_test", self.n_test, 1)
        checks.int_fields("data.", self)


@dataclass
class FakeDataConfig(DataConfig):
    batch_size: int = 32
    train_size: int = 256
    test_size: int = 64
    image_size: int = 224
    channels: int = 3
    num_classes: int = 10

    def __post_init__(self):
        super().__post_init__()
        for key in ("train_size", "test_size", "image_size", "channels"):
            at_least(f"data.{key}", getattr(self, key), 1)
        at_least("data.num_classes", self.num_classes, 2)


@dataclass
class CharTextDataConfig(DataConfig):
    """``data=char_text``: windows of ``seq_len`` characters of the bundled text, one every
    ``stride`` characters (``gradmod.data.load_char_text``)."""

    batch_size: int = 32
    seq_len: int = 32  # characters per window
    stride: int = 8  # a window every this many characters

    def __post_init__(self):
        super().__post_init__()
        for key in ("seq_len", "stride"):
            at_least(f"data.{key}", getattr(self, key), 1)


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True  # the parameters come later, from the built model
    lr: float = 0.001
    weight_decay: float = 0.0
    no_decay: List[str] = field(default_factory=list)  # globs over parameter names: weight_decay 0 for these
    # entries {params, exclude, lr_scale, optimizer: {_target_, ...}, ARG: value}: groups by glob (gradmod.optim)
    groups: List[Any] = field(default_factory=list)
    layer_decay: Any = None  # a factor in (0, 1]: lr x factor ** (top - depth), depth read from the names (gradmod.optim)
    fused: Optional[bool] = None  # None: fused on CUDA where torch has it (build.default_fused), else torch's default
    foreach: Optional[bool] = None  # None: torch's default
    args: Dict[str, Any] = field(default_factory=dict)  # a user optimizer's other arguments (+optimizer.KEY=...)

    def __post_init__(self):
        checks.optimizer(self)


@dataclass
class AdamConfig(OptimizerConfig):
    _target_: str = "torch.optim.Adam"
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        finite("optimizer.eps", self.eps)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={list(self.betas)} must be two numbers in [0, 1)")


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.01
    momentum: float = 0.9  # what users expect of SGD here (torch's own default is 0)
    nesterov: bool = False

    def __post_init__(self):
        super().__post_init__()
        finite("optimizer.momentum", self.momentum)


@dataclass
class AdamWConfig(AdamConfig):
    """``optimizer=adamw``: torch's AdamW with its defaults (decoupled weight decay 0.01)."""

    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


@dataclass
class MuonConfig(AdamWConfig):
    """``optimizer=muon``: Muon on ``@matrices``, AdamW on the rest, as Muon's reference recipe
    (KellerJordan/Muon: Muon lr 0.02, momentum 0.95, Nesterov, 5 Newton-Schulz steps, weight
    decay 0.01; AdamW lr 3e-4, betas (0.9, 0.95), weight decay 0.01; docs/guide/optimizers.md).
    The recipe's one source: ``gradmod/conf/optimizer/muon.yaml`` sets none of it."""

    lr: float = 0.0003
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    groups: List[Any] = field(
        default_factory=lambda: [
            {
                "params": "@matrices",
                "optimizer": {
                    "_target_": "gradmod.optim.Muon",
                    "lr": 0.02,
                    "momentum": 0.95,
                    "nesterov": True,
                    "ns_steps": 5,
                    "weight_decay": 0.01,
                },
            }
        ]
    )


@dataclass
class TrainerConfig:
    epochs: int = 10  # the article's 10 epochs
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    progress: bool = True  # tqdm bars; quiet anyway when stderr is not a terminal
    log_every: int = 50  # steps between reads of the `log` transform's statistics
    eval_batch_size: int = 1000  # evaluation is batched (the article used batch 1)
    hook_stage: str = "hook"  # default stage of rules that set none: hook | fused
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    host_heap: str = "keep"  # keep (glibc keeps memory freed by tensors: a step's do not page-fault afresh) | release (the C library's defaults)
    precision: str = "fp32"  # fp32 | bf16 (autocast, no scaler) | fp16 (autocast + GradScaler); docs/reference/robustness.md
    compile: bool = False  # torch.compile the model
    channels_last: bool = False  # channels-last memory format for conv models
    accumulate: int = 1  # micro-batches of data.batch_size per optimizer step (>= 1); loss divided by their number
    strategy: str = "single"  # single (one process) | ddp | fsdp (under torchrun: one process per rank, see docs/guide/distributed.md)
    tp: int = 1  # fsdp: tensor-parallel ranks per group (the model's tp_plan, e.g. model=tiny_gpt); they share each batch
    replicate: int = 1  # fsdp: HSDP, replicas of each shard (a (replicate, shard) mesh); tp x replicate must divide the world size
    checkpoint_every: int = 1  # epochs between checkpoints in <run>/checkpoints; 0 = none
    checkpoint_every_steps: int = 0  # also every N optimizer steps (mid-epoch); 0 = none
    checkpoint_keep: int = 2  # keep the newest k checkpoints
    resume: Optional[str] = None  # null | auto (newest complete checkpoint of this run folder) | PATH
    resume_accept: List[str] = field(default_factory=list)  # keys that must match on resume but may differ this once, e.g. [seed, data.batch_size] (docs/reference/robustness.md)
    start_over: bool = False  # true: replace the earlier run's results in this run folder (else such a folder is refused)
    nonfinite: str = "warn"  # non-finite raw gradients: warn (step anyway; read once per epoch, no per-step sync) | skip (the step) | raise
    data_placement: str = "auto"  # auto (device when the data fits in half the free device memory) | device | loader (host memory, DataLoader)
    loader_workers: int = 2  # DataLoader worker processes when data_placement resolves to loader; 0 = main process
    sync_check: bool = False  # CUDA only: raise on a host sync in any step between two log points: true | false (not with precision=fp16 or nonfinite=skip|raise)

    def __post_init__(self):
        checks.trainer(self)


@dataclass
class InitConfig:
    name: str = "default"

    def __post_init__(self):
        choice("init.name", self.name, INITS)


@dataclass
class LoggerConfig:
    name: str = "csv"

    def __post_init__(self):
        choice("logger.name", self.name, LOGGERS)


@dataclass
class TensorBoardLoggerConfig(LoggerConfig):
    name: str = "tensorboard"
    histograms: bool = True  # true: gradient histograms of every `log`ged tensor at each log_every step | false


@dataclass
class MLflowLoggerConfig(LoggerConfig):
    name: str = "mlflow"
    tracking_uri: Optional[str] = None  # null: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the current folder | a server, http://host:5000
    experiment: str = "gradmod"  # the MLflow experiment the runs go into


@dataclass
class CaptureConfig:
    gradcam: bool = False  # true: Grad-CAM overlays of fixed test digits -> gradcam.png (and per epoch in TensorBoard)
    gradcam_layer: str = "conv2"  # a name from model.named_modules() with an N x C x H x W output (resnets: layer4)
    gradcam_images: int = 8  # how many test digits (one per class in turn), >= 1

    def __post_init__(self):
        at_least("capture.gradcam_images", self.gradcam_images, 1)


@dataclass
class LossConfig:
    """``_target_`` called with ``args`` gives ``loss(output, target)``; with ``_partial_``,
    the target itself is the loss (``functools.partial`` over ``args``). ``per_task``: null
    applies the loss to each task's output and labels when the model returns several
    (a mapping or tuple); false hands it the whole outputs and labels (a loss of your own
    that returns a mapping of named losses); true always per task."""

    _target_: str = "gradmod.training.tasks.LossByTarget"
    _partial_: bool = False
    args: Dict[str, Any] = field(default_factory=dict)
    per_task: Optional[bool] = None  # null: per task when the model returns several outputs | true | false

    def __post_init__(self):
        if self.per_task not in (None, True, False):
            raise ValueError(f"loss.per_task={self.per_task!r} is not allowed; allowed: null, true, false")


@dataclass
class SchedulerConfig:
    """``_target_(optimizer, **args)``, stepped once per optimizer step. A ``T_max``,
    ``total_steps`` or ``total_iters`` left null is the run's number of optimizer steps."""

    _target_: str = MISSING
    _partial_: bool = True  # the optimizer comes later
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PrivacyConfig:
    """DP-SGD's accounting (``gradmod.training.privacy``), used when a per_sample rule adds
    noise: Opacus' ``accountant`` (rdp | prv) reports epsilon at ``delta``; ``target_epsilon``
    instead picks the noise multiplier that reaches it after the planned steps."""

    accountant: str = "rdp"  # rdp | prv (Opacus' accountants: pip install "gradmod[privacy]")
    delta: float = 1e-5  # epsilon is reported at this delta (keep it below 1 / training set size)
    target_epsilon: Optional[float] = None  # a number: the noise multiplier that reaches it after the planned steps (rules then set none)

    def __post_init__(self):
        choice("privacy.accountant", self.accountant, ACCOUNTANTS)
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta={self.delta} must be in (0, 1), e.g. 1e-5 (below 1 / training set size)")
        if self.target_epsilon is not None and not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
            raise ValueError(f"privacy.target_epsilon={self.target_epsilon} must be a finite number > 0, or null")


@dataclass
class RuleConfig:
    """One hook rule as the config holds it: every key present (None when unset), so each can
    be overridden on the command line without ``+`` (``hooks.clip.stage=fused``). The values
    are checked against the model by ``gradmod.hooks.rules.targets.build_targets``."""

    params: Any = None
    modules: Any = None
    exclude: Any = None
    transforms: Any = None
    rows: Optional[str] = None  # a per_loss modules rule: examples (default) | batch (LibMTL's rep_grad)
    active: Any = None  # the rule's window {from: 2ep, until: 5ep} (half-open); null: every step
    stage: Optional[str] = None  # last: the help's key list names the stages after it

    def as_rule(self) -> Dict[str, Any]:
        """The rule as ``attach`` takes it: the keys that are set."""
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class ReportConfig:
    """What a sweep's report ranks its groups by (``gradmod.reporting.sweep_rank``)."""

    metric: str = "auto"  # auto (test accuracy, else test loss) | accuracy | loss | <task> (its test metric) | <task>/loss
    direction: str = "auto"  # auto (accuracy higher is better; loss and rmse lower) | higher | lower

    def __post_init__(self):
        if self.direction not in ("auto", "higher", "lower"):
            raise ValueError(f"report.direction={self.direction!r} is not allowed; allowed: auto, higher, lower")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"report.metric={self.metric!r} must be auto, accuracy, loss, a task's name or <task>/loss")


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    init: InitConfig = field(default_factory=InitConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    seed: int = 1234  # the article's seed; fixes init, data split and batch order on the CPU
    data_dir: str = "data"  # where torchvision looks for (and downloads) MNIST
    hooks: Dict[str, Any] = field(default_factory=dict)  # rule name -> rule; filled by the hooks group or the command line
    plugins: List[str] = field(default_factory=list)  # modules imported before the rules are built, e.g. [my_pkg.transforms]: their gradmod.register(...) calls make `transforms: [flip]` work
    loss: Any = None  # LossConfig, or a mapping {_target_: ..., its arguments}; None: cross-entropy
    metric: Any = "auto"  # auto | accuracy | rmse | none | {_target_: ...}, or task name -> one of those
    scheduler: Any = None  # SchedulerConfig, or a mapping {_target_: ..., its arguments}; None or {}: constant lr

    def __post_init__(self):
        checks.seed(self.seed)
        self.hooks = {name: r.as_rule() if isinstance(r, RuleConfig) else r for name, r in self.hooks.items()}
        checks.rules(self.hooks)
        self.loss = target_node("loss", self.loss, LossConfig) or LossConfig()
        checks.metric("metric", self.metric)
        self.scheduler = target_node("scheduler", self.scheduler or None, SchedulerConfig)
