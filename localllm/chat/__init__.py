"""Chat prompts: sandboxed jinja2 chat templates from GGUF metadata (:mod:`.template`) and the
built-in fallbacks (:mod:`.builtin`)."""
