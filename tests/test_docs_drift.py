"""The docs cannot drift from the code: every public member of the plugin contract appears in
docs/plugins.md, every path and `polyrunner.*` name the docs cite exists, and the start-up order
docs/plugins.md gives is the order the core calls a backend in."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

import polyrunner.plugin_api as api
from polyrunner.device.backend import Availability, Backend, Capabilities, GraphExecutor, HostFuture, ModelInputs
from polyrunner.plugins import hookimpl, hookspecs, register
from polyrunner.plugins.manager import unregister

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
DOCS = [GUIDE, ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
        ROOT / "examples" / "custom_device_plugin" / "README.md"]
TOP = ("core/", "backends/", "tests/", "examples/", "docs/", "benchmarks/", ".ci/")
SOURCE = (".py", ".cpp", ".h", ".md", ".toml", ".sh", ".yaml")
JUNIT_NAMES = "polyrunner.conformance."   # JUnit class names of the conformance suite, not modules


def _mentioned(name: str, text: str) -> bool:
    return re.search(r"`[^`\n]*\b" + re.escape(name) + r"\b", text) is not None


def test_every_public_member_of_the_contract_is_documented() -> None:
    text = GUIDE.read_text()
    members = [f"{cls.__name__}.{n}" for cls in (Backend, GraphExecutor, HostFuture)
               for n in dir(cls) if not n.startswith("_")]
    members += [f"{cls.__name__}.{f.name}" for cls in (Capabilities, Availability, ModelInputs)
                for f in dataclasses.fields(cls)]
    members += [n for n in dir(hookspecs) if n.startswith("polyrunner_")] + list(api.__all__)
    missing = [m for m in members if not _mentioned(m.rpartition(".")[2], text)]
    assert not missing, f"docs/plugins.md does not mention {missing}"


def _cited(doc: Path) -> list[str]:
    """Backticked repository paths and bare source file names in `doc`, and its relative links."""
    text = doc.read_text()
    cited = []
    for token in re.findall(r"`([^`\n]+)`", text):
        word = re.sub(r":\d+(-\d+)?$", "", token.split()[0] if token.strip() else "").rstrip(",.;")
        if "{" in word or "*" in word or "<" in word:
            continue
        if word.startswith(TOP) or (re.fullmatch(r"[\w.-]+", word) and word.endswith(SOURCE)
                                    and not word.startswith("polyrunner.")):
            cited.append(word)
        elif re.fullmatch(r"polyrunner(\.\w+)+", word) and not word.startswith(JUNIT_NAMES):
            cited.append(word)
    cited += [link for link in re.findall(r"\]\(([^)#\s]+)", text) if not link.startswith(("http", "mailto:"))]
    return cited


def _resolves(name: str) -> bool:
    """A module, or an attribute of one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_name_the_docs_cite_exists(doc: Path) -> None:
    files = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = []
    for cited in _cited(doc):
        if cited.startswith("polyrunner."):
            ok = _resolves(cited)
        elif "/" in cited or cited.startswith("."):
            target = (ROOT / cited if cited.startswith(TOP) else doc.parent / cited).resolve()
            ok = target.exists() and (target == ROOT or ROOT in target.parents)   # inside the repository
        else:
            ok = cited in files
        if not ok:
            missing.append(cited)
    assert not missing, f"{doc.relative_to(ROOT)} cites what does not exist (or lies outside the repository): {missing}"


STARTUP = ("resolve_dtype", "check_dtype", "op_overrides", "make_executor", "bucket_policy", "make_generator",
           "kv_cache_budget", "allocate_kv_cache", "num_kv_blocks", "prepare")


def test_the_documented_start_up_order_is_the_order_of_the_calls(tiny_model_factory) -> None:
    from polyrunner import LLM
    from polyrunner.backends.cpu.plugin import CPUBackend
    calls: list[str] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    class RecordingBackend(CPUBackend):
        name = "test-docs-order"

        def make_executor(self, model):
            calls.append("make_executor")
            executor = super().make_executor(model)
            executor.prepare = recorded("prepare", executor.prepare)
            return executor

    for method in set(STARTUP) - {"make_executor", "prepare"}:
        setattr(RecordingBackend, method, recorded(method, getattr(CPUBackend, method)))

    class Plugin:
        PLUGIN_API_VERSION = api.PLUGIN_API_VERSION

        @hookimpl
        def polyrunner_backends(self):
            return [RecordingBackend]

    register(Plugin(), name="test-docs-order")
    try:
        folder, _ = tiny_model_factory("llama")
        LLM(str(folder), backend="test-docs-order", dtype="auto", max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=64)
    finally:
        unregister("test-docs-order")
    first_calls = list(dict.fromkeys(calls))
    section = GUIDE.read_text().split("## When the core calls a backend")[1].split("Each step:")[0]
    documented = [m for m in dict.fromkeys(re.findall(r"`(?:executor\.)?(\w+)\(", section)) if m in STARTUP]
    assert documented == first_calls, (
        f"docs/plugins.md gives the start-up order {documented}; the core calls {first_calls}")
