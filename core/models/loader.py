"""Load a Llama-family model from a local Hugging Face folder (safetensors only).

A bad file fails before anything is allocated, with an error naming the file
(and the config field): config.json that is not JSON or holds a bad value
(`hf_config.py`), a corrupt or truncated safetensors shard, a checkpoint whose
tensor shapes do not match config.json (`read_model_config`).

A converted GGUF folder (`gguf/loader.py`) holds no weight copy: its tensors are
read from the GGUF file in place, dequantized into the run dtype
(`gguf/tensors.py`); every function here takes such a folder like any other.

Memory: the parameters are the one resident copy of the weights. Each tensor views a
mapping of its own bytes only, is copied into its parameter and dropped, which unmaps it
(`weight_reader.py`: no whole shard stays mapped while the parameters fill), so the peak
of a load is the parameters plus about one tensor.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from polyrunner.models.arch import DecoderArch
from polyrunner.models.gguf import tensors as gguf_tensors
from polyrunner.models.hf_config import HFDecoderConfig, ModelConfigTypeError, ModelFileError, read_json_file
from polyrunner.models.progress import progress
from polyrunner.models.weight_reader import read_safetensors

logger = logging.getLogger(__name__)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict (its fields are checked by `DecoderArch.from_hf_config`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    raw = read_json_file(cfg)
    if not isinstance(raw, dict):
        raise ModelConfigTypeError(f"{cfg}: must hold a JSON object, got {type(raw).__name__}", cfg)
    return raw


_CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype | None:
    """The dtype config.json declares for the weights ("torch_dtype", or "dtype" as
    newer transformers write it); None when absent or not a float dtype we run."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if isinstance(name, str):
        return _CHECKPOINT_DTYPES.get(name.removeprefix("torch."))
    return None


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's shard files (sharded index or single file); no pickle files."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json_file(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelFileError(f"{index}: field 'weight_map' must be an object of tensor name -> shard file "
                                 f"name, got {type(weight_map).__name__}", index, "weight_map")
        files = [folder / n for n in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index}: lists shard {f.name!r}, which is not in {str(folder)!r}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded)" if pickles else ""
        raise FileNotFoundError(f"no .safetensors weights in {str(folder)!r}{hint}")
    return files


def _open(path: Path) -> Any:
    """`safe_open`, whose errors (a corrupt, truncated or unreadable shard) name the file."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise ModelFileError(f"{path}: corrupt or truncated safetensors file ({exc})", path) from None


def iter_weights(folder: str | Path, dtype: torch.dtype,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in `dtype`, except those named in `skip` (never read); each a
    fresh host tensor the caller owns (`weight_reader.read_safetensors`: one at a time, no
    shard mapped)."""
    if gguf_tensors.is_gguf_folder(folder):
        yield from gguf_tensors.iter_weights(folder, dtype, skip)
        return
    for path in safetensors_files(folder):
        for name, tensor in read_safetensors(path, skip):
            yield name, tensor.to(dtype)
            del tensor


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape and shard file, from the safetensors headers (no tensor is read);
    for a converted GGUF folder from its tensor index, naming the GGUF file."""
    if gguf_tensors.is_gguf_folder(folder):
        return gguf_tensors.tensor_shapes(folder)
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in safetensors_files(folder):
        with _open(path) as f:
            for name in f.keys():
                shapes[name] = (tuple(f.get_slice(name).get_shape()), path)
    return shapes


def read_model_config(folder: str | Path) -> tuple[dict[str, Any], DecoderArch]:
    """The folder's config.json and the architecture it describes, checked field by
    field and against the checkpoint's tensor shapes first (nothing is allocated)."""
    raw, path = read_hf_config(folder), Path(folder) / "config.json"
    check_checkpoint_shapes(folder, HFDecoderConfig.from_file_dict(raw, path))
    return raw, DecoderArch.from_hf_config(raw, path)


def check_checkpoint_shapes(folder: str | Path, cfg: HFDecoderConfig) -> None:
    """Compare config.json with the checkpoint's tensor shapes (from the safetensors
    headers): a size the checkpoint does not have (vocab_size 10**12 over a
    512-row embedding) is a ModelFileError naming the config field, not an
    allocator failure. Tensors the checkpoint lacks are left to `load_weights`."""
    config = Path(folder) / "config.json"
    shapes = checkpoint_shapes(folder)
    heads, head_dim = cfg.num_attention_heads, cfg.resolved_head_dim
    kv = cfg.num_key_value_heads or heads
    rules = [  # (tensor, dimension, config field, expected size, how it follows from the config)
        ("model.embed_tokens.weight", 0, "vocab_size", cfg.vocab_size, ""),
        ("model.embed_tokens.weight", 1, "hidden_size", cfg.hidden_size, ""),
        ("lm_head.weight", 0, "vocab_size", cfg.vocab_size, ""),
        ("model.layers.0.self_attn.q_proj.weight", 0, "num_attention_heads", heads * head_dim,
         f" (num_attention_heads {heads} x head_dim {head_dim})"),
        ("model.layers.0.self_attn.k_proj.weight", 0, "num_key_value_heads", kv * head_dim,
         f" (num_key_value_heads {kv} x head_dim {head_dim})"),
        ("model.layers.0.mlp.gate_proj.weight", 0, "intermediate_size", cfg.intermediate_size, ""),
    ]
    for name, dim, field, want, how in rules:
        if name in shapes:
            shape, path = shapes[name]
            if len(shape) != 2 or shape[dim] != want:
                raise ModelFileError(f"{config}: config field {field!r} does not match the checkpoint: tensor "
                                     f"{name!r} in {path} has shape {list(shape)}, the config implies dimension "
                                     f"{dim} = {want}{how}", config, field)
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    n = cfg.num_hidden_layers
    if layers and (len(layers) != n or max(layers) != n - 1):   # not 0..n-1
        raise ModelFileError(f"{config}: config field 'num_hidden_layers' ({n}) does not match the "
                             f"checkpoint, which holds layers {min(layers)}..{max(layers)} ({len(layers)} layers)",
                             config, "num_hidden_layers")


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give each meta parameter and buffer of `model` uninitialised memory on `device`,
    keeping shared (tied) parameters shared. `Module.to_empty` does the same through
    torch's reference `empty_like`, whose first call imports sympy (~0.8 s of cold start)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    is_param = isinstance(t, torch.nn.Parameter)
                    made[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
                table[name] = made[id(t)]


def load_model(folder: str | Path, model_cls: type, arch: DecoderArch, attn_op: Any,
               max_positions: int, dtype: torch.dtype, device: torch.device,
               prepare: Callable[[torch.nn.Module], Iterable[str]] | None = None, **parallel: Any) -> torch.nn.Module:
    """Build `model_cls` on `device` in `dtype` and load the folder's weights.
    `prepare(model)`, called before any weight is read, may replace modules and
    returns the checkpoint names it made unneeded (they are not read).
    `read_model_config` gives an `arch` whose sizes the checkpoint's tensors have.
    Logs (INFO) what it loads and how long it took; a tqdm bar while it reads
    where those lines are shown on a terminal (`progress.py`)."""
    with torch.device("meta"):  # no random init: every parameter is loaded below
        model = model_cls(arch, attn_op, max_positions, **parallel)   # tensor-parallel: shard, all_reduce
    for param in model.parameters():  # on meta: free; buffers (rotary tables) stay float32, like Hugging Face
        param.data = param.data.to(dtype)
    materialize(model, device)  # uninitialised memory: untouched until loaded
    for module in model.modules():  # recompute non-persistent buffers lost on the meta device
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    skip = frozenset(prepare(model)) if prepare is not None else frozenset()
    names = checkpoint_shapes(folder)
    dense = len(set(names) - skip)
    where = gguf_tensors.describe_source(folder, dtype, skip) if gguf_tensors.is_gguf_folder(folder) else folder
    logger.info("loading %d tensors (%d run quantized, %d dense in %s) from %s", len(names), len(skip & set(names)),
                dense, str(dtype).removeprefix("torch."), where)
    started = time.perf_counter()
    model.load_weights(progress(iter_weights(folder, dtype, skip), logger, "loading weights", total=dense))
    logger.info("loaded %d tensors in %.1f s", dense, time.perf_counter() - started)
    return model.eval().requires_grad_(False)
