"""Benchmarks: the W1-W3 workloads, cold start, host overhead and the bf16
matmul roofline (`polyrunner bench --workload ...`)."""
