"""`models/weight_reader.py`: safetensors tensors read through a mapping of each one's own bytes give
what `safetensors` gives, leave no mapping behind once dropped, and a bad header names the file and
the tensor."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyrunner.models.hf_config import ModelFileError
from polyrunner.models.weight_reader import read_safetensors


def mapped(path: Path) -> bool:
    """Whether this process maps `path` (Linux /proc)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.fixture
def shard(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(64, 48, generator=g).bfloat16(), "b.f32": torch.randn(3, generator=g),
               "c.f16": torch.randn(5, 7, generator=g).half(), "d.i64": torch.arange(10),
               "e.u8": torch.arange(200, dtype=torch.uint8), "g.empty": torch.zeros(0, 4),
               "f.f8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_same_tensors_as_safetensors(shard):
    want = load_file(str(shard))
    got = dict(read_safetensors(shard))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert got[name].view(torch.uint8).equal(t.view(torch.uint8)), name


def test_skip_and_no_mapping_left_once_dropped(shard):
    got = dict(read_safetensors(shard, frozenset({"a.bf16"})))
    assert "a.bf16" not in got and mapped(shard)
    got["b.f32"].add_(1)   # private: writing never reaches the file
    assert load_file(str(shard))["b.f32"].add(1).equal(got["b.f32"])
    del got
    gc.collect()
    assert not mapped(shard)


def test_offsets_outside_the_file_name_the_file_and_tensor(shard, tmp_path):
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["b.f32"]["data_offsets"][1] += 4
    body = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    with pytest.raises(ModelFileError, match=f"^{bad}: corrupt or truncated safetensors file \\(tensor 'b.f32'"):
        list(read_safetensors(bad))


def test_truncated_header_names_the_file(tmp_path):
    bad = tmp_path / "short.safetensors"
    bad.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match=f"^{bad}: corrupt or truncated safetensors file \\(invalid header"):
        list(read_safetensors(bad))
