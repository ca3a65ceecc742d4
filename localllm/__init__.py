"""localllm: run quantized GGUF language models locally."""

from .errors import LocalLLMError

__all__ = ["LLM", "LocalLLMError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Importing the API pulls in torch; keep `import localllm` light for the CLI's --help.
    if name == "LLM":
        from .api import LLM

        return LLM
    raise AttributeError(name)
