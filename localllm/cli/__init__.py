"""The command line: the only package that knows about flags (typer) and terminal output.

``app`` defines the commands; ``main`` is the console entry point. Library code raises
:class:`localllm.errors.LocalLLMError` subclasses in library terms; this package maps them to
one ``error:`` line and exit status 1.
"""

from .app import app, main

__all__ = ["app", "main"]
