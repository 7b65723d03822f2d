"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``, the same
as the installed console script ``gradmod +hooks=clip``."""

from gradmod.app.cli import main

if __name__ == "__main__":
    main()  # the shipped configs, gradmod/conf/; every ending one line on stderr and an exit status
