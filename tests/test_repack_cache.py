"""The repacked-blocks cache (`backends/cpu/repack_cache.py`): the first start of a GGUF model writes
its quantized linears' blocks in the layout the kernels run; later starts map that file and repack
nothing; a broken, corrupt or stale file is rebuilt, and one that cannot be written leaves the blocks
repacked in memory. Every start gives the same greedy tokens."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("gguf")

import memory_models  # noqa: E402
from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402
from polyrunner.backends.cpu import repack_cache  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402

pytestmark = pytest.mark.skipif(ql.library() is None, reason="no CPU kernel library (no C++ compiler?)")

ENGINE = dict(backend="cpu", max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=16 << 20,
              max_num_batched_tokens=ql.PREFILL_ROWS)
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 200 + i, 17]} for i in range(3)]


@pytest.fixture
def caches(tmp_path, monkeypatch) -> Path:
    """The GGUF conversions and the repack cache in the test's folder; returns the repack cache's."""
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    monkeypatch.setattr(repack_cache, "cache_dir", lambda: tmp_path / "cpu_repack")
    return tmp_path / "cpu_repack"


@pytest.fixture
def model(tmp_path) -> Path:
    """A tiny Llama GGUF in Q4_K (r8 on every kernel path), attn_v in Q4_K too so qkv is one stack."""
    return memory_models.write_gguf_llama(tmp_path / "tiny-Q4_K.gguf", memory_models.SMALL, "Q4_K")


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def quant_linears(llm: LLM) -> list[ql.QuantLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, ql.QuantLinear)]


def mapping_of(address: int) -> str:
    """The file (or '' for anonymous memory) of the mapping that holds `address` (Linux /proc)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def blocks_files(caches: Path) -> list[Path]:
    return sorted(caches.glob("*/*.blocks"))


def test_later_start_maps_the_cache_and_repacks_nothing(model, caches, monkeypatch):
    first = LLM(str(model), **ENGINE)
    want = greedy(first)
    assert any(m.r8 for m in quant_linears(first))
    del first
    [written] = blocks_files(caches)
    monkeypatch.setattr(ql, "repack8", lambda *a, **k: pytest.fail("repacked at a later start"))
    later = LLM(str(model), **ENGINE)
    assert greedy(later) == want
    places = {mapping_of(m.blocks.data_ptr()) for m in quant_linears(later)}
    assert places <= {str(written), str(model)}, places   # file-backed: the cache, or the GGUF file as stored
    assert str(written) in places


def test_cached_blocks_equal_blocks_repacked_in_memory(model, caches, monkeypatch):
    cached = LLM(str(model), **ENGINE)
    want = greedy(cached)
    blocks = [m.blocks.clone() for m in quant_linears(cached)]
    del cached
    monkeypatch.setattr(repack_cache, "prepare", lambda *a, **k: repack_cache.PreparedBlocks({}, None))
    in_memory = LLM(str(model), **ENGINE)
    assert greedy(in_memory) == want
    assert all(a.equal(m.blocks) for a, m in zip(blocks, quant_linears(in_memory), strict=True))


def test_truncated_cache_is_rebuilt_with_a_log_line(model, caches, caplog):
    want = greedy(LLM(str(model), **ENGINE))
    [path] = blocks_files(caches)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.INFO, logger="polyrunner"):
        assert greedy(LLM(str(model), **ENGINE)) == want
    assert "is unusable" in caplog.text and "writing it again" in caplog.text
    assert blocks_files(caches) == [path] and path.stat().st_size == size


def test_corrupt_blocks_are_rebuilt_not_trusted(model, caches, caplog):
    want = greedy(LLM(str(model), **ENGINE))
    [path] = blocks_files(caches)
    with open(path, "r+b") as f:   # the header: MAGIC, its length, the JSON, padded to a page
        length = int.from_bytes(f.read(16)[8:], "little")
        f.seek(-(-(16 + length) // repack_cache.ALIGN) * repack_cache.ALIGN)   # the first entry's bytes
        f.write(b"\xff" * 64)
    with caplog.at_level(logging.INFO, logger="polyrunner"):
        assert greedy(LLM(str(model), **ENGINE)) == want
    assert "do not match their checksums" in caplog.text and "writing it again" in caplog.text
    assert repack_cache._check(path, *_key_entries_size(path)) is None


def _key_entries_size(path: Path) -> tuple[str, list[repack_cache.Entry], int]:
    """The key, entries and data size a blocks file's header records."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(16)[8:], "little")
        header = json.loads(f.read(length))
    entries = [repack_cache.Entry(k, layout, tuple(shape), offset, nbytes)
               for k, layout, shape, offset, nbytes in header["entries"]]
    return header["key"], entries, header["data_bytes"]


def test_changed_gguf_file_gets_a_new_cache_and_the_old_one_goes(model, caches):
    LLM(str(model), **ENGINE)
    [old] = blocks_files(caches)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # same bytes, a new mtime: a new identity
    LLM(str(model), **ENGINE)
    [new] = blocks_files(caches)
    assert new != old and not old.exists()


def test_a_full_disk_repacks_in_memory_with_a_warning(model, caches, monkeypatch, caplog):
    want = greedy(LLM(str(model), **ENGINE))
    for path in blocks_files(caches):
        path.unlink()

    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(repack_cache, "_allocate", full)
    with caplog.at_level(logging.WARNING, logger="polyrunner"):
        llm = LLM(str(model), **ENGINE)
    assert "cannot write the repacked-blocks cache" in caplog.text and "No space left" in caplog.text
    assert greedy(llm) == want
    assert not blocks_files(caches) and not list(caches.glob("*/.*.partial"))
    assert all(mapping_of(m.blocks.data_ptr()) in ("", "[heap]", str(model)) for m in quant_linears(llm))


def test_folders_of_gguf_files_that_are_gone_are_reclaimed(model, caches, tmp_path):
    gone = caches / "gone-0123456789ab"
    gone.mkdir(parents=True)
    (gone / repack_cache.SOURCE_FILE).write_text(str(tmp_path / "deleted.gguf"))
    (gone / "x.blocks").write_bytes(b"\0" * 4096)
    unknown = caches / "no-record"
    unknown.mkdir()
    LLM(str(model), **ENGINE)
    assert not gone.exists() and unknown.exists() and len(blocks_files(caches)) == 1
