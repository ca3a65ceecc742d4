"""More of llama-server's surface: ``POST /v1/embeddings`` (also ``/embeddings``),
``POST /tokenize``, ``POST /detokenize`` and ``GET /props``.

* embeddings: OpenAI's request and reply (``input`` text, texts, token ids or lists of them;
  ``encoding_format`` float or base64; ``dimensions``), pooled and normalized by
  :mod:`localllm.api.embeddings`; they run on the generation worker, in turn with
  generations (one forward at a time);
* ``/tokenize``: ``{"content", "add_special", "parse_special", "with_pieces"}`` ->
  ``{"tokens": [id, ...]}`` (``[{"id", "piece"}, ...]`` with pieces: the piece as text when it
  is valid UTF-8, else its bytes), as llama-server answers;
* ``/detokenize``: ``{"tokens": [...]}`` -> ``{"content": text}``;
* ``/props``: the context size, the model, the chat template and its reply format
  (reasoning markers, tool-call syntax), the special tokens, the modalities (text only).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

from ..api.embeddings import embed, encode_vector
from ..api.schema import DetokenizeParams, EmbeddingParams, TokenizeParams, parse
from ..errors import LocalLLMError
from .protocol import read_json


def create_embeddings(pooling: str | None):
    def call(llm, params: EmbeddingParams, **_: Any) -> dict:
        vectors, n = embed(llm, params.inputs(), pooling=pooling, dimensions=params.dimensions)
        return {"object": "list", "model": params.model or llm.model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode_vector(v, params.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    return call


def _pieces(tokenizer, ids: list[int]) -> list[dict]:
    out = []
    for t in ids:
        data = tokenizer.special_bytes(t)
        try:
            piece: Any = data.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(data)
        out.append({"id": t, "piece": piece})
    return out


def register(app, api, *, pooling: str | None = None) -> None:
    """Add the embeddings, token and props endpoints to ``app``."""
    call = create_embeddings(pooling)

    def embeddings_at(path: str):
        async def embeddings(request: Request):
            return await api.answer(request, path,
                                    lambda body: parse(EmbeddingParams, read_json(body)), call)
        return embeddings

    for path in ("/v1/embeddings", "/embeddings"):
        app.post(path)(embeddings_at(path))

    def tokenize(llm, p: TokenizeParams) -> dict:
        ids = llm.tokenizer.encode(p.content, add_bos=p.add_special and llm.tokenizer.add_bos,
                                   special=p.parse_special)
        return {"tokens": _pieces(llm.tokenizer, ids) if p.with_pieces else ids}

    def detokenize(llm, p: DetokenizeParams) -> dict:
        return {"content": llm.detokenize(p.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await api.quick(request, "/tokenize",
                               lambda body: parse(TokenizeParams, read_json(body)), tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await api.quick(request, "/detokenize",
                               lambda body: parse(DetokenizeParams, read_json(body)), detokenize)

    def props(llm, _) -> dict:
        from ..chat.replies import chat_format
        from ..chat.template import template_for

        try:
            template = template_for(llm, llm.chat_template)
            source, fmt = template.source, chat_format(template.source)
        except LocalLLMError:
            source, fmt = None, None
        tok = llm.tokenizer
        return {
            "model_alias": llm.model_name, "model_path": str(llm.path),
            "n_ctx": llm.ctx_size, "n_ctx_train": llm.args.context_length,
            "n_vocab": tok.n_vocab, "total_slots": 1,
            "default_generation_settings": {"n_ctx": llm.ctx_size,
                                            "params": {"n_predict": api.n_predict}},
            "chat_template": source,
            "chat_format": None if fmt is None else {
                "reasoning": None if fmt.thinking is None else {
                    "start": fmt.thinking.start, "end": fmt.thinking.end},
                "tool_calls": fmt.tool_syntax, "harmony": fmt.harmony},
            "reasoning_format": llm.reasoning_format, "reasoning_budget": llm.reasoning_budget,
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else None,
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else None,
            "modalities": {"vision": False, "audio": False},
            "endpoints": sorted(r.path for r in app.routes if isinstance(r, APIRoute)),
        }

    @app.get("/props")
    async def props_route(request: Request):
        return await api.quick(request, "/props", None, props)


__all__ = ["create_embeddings", "register"]
