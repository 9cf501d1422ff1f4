import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny test models are dominated by per-op overhead; one intra-op thread avoids
# OpenMP barrier stalls when the machine is shared (a 2-core CI box).
torch.set_num_threads(1)

from tiny_models import build_tiny_model  # noqa: E402

KINDS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict = {}

    def make(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[kind] = (folder, build_tiny_model(kind, folder))
        return cache[kind]

    return make
