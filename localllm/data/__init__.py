"""Files shipped with localllm, read through :mod:`importlib.resources`: the model registry
``models.toml`` and the ready GBNF grammars ``grammars/*.gbnf``.

The sources live at the repository's top level (``models.toml``, ``grammars/``); the entries
here are symbolic links to them, which the wheel build copies as package data, so that an
installed localllm finds them wherever it is installed.
"""

from importlib.resources import files
from pathlib import Path

# On-disk paths (a wheel or an editable install; localllm does not run from a zip archive).
MODELS_TOML = Path(str(files(__name__).joinpath("models.toml")))
GRAMMARS_DIR = Path(str(files(__name__).joinpath("grammars")))
