"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``."""

from pathlib import Path

from gradmod.app.cli import main

if __name__ == "__main__":
    main(Path(__file__).parent / "conf")  # every ending one line on stderr and an exit status
