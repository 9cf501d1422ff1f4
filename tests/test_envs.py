"""Environment variables: one registry (`polyrunner.envs`), parsed strictly, read only through it,
and the README's table generated from it."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from polyrunner import envs
from polyrunner.envs import EnvVar
from polyrunner.tools import env_table

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("core", "backends") for p in sorted((ROOT / d).rglob("*"))
           if p.suffix in (".py", ".cpp", ".h", ".md") and p.is_file()]
NAME = re.compile(r"POLYRUNNER_[A-Z0-9_]*[A-Z0-9]")
DIRECT_READ = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']POLYRUNNER_""")


def _var(type_, default=None, **kw) -> EnvVar:
    return EnvVar("POLYRUNNER_TEST_VAR", type_, default, "a test variable", **kw)


def test_readme_table_is_generated_from_the_registry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert env_table.readme_table(readme) == env_table.markdown(), \
        "README.md's table is out of date: python -m polyrunner.tools.env_table --write README.md"


def test_every_variable_in_the_source_is_declared():
    env_table.load_envs_modules()
    known = {v.name for v in envs.declared()}
    used = {(name, str(p.relative_to(ROOT))) for p in SOURCES for name in NAME.findall(p.read_text("utf-8"))}
    undeclared = sorted(f"{name} ({path})" for name, path in used if name not in known)
    assert not undeclared, f"declare these in polyrunner.envs or backends/<name>/envs.py: {undeclared}"
    assert len({name for name, _ in used}) >= 25   # the scan sees the source (27 variables when written)


def test_no_module_reads_a_variable_directly():
    direct = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.suffix == ".py"
              for i, line in enumerate(p.read_text("utf-8").splitlines(), 1) if DIRECT_READ.search(line)]
    assert not direct, f"read these through their declaration (VAR.get()): {direct}"


def test_table_lists_every_section_without_importing_torch():
    code = ("import sys; from polyrunner.tools import env_table; t = env_table.markdown(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for title in ("Core (every backend)", "Backend `cpu`", "Backend `xla`", "Backend `cuda`", "`polyrunner serve`"):
        assert f"**{title}**" in out.stdout
    assert "| `POLYRUNNER_CPU_THREADS` | `auto` \\| int ≥ 1 | `auto` |" in out.stdout


def test_check_and_write(tmp_path, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{env_table.BEGIN}\nSTALE-TABLE\n{env_table.END}\nrest\n", encoding="utf-8")
    assert env_table.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert env_table.main(["--write", str(stale)]) == 0
    text = stale.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("\nrest\n") and "STALE-TABLE" not in text
    assert env_table.main(["--check", str(stale)]) == 0
    with pytest.raises(ValueError, match="no environment variable table"):
        env_table.readme_table("no markers")


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                        ("0", False), ("False", False), ("no", False), ("off", False)])
def test_bool_forms(monkeypatch, raw, value):
    monkeypatch.setenv("POLYRUNNER_TEST_VAR", raw)
    assert _var(bool, not value).get() is value


def test_unset_or_empty_gives_the_default(monkeypatch):
    monkeypatch.delenv("POLYRUNNER_TEST_VAR", raising=False)
    assert _var(bool, True).get() is True and _var(int, None).get() is None
    monkeypatch.setenv("POLYRUNNER_TEST_VAR", "")
    assert _var(int, 7, ge=1).get() == 7 and not _var(int, 7).is_set()


@pytest.mark.parametrize("var, raw, message", [
    (_var(bool, True), "2", "must be 1 or 0 (true/false, yes/no, on/off), got '2'"),
    (_var(int, 0, ge=0), "-1", "must be an integer >= 0, got '-1'"),
    (_var(int, 0), "1.5", "must be an integer, got '1.5'"),
    (_var(float, 1.0, gt=0), "0", "must be a number > 0, got '0'"),
    (_var(float, 1.0), "ten", "must be a number, got 'ten'"),
    (_var(int, "auto", choices=("auto",), ge=1), "0", "must be 'auto' or an integer >= 1, got '0'"),
    (_var(str, "a", choices=("a", "b")), "c", "must be one of a, b, got 'c'"),
    (_var(list, None), "8,x", "must be a comma-separated list of integers, got '8,x'"),
    (_var(list, None), ",", "must be a comma-separated list of integers, got ','"),
])
def test_bad_values_name_the_variable(monkeypatch, var, raw, message):
    monkeypatch.setenv("POLYRUNNER_TEST_VAR", raw)
    with pytest.raises(ValueError, match=re.escape(f"POLYRUNNER_TEST_VAR {message}")):
        var.get()


def test_typed_values(monkeypatch):
    for var, raw, value in [(_var(int, "auto", choices=("auto",), ge=1), "AUTO", "auto"),
                            (_var(int, "auto", choices=("auto",), ge=1), "3", 3),
                            (_var(float, 1.0, gt=0), "2.5", 2.5),
                            (_var(str, None, choices=("avx2", "scalar")), "AVX2", "avx2"),
                            (_var(str, None), " /a path ", " /a path "),
                            (_var(list, None), "64, 256,128", [64, 256, 128])]:
        monkeypatch.setenv("POLYRUNNER_TEST_VAR", raw)
        assert var.get() == value


def test_declare_is_idempotent_and_checked():
    a = envs.declare("POLYRUNNER_TEST_DECLARED", int, 1, "x", section="test")
    assert envs.declare("POLYRUNNER_TEST_DECLARED", int, 1, "x", section="test") == a
    with pytest.raises(ValueError, match="declared twice"):
        envs.declare("POLYRUNNER_TEST_DECLARED", int, 2, "x", section="test")
    with pytest.raises(TypeError, match="type must be one of"):
        envs.declare("POLYRUNNER_TEST_BAD_TYPE", dict, None, "x")
    envs._REGISTRY.pop("POLYRUNNER_TEST_DECLARED")


def test_read_sites_follow_the_environment(monkeypatch):
    """A few converted read sites keep their variable's semantics (defaults, "0", tri-states)."""
    from polyrunner.backends.xla import buckets
    from polyrunner.config import EngineConfig, ModelConfig, SchedulerConfig
    monkeypatch.setenv("POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S", "2.5")
    assert SchedulerConfig().grammar_compile_timeout_s == 2.5
    monkeypatch.setenv("POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S must be a number > 0"):
        SchedulerConfig()
    monkeypatch.delenv("POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S")
    assert SchedulerConfig().grammar_compile_timeout_s == 10.0
    cfg = EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256))
    monkeypatch.setenv("POLYRUNNER_XLA_TOKEN_BUCKETS", "256, 64")
    assert buckets.xla_bucket_policy(cfg).token_buckets == [64, 256]
    monkeypatch.setenv("POLYRUNNER_XLA_TOKEN_BUCKETS", "")
    monkeypatch.setenv("POLYRUNNER_XLA_MIN_TOKENS", "x")
    with pytest.raises(ValueError, match="POLYRUNNER_XLA_MIN_TOKENS must be an integer >= 1"):
        buckets.xla_bucket_policy(cfg)


def test_cpu_kernel_compile_talks(monkeypatch, tmp_path, caplog):
    """A compile logs at INFO before (flags, folder) and after (time); a cache hit only at DEBUG.
    A stand-in compiler writes the object files and the library (no real build)."""
    from polyrunner.backends.cpu import kernels
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.DEBUG, logger="polyrunner.backends.cpu.kernels"):
        target = kernels._build(str(fake), kernels.FLAGS)
        first = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        assert kernels._build(str(fake), kernels.FLAGS) == target
        second = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert target.is_file() and target.parent == tmp_path / "cache" / "cpu_kernels"
    assert [level for level, _ in first] == [logging.INFO, logging.INFO]
    assert "compiling CPU kernels (-O3 -march=native" in first[0][1] and str(target.parent) in first[0][1]
    assert "first run only" in first[0][1]
    assert re.match(r"compiled CPU kernels in \d+\.\d s", first[1][1])
    assert [level for level, _ in second] == [logging.DEBUG]


def test_cpu_kernel_compile_error_names_the_compiler(monkeypatch, tmp_path):
    from polyrunner.backends.cpu import kernels
    bad = tmp_path / "bad-c++"
    bad.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "boom: no such flag" >&2\nexit 1\n')
    bad.chmod(0o755)
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="bad-c\\+\\+ failed: boom: no such flag"):
        kernels._build(str(bad), kernels.FLAGS)
    assert not list((tmp_path / "cache" / "cpu_kernels").glob("*.so"))
