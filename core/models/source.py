"""Resolve `model=` to a local Hugging Face folder (converting GGUF once)."""

from __future__ import annotations

from pathlib import Path


def resolve_model_folder(model: str | None) -> Path:
    """None -> the embedded default model; *.gguf -> its cached conversion; else a folder,
    or a Hugging Face name (org/name) resolved through the local cache (`polyrunner.models.hub`)."""
    if model is None:
        from polyrunner.models.default_model import default_model_path
        model = str(default_model_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        from polyrunner.models.gguf.cache import cached_gguf_folder
        return cached_gguf_folder(path)
    if not path.exists():
        from polyrunner.models.hub import is_hub_name, resolve_hub_model
        if is_hub_name(model):   # org/name: the local Hugging Face cache, else a download
            path = resolve_hub_model(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist (expected a folder "
                                "with config.json + *.safetensors, or a .gguf file)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    return path
