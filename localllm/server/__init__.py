"""The OpenAI-compatible HTTP server (``localllm serve``): FastAPI on uvicorn.

:func:`create_app` builds the ASGI app around a loaded :class:`localllm.LLM`; :func:`serve`
runs it. Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``
(Anthropic's), ``/v1/responses`` (OpenAI's Responses), ``/v1/embeddings``, ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/props``, ``/health``, ``/metrics``.
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
