"""The one import a device plugin needs: everything a plugin may use, by name.

    from polyrunner.plugin_api import Availability, Backend, BucketPolicy, Capabilities, hookimpl

A plugin imports `polyrunner.plugin_api` (plus torch, numpy and its own
device library) and nothing else from polyrunner — except `polyrunner.envs`,
whose `declare` it may import directly in a light `envs.py` module so that the
table of environment variables is built without importing torch: the modules behind these
names may move, these names stay. See `docs/plugins.md` for the contract
(what is REQUIRED or OPTIONAL, when the core calls it, what it must keep
true) and `examples/minimal_plugin.py` for a whole plugin in one page.

- registration: `hookimpl` (mark `polyrunner_backends`, `polyrunner_models`),
  `register` (run-time registration),
  `PLUGIN_API_VERSION` (the contract version: a plugin declares the one it is
  written for as its own `PLUGIN_API_VERSION = "1.0"`; `PluginVersionError` when
  it is missing or not implemented here);
- the backend contract: `Backend`, `Availability`, `Capabilities`,
  `SAMPLING_FEATURES`, `ATTENTION_FEATURES`, `GraphExecutor`, `ModelInputs`, `HostFuture`;
- padding: `BucketPolicy` and the bucket-list helpers `capture_sizes`
  (CUDA-graph style), `exponential_sizes` (powers of two) and
  `gap_incremental_sizes` (TPU style);
- KV cache: `KVCacheSpec`; integer helpers `cdiv` (division rounded up) and `round_up`;
- attention: `AttentionMetadata`, `LayerSpec`, `NULL_BLOCK`, `NULL_SLOT`, the
  reference op `reference_paged_attention` and its pieces `write_kv`,
  `causal_mask`; the plain-torch fast paths `sdpa_paged_attention` and
  `attend_cached` (`STATIC_DECODE` marks a graph-captured decode), and the
  static-shape op `static_shape_paged_attention` (its per-token block tables
  under `TOKEN_BLOCK_TABLES`);
- op overrides (`Backend.op_overrides`): the role table `ROLES` (each role's
  reference and the call a replacement keeps), `MODULE_ROLES` (the roles a
  backend may override, in the order they are applied), `OpFactory` (a role's
  factory), the reference modules `RMSNorm`, `GatedMLP` (with
  `silu_and_mul`) and `RotaryEmbedding`, and `RMSNormOverride` (the base of a
  backend's RMSNorm: keeps `weight`, `eps` and the replaced module); the "lora" role's
  `LoRALinear`, its `LoRAMapping` (the step's `token_lora`) and the reference `add_lora`; the
  "lora_embedding" role's `LoRAEmbedding` and `add_lora_embedding`;
- stream graphs for devices with a CUDA-like API: `GraphAPI`,
  `TorchGraphAPI`, `StaticGraphExecutor`, `graph_bucket_policy`, `graph_token_sizes`, `GraphBucketPolicy`,
  `FullGraphBucketPolicy`, the graph modes `FULL`, `FULL_DECODE_ONLY`, `NONE` (vLLM's `cudagraph_mode`
  names) with `requested_graph_mode` and `resolve_graph_mode`,
  `profiled_kv_budget` (with `worst_case_profile`), `pinned_upload`, `async_to_host`;
- the capture guard: `capture_guard(device)` refuses host syncs (`HostSyncError`) while a
  step is captured or traced (the core's graph executor enters it around every capture; a
  backend tracing its own graphs enters it there), `host_tensor(t)` declares host-side data an
  op reads on the host by design, `in_static_step()` says a step is being captured or compiled;
  `TapeGraph` / `TapeGraphAPI`: stream graphs emulated on the CPU (capture records the ops,
  replay re-executes the record), to test a plugin's captured steps without its device;
- sampling: `SamplingMetadata` (the step's tensors; `host_rows()` gives the
  rows' parameters as host arrays), `HostSamplingRows`, `SamplerOutput`, the
  core `Sampler` and its pieces (`compute_logprobs`, `gather_logprobs`,
  `apply_top_k_top_p`, `apply_min_p`, `LogprobsTensors`, `LogprobsLists`) for
  a backend's own on-device sampling function (`GraphExecutor.sample`);
- environment variables: `declare` (a plugin's own `POLYRUNNER_<NAME>_*` variables:
  name, type, default, meaning; listed by `python -m polyrunner.tools.env_table`) and
  `cache_root` (the folder for a plugin's compiled artefacts);
- `EngineConfig`: the configuration the hooks and `Backend` methods receive
  (`UsageContext`: who builds the engine, `Backend.default_limits`'s argument), and
  `resolved_max_model_len(config)` (the engine's max_model_len before the model is
  loaded: the option, else the model's max_position_embeddings);
  `StepInputs`: a step's padded host arrays (`Backend.host_attention_extras`).
"""

from __future__ import annotations

from polyrunner.attention.batched import STATIC_DECODE, attend_cached, sdpa_paged_attention
from polyrunner.attention.metadata import NULL_BLOCK, NULL_SLOT, AttentionMetadata, LayerSpec
from polyrunner.attention.reference import causal_mask, reference_paged_attention, write_kv
from polyrunner.attention.static_shape import TOKEN_BLOCK_TABLES, static_shape_paged_attention
from polyrunner.config import EngineConfig, UsageContext
from polyrunner.device.backend import (
    ATTENTION_FEATURES,
    SAMPLING_FEATURES,
    Availability,
    Backend,
    Capabilities,
    GraphExecutor,
    HostFuture,
    ModelInputs,
)
from polyrunner.device.buckets import BucketPolicy, capture_sizes, exponential_sizes, gap_incremental_sizes
from polyrunner.device.capture_guard import HostSyncError, capture_guard, host_tensor, in_static_step
from polyrunner.device.graphs import (
    FULL,
    FULL_DECODE_ONLY,
    NONE,
    FullGraphBucketPolicy,
    GraphAPI,
    GraphBucketPolicy,
    StaticGraphExecutor,
    TorchGraphAPI,
    async_to_host,
    graph_bucket_policy,
    graph_token_sizes,
    pinned_upload,
    profiled_kv_budget,
    requested_graph_mode,
    resolve_graph_mode,
    worst_case_profile,
)
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.device.tape_graph import TapeGraph, TapeGraphAPI
from polyrunner.envs import cache_root, declare
from polyrunner.models.context_length import resolved_max_model_len
from polyrunner.numeric import cdiv, round_up
from polyrunner.ops import (
    MODULE_ROLES,
    ROLES,
    FusedMoE,
    GatedMLP,
    OpFactory,
    RMSNorm,
    RMSNormOverride,
    RotaryEmbedding,
    fused_experts,
    keep_moe_attributes,
    select_experts,
    silu_and_mul,
)
from polyrunner.ops.lora import (
    LoRAEmbedding,
    LoRALinear,
    LoRAMapping,
    add_lora,
    add_lora_embedding,
    keep_lora_attributes,
)
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.api_version import PLUGIN_API_VERSION, PluginVersionError
from polyrunner.runner.inputs import StepInputs
from polyrunner.sample import (
    LogprobsLists,
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    gather_logprobs,
)
from polyrunner.sample.metadata import HostSamplingRows

__all__ = [
    # registration
    "hookimpl", "register", "PLUGIN_API_VERSION", "PluginVersionError",
    # the backend contract
    "Backend", "Availability", "Capabilities", "SAMPLING_FEATURES", "ATTENTION_FEATURES", "GraphExecutor",
    "ModelInputs", "HostFuture", "EngineConfig", "UsageContext", "resolved_max_model_len", "StepInputs",
    # padding buckets
    "BucketPolicy", "GraphBucketPolicy", "capture_sizes", "exponential_sizes", "gap_incremental_sizes",
    # KV cache
    "KVCacheSpec", "cdiv", "round_up",
    # attention
    "AttentionMetadata", "LayerSpec", "NULL_BLOCK", "NULL_SLOT", "reference_paged_attention", "write_kv",
    "causal_mask", "sdpa_paged_attention", "attend_cached", "STATIC_DECODE", "static_shape_paged_attention",
    "TOKEN_BLOCK_TABLES",
    # op overrides (faster modules per role)
    "ROLES", "MODULE_ROLES", "OpFactory", "RMSNorm", "RMSNormOverride", "GatedMLP", "silu_and_mul", "RotaryEmbedding",
    "FusedMoE", "select_experts", "fused_experts", "keep_moe_attributes", "LoRALinear", "LoRAMapping", "add_lora",
    "keep_lora_attributes", "LoRAEmbedding", "add_lora_embedding",
    # sampling (a backend may supply its own over padded logits)
    "SamplingMetadata", "HostSamplingRows", "SamplerOutput", "Sampler", "LogprobsTensors", "LogprobsLists",
    "compute_logprobs", "gather_logprobs", "apply_top_k_top_p", "apply_min_p",
    # environment variables and the cache folder
    "declare", "cache_root",
    # stream graphs (CUDA-like device modules)
    "GraphAPI", "TorchGraphAPI", "StaticGraphExecutor", "graph_bucket_policy", "graph_token_sizes",
    "FullGraphBucketPolicy", "FULL", "FULL_DECODE_ONLY", "NONE", "requested_graph_mode", "resolve_graph_mode",
    "profiled_kv_budget",
    "pinned_upload", "async_to_host", "worst_case_profile",
    # the capture guard (no host sync inside a captured or compiled step) and CPU-emulated graphs
    "capture_guard", "HostSyncError", "host_tensor", "in_static_step", "TapeGraph", "TapeGraphAPI",
]
