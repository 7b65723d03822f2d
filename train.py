"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from gradmod.app.cli import job
from gradmod.app.cli import main as cli_main
from gradmod.app.help import register_help
from gradmod.training.distributed import follower_overrides


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    return job(cfg)["test_accuracy"]


if __name__ == "__main__":
    register_help(Path(__file__).parent / "conf")  # python train.py --help
    sys.argv += follower_overrides(sys.argv)  # torchrun ranks > 0 leave the run folder to rank 0
    cli_main(main)  # config errors: one line on stderr, exit 2
