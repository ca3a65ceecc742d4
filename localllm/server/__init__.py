"""The OpenAI-compatible HTTP server (``localllm serve``): FastAPI on uvicorn.

:func:`create_app` builds the ASGI app around a loaded :class:`localllm.LLM`; :func:`serve`
runs it. Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/metrics``.
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
