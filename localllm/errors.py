"""User-facing errors.

Every error a user can cause (a bad file, a bad flag, a prompt that does not fit)
is raised as a :class:`LocalLLMError` subclass. The CLI prints ``error: <message>``
on one line and exits non-zero without a traceback; anything else is a bug.
"""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base class of errors caused by user input; the message is one line."""

    exit_code: int = 1


class GGUFError(LocalLLMError):
    """A GGUF file is malformed, truncated, or uses something we do not support."""


class ModelNotFoundError(LocalLLMError):
    """MODEL is neither a name in models.toml nor an existing file."""


class UnsupportedError(LocalLLMError):
    """A valid file asks for a feature this build does not implement (architecture, quant type)."""


class ContextOverflowError(LocalLLMError):
    """A prompt or message does not fit in the context window."""


class ParameterError(LocalLLMError):
    """A sampling or runtime parameter is out of its valid range (the message names the flag)."""


class TemplateError(LocalLLMError):
    """A chat template is broken, raised, or tried to escape the sandbox."""


class GrammarError(LocalLLMError):
    """A GBNF grammar or JSON schema is invalid (the message gives the location)."""


class PullError(LocalLLMError):
    """A model could not be fetched (no network, no such repository, package or file, a hash
    mismatch, an unwritable cache)."""


class CorruptModelError(LocalLLMError):
    """A cached or stored model file does not match its recorded size or sha256."""


class InsufficientMemoryError(LocalLLMError):
    """A model does not fit in the memory the device has free (weights + KV cache)."""
