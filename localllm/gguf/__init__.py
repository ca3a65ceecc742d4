"""The GGUF file: bounds-checked parsing (:mod:`.validate`), memory-mapped tensors
(:mod:`.file`) and the quant-format table with the torch reference dequantizers
(:mod:`.quants`)."""
