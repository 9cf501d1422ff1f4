"""CPU backend: KV cache in host memory, eager execution, no padding."""
