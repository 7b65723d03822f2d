"""What differs between the Hydra and OmegaConf releases gradmod is tested with (Hydra 1.3,
and 1.4 where it installs): the entry's arguments and the resolver's registration, so
that neither prints a deprecation warning on every run."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import hydra
from omegaconf import OmegaConf

# The only targets Hydra itself builds from gradmod's config (hydra.callbacks: the sweep
# report). Hydra 1.4 warns on a config-selected target without an allowlist; 1.5 refuses it.
TARGETS = ["gradmod.*"]


def main_options() -> dict[str, Any]:
    """``hydra.main``'s keyword arguments: 1.3's defaults named by ``version_base`` (1.4
    deprecates it and keeps them), and the allowlist where Hydra takes one."""
    params = inspect.signature(hydra.main).parameters
    if "execution_whitelist" in params:
        return {"execution_whitelist": TARGETS}
    return {"version_base": "1.3"}


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """``OmegaConf.register_resolver`` (2.4; 2.3's of that name is an older, other one), or
    2.3's ``register_new_resolver``."""
    if "replace" in inspect.signature(OmegaConf.register_resolver).parameters:
        register: Any = OmegaConf.register_resolver  # typed as 2.3's
        register(name, resolver, replace=True, use_cache=False)
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True, use_cache=False)
