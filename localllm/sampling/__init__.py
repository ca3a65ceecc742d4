"""llama.cpp's sampler chain: the samplers as small units (:mod:`.samplers`), the chain and
its parameters (:mod:`.chain`), the fused fixed-shape device chain (:mod:`.device`) and the
per-token trace (:mod:`.trace`)."""
