"""Where localllm keeps its files: the cache of pulled models and the user's models.toml.

A leaf module (platformdirs only), so that the model stores, the registry and the user's
entries can all name these places without importing one another.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LOCALLLM_CACHE"


def cache_dir() -> Path:
    """The root of localllm's model cache: ``$LOCALLLM_CACHE``, else platformdirs'
    ``user_cache_dir("localllm")``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm"))


def user_models_file() -> Path:
    """The user's models.toml (``user_config_dir("localllm")/models.toml``), whether or not it
    exists."""
    from platformdirs import user_config_dir

    return Path(user_config_dir("localllm")) / "models.toml"


__all__ = ["CACHE_ENV", "cache_dir", "user_models_file"]
