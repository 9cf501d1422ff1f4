"""Which test modules carry which pytest markers (registered in pyproject.toml).

`make test-fast` runs `-m "not slow"`: every module whose tests start whole engines, servers,
processes or tensor-parallel ranks (a minute or more of the suite each, measured with
`pytest --durations=0`) is "slow"; the rest runs in under 3 minutes on 2 cores. "kernels",
"server" and "xla" select an area (`pytest -m kernels`).
"""

from __future__ import annotations

SLOW = {
    "test_tensor_parallel", "test_conformance_example", "test_conformance_cli", "test_cpu_graphs", "test_gguf",
    "test_cpu_quant_model", "test_serve", "test_structured_outputs", "test_spec_decode", "test_serve_hostile",
    "test_conformance_broken", "test_cli", "test_conformance_optional", "test_structured_async_compile",
    "test_engine_process", "test_triton_attention", "test_cuda_graphs", "test_async_llm", "test_structured_serve",
    "test_moe_tensor_parallel", "test_gemma_tensor_parallel", "test_ray_executor",
}
KERNELS = {
    "test_cpu_decode_kernels", "test_cpu_kernel_table", "test_cpu_kernels_fast", "test_cpu_prefill_attention",
    "test_cpu_quant_kernels", "test_triton_attention", "test_triton_compile", "test_triton_fused_ops",
    "test_triton_moe",
}
SERVER = {"test_serve", "test_serve_hostile", "test_structured_serve", "test_structured_async_compile",
          "test_vllm_api_compat", "test_serve_lora"}
XLA = {"test_xla", "test_xla_buckets", "test_xla_units", "test_xla_padded", "test_xla_spmd", "test_xla_lora",
       "test_xla_softcap", "test_xla_pallas_reference", "test_xla_pallas_trace", "test_xla_host_sync", "test_xla_moe"}

MODULE_MARKERS: dict[str, tuple[str, ...]] = {}
for _marker, _modules in (("slow", SLOW), ("kernels", KERNELS), ("server", SERVER), ("xla", XLA)):
    for _module in _modules:
        MODULE_MARKERS[_module] = (*MODULE_MARKERS.get(_module, ()), _marker)
