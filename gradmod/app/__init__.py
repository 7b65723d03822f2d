"""The Hydra application: typed config schemas and the command-line job behind ``train.py``.

The only package (besides ``./train.py``) that imports hydra or omegaconf.
"""
