"""Random-weight models of real shapes, for benchmarks: a bf16 Hugging Face folder and GGUF files
quantized by llama.cpp's own quantizer, cached outside the clone.

    .venv/bin/python benchmarks/realistic_models.py [--model smollm2-1.7b llama-3.2-3b llama-3.1-8b | all]
                                                    [--types Q4_K_M Q5_K_M Q6_K Q8_0 bf16] [--keep-bf16-gguf] [--list]

Per shape, under ~/.cache/polyrunner/bench-models/<shape>/ (POLYRUNNER_BENCH_MODELS moves the root):

- `hf-bf16/`: config.json (the real model's shape), bf16 safetensors shards, the tokenizer;
- `<shape>-<TYPE>.gguf` for each GGUF type: `convert_hf_to_gguf.py` (the one vendored in the
  llama-cpp-python sdist that `compare.py` builds, so the converter, its gguf-py and the quantizer
  are one llama.cpp version) writes a bf16 GGUF, `llama_model_quantize` (llama-cpp-python's ctypes
  binding, in the llama.cpp venv) quantizes it to each type; the bf16 GGUF is removed afterwards
  unless `--keep-bf16-gguf`;
- `bench_model.json`: the shape, where it came from, the seed, the tool versions.

Weights: normal(0, 0.02) for every matrix (the models' `initializer_range`), RMSNorm weights 1 + normal(0,
0.02), written in bfloat16 one tensor at a time into shards of ~2 GiB (an 8B model needs ~5 GiB of RAM at
most: the shard being written and one tensor in float32; not 16). Seeded per tensor: a rerun writes the
same bytes.

Tokenizer: the embedded SmolLM2 GGUF's (49152 tokens, converted to an HF folder by polyrunner), the one
the benchmark workloads' token ids come from. The Llama-3 shapes keep their real vocabulary of 128256
(the embedding and LM head have their real sizes); the converter pads the tokenizer's 49152 entries
with 79104 unused `[PAD<i>]` tokens, so only ids < 49152 mean anything. bos/eos are the tokenizer's.

Idempotent: whatever exists is kept (a partial write is named `*.partial` until it is complete). Before
writing, the free disk space is checked; a shape whose missing files (plus the transient bf16 GGUF) do
not fit is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf_quantize import LLAMA_CPP_VERSION, convert_to_gguf, llama_cpp_tools, quantize
from model_shapes import REAL_SHAPES, SHAPES, Shape, numel

ROOT = Path(os.environ.get("POLYRUNNER_BENCH_MODELS", Path.home() / ".cache" / "polyrunner" / "bench-models"))
GGUF_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
ALL_TYPES = (*GGUF_TYPES, "bf16")
# bits per weight of each type's file, for the disk estimate only (llama.cpp's quantize table, rounded up)
BITS_PER_WEIGHT = {"Q4_K_M": 5.0, "Q5_K_M": 5.8, "Q6_K": 6.7, "Q8_0": 8.6, "bf16": 16.0}
SHARD_BYTES = 2 << 30
DISK_RESERVE = 2 << 30            # left free after the shape's files are written
STD = 0.02


# ---- paths ------------------------------------------------------------------------
@dataclass
class ModelSet:
    """The files of one shape that exist: `files` maps a type ("Q4_K_M", ..., "bf16") to its path."""
    shape: Shape
    folder: Path
    files: dict[str, Path]
    skipped: dict[str, str]          # type -> why it is missing


def shape_dir(name: str) -> Path:
    return ROOT / name


def hf_dir(name: str) -> Path:
    return shape_dir(name) / "hf-bf16"


def gguf_path(name: str, qtype: str) -> Path:
    return shape_dir(name) / f"{name}-{qtype}.gguf"


def resolve(model: str) -> tuple[Shape, Path]:
    """A shape name, or a shape's folder (or a file/folder inside it), -> (shape, its folder)."""
    if model in SHAPES:
        return SHAPES[model], shape_dir(model)
    path = Path(model).expanduser().resolve()
    for cand in (path, *path.parents):
        meta = cand / "bench_model.json"
        if meta.is_file():
            name = json.loads(meta.read_text())["shape"]
            return SHAPES[name], cand
    raise SystemExit(f"--model {model!r}: neither a shape ({', '.join(SHAPES)}) nor a folder written by "
                     f"benchmarks/realistic_models.py (one with bench_model.json)")


def existing(shape: Shape, folder: Path, types: list[str]) -> ModelSet:
    files, skipped = {}, {}
    for t in types:
        p = folder / "hf-bf16" if t == "bf16" else folder / f"{shape.name}-{t}.gguf"
        ok = (p / "config.json").is_file() and (p / "model.safetensors.index.json").is_file() if t == "bf16" \
            else p.is_file()
        if ok:
            files[t] = p
        else:
            skipped[t] = f"{p} does not exist"
    return ModelSet(shape, folder, files, skipped)


# ---- disk -------------------------------------------------------------------------
def estimated_bytes(shape: Shape, qtype: str) -> int:
    return int(shape.num_params() * BITS_PER_WEIGHT[qtype] / 8 * 1.02) + (16 << 20)


def missing_bytes(shape: Shape, types: list[str], keep_bf16_gguf: bool = False) -> tuple[int, int]:
    """(bytes the missing files of `types` need, of which transient: the bf16 GGUF, removed afterwards)."""
    need = transient = 0
    if not (hf_dir(shape.name) / "model.safetensors.index.json").is_file():
        need += estimated_bytes(shape, "bf16")     # the GGUFs are converted from it too
    gguf_missing = [t for t in types if t in GGUF_TYPES and not gguf_path(shape.name, t).is_file()]
    need += sum(estimated_bytes(shape, t) for t in gguf_missing)
    if gguf_missing and not gguf_path(shape.name, "bf16").is_file():
        transient = estimated_bytes(shape, "bf16")
        need += transient
    return need, 0 if keep_bf16_gguf else transient


def free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


# ---- the HF folder ----------------------------------------------------------------
def _tokenizer_source() -> Path:
    """The folder of the embedded SmolLM2 GGUF, converted by polyrunner (tokenizer.json and its config)."""
    from polyrunner.models.source import resolve_model_folder
    return Path(resolve_model_folder(None))


def hf_config(shape: Shape) -> dict[str, Any]:
    tok = json.loads((_tokenizer_source() / "config.json").read_text())
    cfg = dict(shape.config, torch_dtype="bfloat16", bos_token_id=tok.get("bos_token_id", 1),
               eos_token_id=tok.get("eos_token_id", 2), use_cache=True)
    cfg["polyrunner_bench_model"] = {"shape": shape.name, "weights": f"random normal(0, {STD}), seeded",
                                     "source": shape.source}
    return cfg


def _plan_shards(shape: Shape) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shp in shape.tensors():
        nbytes = 2 * numel(shp)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shp))
        size += nbytes
    return shards


def _random_tensor(index: int, name: str, shp: tuple[int, ...], seed: int):
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    t = torch.empty(shp, dtype=torch.float32)
    t.normal_(0.0, STD, generator=g)
    if len(shp) == 1:          # RMSNorm weights around 1
        t += 1.0
    return t.to(torch.bfloat16)


def write_hf_folder(shape: Shape, dest: Path, seed: int = 0) -> Path:
    """The bf16 HF folder of `shape` at `dest` (written to dest.partial, then renamed)."""
    from safetensors.torch import save_file
    if (dest / "model.safetensors.index.json").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = _tokenizer_source()
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / fname).is_file():
            shutil.copy(src / fname, tmp / fname)
    (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    shards = _plan_shards(shape)
    weight_map, total, index = {}, 0, 0
    start = time.perf_counter()
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shp in shard:
            tensors[name] = _random_tensor(index, name, shp, seed)
            index += 1
            weight_map[name] = fname
            total += 2 * numel(shp)
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
        print(f"[models] {shape.name}: wrote {fname} ({total / 1e9:.2f} GB so far, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def _metadata(shape: Shape, seed: int) -> dict[str, Any]:
    return {"shape": shape.name, "source": shape.source, "tokenizer": shape.tokenizer_note,
            "weights": f"random normal(0, {STD}) matrices, RMSNorm 1 + normal(0, {STD}); bf16; seed {seed}",
            "params": shape.num_params(), "llama_cpp_python": LLAMA_CPP_VERSION,
            "config": shape.config}


def ensure(shape: Shape, types: list[str], llama_python: Path | None = None, keep_bf16_gguf: bool = False,
           threads: int | None = None, seed: int = 0) -> ModelSet:
    """Write what is missing of `types` for `shape` (skipping the shape when the disk is short)."""
    folder = shape_dir(shape.name)
    have = existing(shape, folder, types)
    if not have.skipped:
        return have
    need, transient = missing_bytes(shape, types, keep_bf16_gguf)
    free = free_bytes(ROOT)
    if need + DISK_RESERVE > free:
        why = (f"needs ~{need / 1e9:.1f} GB more disk ({transient / 1e9:.1f} GB of it the transient bf16 GGUF) "
               f"+ {DISK_RESERVE / 1e9:.0f} GB reserve, {free / 1e9:.1f} GB free at {ROOT}")
        print(f"[models] SKIP {shape.name} ({', '.join(have.skipped)}): {why}", flush=True)
        return ModelSet(shape, folder, have.files, {t: why for t in have.skipped})
    folder.mkdir(parents=True, exist_ok=True)
    meta = folder / "bench_model.json"
    if not meta.is_file():
        meta.write_text(json.dumps(_metadata(shape, seed), indent=1) + "\n")
    print(f"[models] {shape.name}: {shape.num_params() / 1e9:.2f} B parameters, writing "
          f"{', '.join(have.skipped)} (~{need / 1e9:.1f} GB) under {folder}", flush=True)
    hf = write_hf_folder(shape, hf_dir(shape.name), seed)
    gguf_missing = [t for t in types if t in GGUF_TYPES and t in have.skipped]
    if gguf_missing:
        if llama_python is None:
            import compare  # the llama.cpp venv (built on first use)
            llama_python = compare.ensure_llama_cpp_venv()
        bf16_gguf = convert_to_gguf(llama_cpp_tools(ROOT), hf, gguf_path(shape.name, "bf16"))
        for t in gguf_missing:
            quantize(llama_python, bf16_gguf, gguf_path(shape.name, t), t, threads or len(os.sched_getaffinity(0)))
        if not keep_bf16_gguf:
            bf16_gguf.unlink()
    return existing(shape, folder, types)


def disk_use(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["all"], help=f"shapes: {', '.join(SHAPES)}, or all (the real ones)")
    p.add_argument("--types", nargs="+", default=list(ALL_TYPES), choices=ALL_TYPES)
    p.add_argument("--keep-bf16-gguf", action="store_true", help="keep the converter's bf16 GGUF")
    p.add_argument("--list", action="store_true", help="print the shapes and what exists; write nothing")
    args = p.parse_args()
    names = list(REAL_SHAPES) if args.model == ["all"] else args.model
    for name in names:
        shape, folder = resolve(name)
        if args.list:
            have = existing(shape, folder, list(args.types))
            need, transient = missing_bytes(shape, list(args.types), args.keep_bf16_gguf)
            print(f"{shape.name}: {shape.num_params() / 1e9:.2f} B params, {folder} ({disk_use(folder) / 1e9:.1f} GB "
                  f"on disk), have {sorted(have.files) or '-'}, missing {sorted(have.skipped) or '-'} "
                  f"(~{need / 1e9:.1f} GB more, {transient / 1e9:.1f} GB of it transient)\n  source: {shape.source}")
            continue
        ms = ensure(shape, list(args.types), keep_bf16_gguf=args.keep_bf16_gguf)
        for t, f in ms.files.items():
            size = disk_use(f) if f.is_dir() else f.stat().st_size
            print(f"{shape.name} {t}: {f} ({size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
