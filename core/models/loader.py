"""Load a Llama-family model from a local Hugging Face folder (safetensors only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from polyrunner.models.arch import DecoderArch


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    return json.loads(cfg.read_text())


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
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded)" if pickles else ""
        raise FileNotFoundError(f"no .safetensors weights in {str(folder)!r}{hint}")
    return files


def iter_weights(folder: str | Path, dtype: torch.dtype,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in `dtype`, except those named in `skip` (never read)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in skip:
                    yield name, f.get_tensor(name).to(dtype)


def load_model(folder: str | Path, model_cls: type, arch: DecoderArch, attn_op: Any,
               max_positions: int, dtype: torch.dtype, device: torch.device,
               prepare: Callable[[torch.nn.Module], Iterable[str]] | None = None, **parallel: Any) -> torch.nn.Module:
    """Build `model_cls` on `device` in `dtype` and load the folder's weights.
    `prepare(model)`, called before any weight is read, may replace modules and
    returns the checkpoint names it made unneeded (they are not read)."""
    with torch.device("meta"):  # no random init: every parameter is loaded below
        model = model_cls(arch, attn_op, max_positions, **parallel)   # tensor-parallel: shard, all_reduce
    for param in model.parameters():  # on meta: free; buffers (rotary tables) stay float32, like Hugging Face
        param.data = param.data.to(dtype)
    model.to_empty(device=device)  # uninitialised memory: untouched until loaded
    for module in model.modules():  # recompute non-persistent buffers lost on the meta device
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    skip = frozenset(prepare(model)) if prepare is not None else frozenset()
    model.load_weights(iter_weights(folder, dtype, skip))
    return model.eval().requires_grad_(False)
