"""The Python API shared by the CLI, the REPL, the server, scripting and perplexity.

* :mod:`localllm.api.core`: :class:`LLM` (tokens, logits, sessions, and one generation path:
  :meth:`LLM.prepare` builds a :class:`GenerationRequest`, :meth:`LLM.stream` runs it as a
  :class:`Generation` under the LLM's lock);
* :mod:`localllm.api.completions`: the OpenAI-shaped calls (completions, chat completions,
  tools, ``response_format``) on top of it;
* :mod:`localllm.api.schema`: the pydantic models that validate their parameters, for the
  API and the server alike.
"""

from .core import LLM, Generation, GenerationRequest, GenerationTimeout

__all__ = ["LLM", "Generation", "GenerationRequest", "GenerationTimeout"]
