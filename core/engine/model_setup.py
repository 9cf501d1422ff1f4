"""From a configuration to a model runner with its KV cache: what the engine
and every tensor-parallel worker do at start-up, in one place.

    resolve the folder, read the architecture, pick max_model_len and dtype,
    pick the quantization, load the model (this rank's shard), apply the
    backend's op overrides, make the runner, size the KV cache
    (tensor-parallel: the smallest over the ranks)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from polyrunner.config import EngineConfig
from polyrunner.device.backend import Backend
from polyrunner.distributed.group import TensorParallel, init_tensor_parallel
from polyrunner.distributed.shard import TPShard
from polyrunner.engine.attention_check import check_attention_features
from polyrunner.lora.manager import LoRAManager
from polyrunner.models.arch import DecoderArch
from polyrunner.models.context_length import max_model_len
from polyrunner.models.gguf.quantized import quantizer, select_quantization
from polyrunner.models.loader import checkpoint_dtype, load_model, read_model_config
from polyrunner.models.registry import resolve_model_class
from polyrunner.models.source import resolve_model_folder
from polyrunner.ops import apply_overrides
from polyrunner.plugins import create_backend
from polyrunner.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    folder: Path
    hf_config: dict[str, Any]
    arch: DecoderArch
    max_model_len: int
    dtype: torch.dtype
    quantization: str | None
    runner: ModelRunner
    num_blocks: int


def read_arch(config: EngineConfig) -> tuple[Path, dict[str, Any], DecoderArch]:
    folder = resolve_model_folder(config.model.model)
    hf_config, arch = read_model_config(folder)   # checked, also against the checkpoint's shapes
    return folder, hf_config, arch


def load_runner(config: EngineConfig, backend: Backend, tp: TensorParallel | None = None) -> LoadedModel:
    """Load the model (with `tp`: this rank's shard) and make its runner and KV cache; each
    stage is logged at INFO with its time (silent unless logging is configured)."""
    rank = "" if tp is None else f", rank {tp.shard.rank} of {tp.shard.size}"
    logger.info("model %s on backend %s%s: starting", config.model.model or "(the embedded default)",
                backend.name, rank)
    folder, hf_config, arch = read_arch(config)
    model_cls = resolve_model_class(arch.architecture)
    check_attention_features(arch, backend)
    limit = max_model_len(arch, config)
    if config.model.dtype == "auto":
        dtype, why = backend.resolve_dtype(checkpoint_dtype(hf_config))
        logger.info("dtype auto -> %s: %s", str(dtype).removeprefix("torch."), why)
    else:
        dtype = DTYPES[config.model.dtype]
    backend.check_dtype(dtype)
    quantization = select_quantization(config.model.quantization, config.model.dtype, hf_config, backend,
                                       config.model.model)
    if quantization is not None and tp is not None:
        if config.model.quantization is not None:
            raise ValueError(f"quantization={quantization!r} does not support tensor_parallel_size > 1; "
                             "allowed with tensor parallelism: quantization=None (dequantised weights)")
        quantization = None   # "auto": a sharded model runs dequantised
    prepare = None if quantization is None else quantizer(backend, folder, hf_config)
    parallel = {} if tp is None else {"shard": tp.shard, "all_reduce": tp.all_reduce}
    logger.info("model %s: %s, dtype %s, quantization %s, max_model_len %d", folder, arch.architecture,
                str(dtype).removeprefix("torch."), quantization, limit)
    model = load_model(folder, model_cls, arch, backend.attention, limit, dtype, backend.device, prepare,
                       **parallel)   # logs what it loads and how long it took
    started = time.perf_counter()
    overrides = backend.op_overrides(dtype)
    replaced = apply_overrides(model, overrides)   # the backend's faster modules, per role
    logger.info("op overrides of backend %s: %s in %.1f s", backend.name,
                ", ".join(f"{n} {role}" for role, n in replaced.items()) or "none", time.perf_counter() - started)
    runner_arch = arch if tp is None else dataclasses.replace(
        arch, num_heads=tp.shard.num_heads, num_kv_heads=tp.shard.num_kv_heads)
    runner = ModelRunner(config, backend, model, runner_arch, limit, dtype,
                         gather_vocab=None if tp is None else tp.gather_vocab)
    if config.lora is not None:   # around the overridden linears, then the backend's "lora" op
        shard = TPShard.single(arch) if tp is None else tp.shard
        upload = backend.to_device if backend.capabilities.static_shapes else None   # compiled, not replayed
        runner.attach_lora(LoRAManager(model, config.lora, arch, shard, runner.max_step_tokens, dtype, backend.device,
                                       upload))
        apply_overrides(model, {role: overrides[role] for role in ("lora", "lora_embedding") if role in overrides})
    num_blocks = runner.initialize_kv_cache(agree=None if tp is None else tp.agree_min)
    return LoadedModel(folder, hf_config, arch, limit, dtype, quantization, runner, num_blocks)


def join_tensor_parallel(config: EngineConfig, backend: Backend, rank: int, local_rank: int, init_method: str
                         ) -> TensorParallel:
    """This process's rank of the group: its device, its shard, the rendezvous."""
    size = config.parallel.tensor_parallel_size
    comm = backend.capabilities.distributed_backend
    if comm is None:
        raise ValueError(f"tensor_parallel_size={size} is not supported by backend {backend.name!r}: it declares "
                         "no torch.distributed communicator (Capabilities.distributed_backend); allowed: 1")
    _, _, arch = read_arch(config)
    shard = TPShard.of(arch, rank, size)
    backend.init_rank(local_rank, size)
    return init_tensor_parallel(shard, comm, init_method, backend.device)


@dataclass
class WorkerRank:
    tp: TensorParallel
    runner: ModelRunner


def build_tp_rank(config_dict: dict[str, Any], rank: int, size: int, local_rank: int, init_method: str,
                  started: Callable[[], None] | None = None) -> WorkerRank:
    """A worker rank (> 0): the same backend, adjustments and model setup as the
    driver's engine, without a scheduler. `started()` once the configuration
    is valid, before the rendezvous."""
    config = EngineConfig.model_validate(config_dict)
    backend = create_backend(config)
    if started is not None:
        started()
    tp = join_tensor_parallel(config, backend, rank, local_rank, init_method)
    return WorkerRank(tp, load_runner(config, backend, tp).runner)
