"""GGUF files: weights (dequantised to a cached safetensors folder) and the vocabulary."""
