"""GGUF file -> local Hugging Face folder.

A GGUF file (llama.cpp's format) holds a model's weights, often quantized, and
its config and tokenizer as metadata under llama.cpp's key names. The model
loader only reads Hugging Face folders, so a GGUF is converted once into one:

    config.json              LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM, or for a
                             mixture of experts MixtralForCausalLM / Qwen2MoeForCausalLM /
                             Qwen3MoeForCausalLM (`moe.py`: a layer's experts stay one
                             stacked tensor per projection); its
                             torch_dtype is the precision the file's weights carry
                             (`weights_dtype`), which `dtype="auto"` runs in
    gguf_tensors.json        where every tensor (Hugging Face name) lies in the GGUF file:
                             no weight is copied; `tensors.py` reads them in place,
                             dequantized into the run dtype, when the model loads
    tokenizer.json           built with `tokenizers` from the vocabulary in the metadata
    tokenizer_config.json    special tokens, add_bos_token, chat template
    generation_config.json   bos / eos ids
    gguf_quantized.json      where each quantized weight matrix's blocks lie in the
                             GGUF file (`quantized.py` reads them for backends that
                             run GGUF blocks as they are)

The folder plus the GGUF file equal what transformers gives for the same file
(`from_pretrained(dir, gguf_file=...)`): the same dequantized values (through
`gguf.quants.dequantize`), llama.cpp's rotary row permutation of q_proj/k_proj
undone, and a tokenizer that encodes the same ids. `cache.cached_gguf_folder` does
the conversion once per file (metadata and tokenizer only: the folder holds a
few MB) and afterwards only checks a path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polyrunner.models.gguf import moe as gguf_moe
from polyrunner.models.gguf.errors import GGUFError, gguf_import_error
from polyrunner.models.gguf.tensors import FLOAT_TYPES, TENSORS_FILE
from polyrunner.models.gguf.vocab import build_tokenizer

__all__ = [
    "GGUFError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_QUANT_TYPES",
    "convert_gguf",
    "write_json",
]


# Types `gguf.quants.dequantize` implements that this loader is tested on.
SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
)
# GGUF `general.architecture` -> (HF class, HF model_type). Mistral files say "llama" (Mixtral:
# "llama" with experts, `moe.MOE_ARCHITECTURES`).
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": gguf_moe.MOE_ARCHITECTURES["qwen2moe"],
    "qwen3moe": gguf_moe.MOE_ARCHITECTURES["qwen3moe"],
}
logger = logging.getLogger(__name__)

QUANTIZED_FILE = "gguf_quantized.json"
# Types whose matrices are not recorded in QUANTIZED_FILE (every other type's are: a backend
# executes what it can of them).
DENSE_TYPES = FLOAT_TYPES

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # folded into config.json's rope_scaling


# ------------------------------------------------------------------ public API


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert the GGUF file at `path` into a Hugging Face folder at `out_dir`.

    `out_dir` is created if needed; existing files of the same names are
    overwritten. Raises `GGUFError` (a ValueError) naming the file and the
    problem for a corrupt/truncated file, an unsupported architecture or an
    unsupported quantization type.
    """
    path = Path(path).expanduser()
    out = Path(out_dir)
    gf = _GGUFFile.open(path)
    config, plan = gf.model_plan()  # every check happens before anything is written
    index = _tensor_index(plan, path)
    tok = gf.tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    if tok is not None:
        backend, tok_config = tok
        backend.save(str(out / "tokenizer.json"))
        write_json(out / "tokenizer_config.json", tok_config)
    else:  # no vocabulary in the file: leave no stale tokenizer from an earlier conversion
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).unlink(missing_ok=True)
    (out / "model.safetensors").unlink(missing_ok=True)   # an earlier version's float32 copy
    write_json(out / TENSORS_FILE, index)
    quantized = {p.name: p.quantized for p in plan if p.quantized is not None}
    if quantized:
        write_json(out / QUANTIZED_FILE, {"source": str(path.resolve()), "tensors": quantized})
        config["polyrunner_gguf"]["quantized_weights"] = QUANTIZED_FILE
    else:
        (out / QUANTIZED_FILE).unlink(missing_ok=True)
    write_json(out / "generation_config.json", gf.generation_config())
    write_json(out / "config.json", config)
    logger.info("read %s: %s, %d tensors (%d block-quantized matrices)", path.name, gf.file_type_name(),
                len(plan), len(quantized))
    return out


# -------------------------------------------------------------- the GGUF file


@dataclass
class _TensorPlan:
    """One output tensor: its HF name and shape, and where it lies in the GGUF file
    (`where`, an entry of TENSORS_FILE); for a quantized matrix also its entry of
    QUANTIZED_FILE."""

    name: str
    shape: tuple[int, ...]
    where: dict[str, Any]
    quantized: dict[str, Any] | None = None


class _GGUFFile:
    def __init__(self, path: Path, reader: Any, meta: dict[str, Any]) -> None:
        self.path = path
        self.reader = reader
        self.meta = meta
        self.tensors = {t.name: t for t in reader.tensors}

    @classmethod
    def open(cls, path: Path) -> "_GGUFFile":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # e.g. gguf 0.10 imports sentencepiece at import time
            raise gguf_import_error(exc) from None
        try:
            reader = _fast_reader(GGUFReader)(path, "r")
            meta = {key: _field_value(field) for key, field in reader.fields.items()}
        except ImportError as exc:  # a module gguf imports lazily: a missing dependency, not a bad file
            raise gguf_import_error(exc) from None
        except Exception as exc:  # the gguf package raises bare ValueError/IndexError/KeyError
            raise GGUFError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from None
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise GGUFError(
                    f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to "
                    f"{t.data_offset + t.n_bytes}, the file has {size}"
                )
        return cls(path, reader, meta)

    # ---------------------------------------------------------------- metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def file_type_name(self) -> str:
        """llama.cpp's name of the file's quantization ("Q4_1", "Q4_K_M"), or "unknown"."""
        try:
            from gguf import LlamaFileType

            return LlamaFileType(self.get("general.file_type")).name.removeprefix("MOSTLY_")
        except (ImportError, ValueError):
            return "unknown"

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.meta[key]

    def architecture(self) -> str:
        arch = self.need("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {arch!r} is not supported; "
                f"supported GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.get("split.count", 1) > 1:
            raise GGUFError(
                f"{self.path}: this is part {self.get('split.no', 0) + 1} of a {self.get('split.count')}-part split "
                "GGUF; merge the parts first (llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)"
            )
        return arch

    # ------------------------------------------------------------ config + weights

    def model_plan(self) -> tuple[dict[str, Any], list[_TensorPlan]]:
        arch = self.architecture()
        hf_class, model_type = SUPPORTED_ARCHITECTURES[arch]
        self._check_quant_types()

        def per_layer_scalar(key: str, default: Any = None) -> Any:
            value = self.get(key, default)
            if isinstance(value, list):
                if len(set(value)) != 1:
                    raise GGUFError(f"{self.path}: {key} differs per layer ({value}); not supported")
                value = value[0]
            return value

        heads = int(per_layer_scalar(f"{arch}.attention.head_count"))
        kv_heads = int(per_layer_scalar(f"{arch}.attention.head_count_kv", heads))
        hidden = int(self.need(f"{arch}.embedding_length"))
        layers = int(self.need(f"{arch}.block_count"))
        head_dim = self.get(f"{arch}.attention.key_length")
        if head_dim is None and arch == "llama":
            head_dim = self.get(f"{arch}.rope.dimension_count")
        head_dim = int(head_dim or hidden // heads)
        if "token_embd.weight" not in self.tensors:
            raise GGUFError(f"{self.path}: the file has no token_embd.weight tensor")
        vocab = int(self.tensors["token_embd.weight"].shape[1])
        intermediate = per_layer_scalar(f"{arch}.feed_forward_length")
        if intermediate is None and "blk.0.ffn_up.weight" in self.tensors:
            intermediate = int(self.tensors["blk.0.ffn_up.weight"].shape[1])
        moe = None
        if gguf_moe.is_moe(arch, self.meta):
            shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in self.reader.tensors}
            moe = gguf_moe.moe_config(arch, self.meta, shapes, hidden, layers,
                                      None if intermediate is None else int(intermediate), self.path)
            intermediate = moe["intermediate_size"]

        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(intermediate),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(self.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.get(f"{arch}.context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.get("tokenizer.ggml.padding_token_id"),
            "torch_dtype": self.weights_dtype(),
        }
        if arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
            config["mlp_bias"] = False
        elif arch == "qwen2":
            config["use_sliding_window"] = False
        elif arch in ("qwen3", "qwen3moe"):
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        if moe is not None:
            config.update(moe)
        rope_scaling = self._rope_scaling(arch, head_dim, config["rope_theta"])
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        config["polyrunner_gguf"] = {
            "source": self.path.name,
            "general.name": self.get("general.name"),
            "file_type": self.get("general.file_type"),
        }

        plan = self._tensor_plan(arch, heads, kv_heads, head_dim, layers, moe is not None)
        return config, plan

    def weights_dtype(self) -> str:
        """The precision the file's weight matrices carry, as a config.json
        `torch_dtype`: "float32" when every matrix is F32, "float16" when they are
        F16 (or F32), else "bfloat16": a BF16 file, or a quantized one, whose
        values (at most 8 bits times a float16 scale) bfloat16 holds within the
        quantization error. One-dimensional tensors (norms, biases) do not count."""
        kinds = {t.tensor_type.name for t in self.reader.tensors
                 if t.name not in _IGNORED_TENSORS and len(t.shape) > 1}
        if kinds <= {"F32"}:
            return "float32"
        if kinds <= {"F32", "F16"}:
            return "float16"
        return "bfloat16"

    def _check_quant_types(self) -> None:
        bad = {}
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_QUANT_TYPES and t.name not in _IGNORED_TENSORS:
                bad.setdefault(t.tensor_type.name, t.name)
        if bad:
            kinds = ", ".join(f"{kind} (e.g. tensor {name!r})" for kind, name in bad.items())
            raise GGUFError(
                f"{self.path}: unsupported quantization type {kinds}; "
                f"supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
            )

    def _tensor_plan(self, arch: str, heads: int, kv_heads: int, head_dim: int, layers: int,
                     moe: bool = False) -> list[_TensorPlan]:
        plan: list[_TensorPlan] = []
        unknown = []
        layer_map = {**_LAYER_TENSORS, **gguf_moe.layer_tensors(arch)} if moe else _LAYER_TENSORS
        for t in self.reader.tensors:
            if t.name in _IGNORED_TENSORS:
                continue
            hf_name = _hf_tensor_name(t.name, layers, layer_map)
            if hf_name is None:
                unknown.append(t.name)
                continue
            shape = gguf_moe.hf_shape(t.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            permute_heads = None
            if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                # llama.cpp's converter permutes q/k rows (HF's rotate-half -> interleaved rotary).
                permute_heads = heads if ".attn_q." in t.name else kv_heads
                if shape[0] != permute_heads * head_dim:
                    raise GGUFError(
                        f"{self.path}: tensor {t.name!r} has {shape[0]} rows, expected "
                        f"{permute_heads} heads x {head_dim} = {permute_heads * head_dim}"
                    )
            where = {"name": t.name, "type": t.tensor_type.name, "shape": list(shape),
                     "offset": int(t.data_offset), "nbytes": int(t.n_bytes), "permute_heads": permute_heads}
            quantized = None   # 2-D matrices only: a 3-D expert stack runs dequantised ("moe" role)
            if len(shape) == 2 and t.tensor_type.name not in DENSE_TYPES:
                quantized = {k: where[k] for k in ("type", "shape", "offset", "nbytes", "permute_heads")}
            plan.append(_TensorPlan(hf_name, shape, where, quantized))
        if unknown:
            raise GGUFError(
                f"{self.path}: tensors this loader cannot place in a {arch} model: "
                f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
            )
        names = {p.name for p in plan}
        for required in ("model.embed_tokens.weight", "model.norm.weight"):
            if required not in names:
                raise GGUFError(f"{self.path}: the file has no tensor for {required}")
        return plan

    def _rope_scaling(self, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
        kind = self.get(f"{arch}.rope.scaling.type")
        factor = self.get(f"{arch}.rope.scaling.factor")
        if kind is None and self.get(f"{arch}.rope.scale_linear") is not None:
            kind, factor = "linear", self.get(f"{arch}.rope.scale_linear")
        if "rope_freqs.weight" in self.tensors:
            freqs = _dense(self.tensors["rope_freqs.weight"]).reshape(-1)
            return _llama3_rope_scaling(freqs, head_dim, theta, self.path)
        if kind in (None, "none") or factor in (None, 1.0):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            out = {"rope_type": "yarn", "factor": float(factor)}
            orig = self.get(f"{arch}.rope.scaling.original_context_length")
            if orig is not None:
                out["original_max_position_embeddings"] = int(orig)
            return out
        raise GGUFError(f"{self.path}: rope scaling type {kind!r} is not supported (supported: linear, yarn)")

    # ---------------------------------------------------------------- tokenizer

    def tokenizer(self) -> tuple[Any, dict[str, Any]] | None:
        """`(tokenizers.Tokenizer, tokenizer_config)`, or None when the file has no vocabulary."""
        if "tokenizer.ggml.tokens" not in self.meta:
            return None

        try:
            return build_tokenizer(self.meta, self.path)
        except GGUFError:
            raise
        except Exception as exc:
            raise GGUFError(f"{self.path}: cannot build the tokenizer ({type(exc).__name__}: {exc})") from None

    def generation_config(self) -> dict[str, Any]:
        eos = [self.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(i for i in eos if i is not None))
        out: dict[str, Any] = {"bos_token_id": self.get("tokenizer.ggml.bos_token_id")}
        if eos:
            out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if self.get("tokenizer.ggml.padding_token_id") is not None:
            out["pad_token_id"] = self.get("tokenizer.ggml.padding_token_id")
        return out


# ------------------------------------------------------------------ tensors


def _hf_tensor_name(name: str, layers: int, layer_map: dict[str, str] = _LAYER_TENSORS) -> str | None:
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and int(m.group(1)) < layers and m.group(2) in layer_map:
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}.{suffix}"
    return None


def _dense(t: Any) -> np.ndarray:
    """A tensor as float32, shaped like PyTorch would (rows first)."""
    from gguf.quants import dequantize

    out = dequantize(t.data, t.tensor_type)
    return np.asarray(out, dtype=np.float32)


def _tensor_index(plan: list[_TensorPlan], src: Path) -> dict[str, Any]:
    """TENSORS_FILE: every tensor's place in the GGUF file, and the file's size and mtime
    (a folder whose file changed since is refused at load, `tensors.py`)."""
    tensors: dict[str, Any] = {}
    for p in plan:
        if p.name in tensors:
            raise GGUFError(f"{src}: two tensors map to {p.name}")
        tensors[p.name] = p.where
    st = src.stat()
    return {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "tensors": tensors}


# ------------------------------------------------------------------ rope


def _llama3_inv_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                             orig: int) -> np.ndarray:
    """The per-frequency divisors transformers' llama3 rope applies (llama.cpp's rope_freqs)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = orig / low, orig / high
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(medium, smoothed, scaled)
    return inv_freq / scaled


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float, path: Path) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's baked `rope_freqs` tensor."""
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 2.0, 0.5, 4.0):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low or freqs.shape[0] != head_dim // 2:
                    continue
                want = _llama3_inv_freq_factors(head_dim, theta, factor, low, high, orig)
                if np.allclose(want, freqs, rtol=1e-4, atol=1e-5):
                    return {
                        "rope_type": "llama3", "factor": round(factor, 6), "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig,
                    }
    raise GGUFError(
        f"{path}: the rope_freqs tensor does not match any llama3 rope scaling this loader knows; "
        "refusing to load a model whose positions would be encoded wrongly"
    )


# ------------------------------------------------------------------ helpers


def _field_value(field: Any) -> Any:
    """A metadata value as Python: str, int, float, bool, or a list of those."""
    from gguf import GGUFValueType as T

    if not field.types:
        return None
    kind = field.types[0]
    if kind == T.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:  # nested arrays: nothing this loader reads
            return None
        if sub == T.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        values = np.concatenate([field.parts[i] for i in field.data]).tolist()
        return [bool(v) for v in values] if sub == T.BOOL else values
    if kind == T.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if kind == T.BOOL else value


def _fast_reader(base: type) -> type:
    """gguf's GGUFReader, its file map held as a plain ndarray view instead of an
    np.memmap: the metadata parse slices the map ~250,000 times for a 49k-token
    vocabulary, and np.memmap's per-slice Python hook made that 3x slower (SmolLM2:
    4.7 s -> 1.4 s). The bytes are the same memory-mapped file."""
    class Reader(base):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
