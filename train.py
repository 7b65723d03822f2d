"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``, the same
as the installed console script ``gradmod +hooks=clip`` and ``python -m gradmod +hooks=clip``."""

from gradmod.__main__ import main  # its import guards Ctrl-C first, then loads the command line

if __name__ == "__main__":
    main()  # the shipped configs, gradmod/conf/; every ending one line on stderr and an exit status
