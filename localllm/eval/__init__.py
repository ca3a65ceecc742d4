"""Measuring models: llama-perplexity's evaluation (:mod:`.perplexity`), KL divergence against
a base model (:mod:`.kld`), the quant comparison report (:mod:`.compare`) and the benchmarks
(:mod:`.bench`)."""
