"""The command line: `generate` on the embedded model, and the `backends` table."""

import subprocess
import sys

import pytest

from polyrunner.tools.cli import main


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrunner.tools.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_default_model_names_paris():
    pytest.importorskip("gguf")
    proc = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]   # the table; fix hints may follow a blank line
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert rows["cpu"].split()[1] == "yes"
    for name in ("cuda", "xla", "npu"):
        assert rows[name].split()[1] == "no", rows[name]
        assert len(rows[name].split()) > 4  # a reason is given


def test_generate_reports_bad_model_cleanly(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_chat_one_shot_message():
    pytest.importorskip("gguf")
    proc = run_cli("chat", "--message", "What is the capital of France? Answer in one word.",
                   "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_applies_the_model_template():
    from polyrunner import LLM, SamplingParams
    llm = LLM(max_model_len=512, max_num_seqs=2)
    messages = [{"role": "user", "content": "Hi"}]
    text = llm.tokenizer.apply_chat_template(messages)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------- vLLM's command line

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import polyrunner  # noqa: E402
from polyrunner.tools.cli import build_parser  # noqa: E402
from polyrunner.tools.engine_args import ENGINE_ARGS, engine_kwargs, load_chat_template  # noqa: E402


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subparser under `parser`, by its path ('serve', 'x y' for nested ones)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in _subcommands(sub).items()})
    return found


def test_every_option_of_every_subcommand_has_help():
    parser = build_parser()
    subs = _subcommands(parser)
    assert {"generate", "chat", "backends", "serve", "bench", "conformance"} <= set(subs)
    missing = [f"{path or 'polyrunner'}: {'/'.join(a.option_strings) or a.dest}"
               for path, p in [("", parser), *subs.items()] for a in p._actions
               if not isinstance(a, argparse._SubParsersAction)
               and (not a.help or a.help == argparse.SUPPRESS or not a.help.strip())]
    assert not missing, "options without help text: " + ", ".join(missing)


def test_every_subcommand_has_log_level_and_help_shows_defaults():
    subs = _subcommands(build_parser())
    for name, p in subs.items():
        (action,) = [a for a in p._actions if "--log-level" in a.option_strings]
        assert action.choices == ["critical", "error", "warning", "info", "debug"], name
    help_text = subs["generate"].format_help()
    assert "(default: 0.9)" in help_text and "(default: 64)" in help_text   # --gpu-memory-utilization, --max-tokens


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"polyrunner {polyrunner.__version__}\n"


def test_vllm_flags_become_llm_arguments():
    args = build_parser().parse_args(
        ["serve", "./my-model", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--block-size", "32",
         "--quantization", "gguf", "--tokenizer", "./tok", "--max-model-len", "128", "--dtype", "float32",
         "--seed", "7", "--trust-remote-code"])
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == "./my-model"
    assert (kwargs["gpu_memory_utilization"], kwargs["enable_prefix_caching"], kwargs["block_size"]) == (0.5, False, 32)
    assert (kwargs["quantization"], kwargs["tokenizer"], kwargs["max_model_len"]) == ("gguf", "./tok", 128)
    assert (kwargs["dtype"], kwargs["seed"]) == ("float32", 7)
    assert kwargs["trust_remote_code"] is True   # LLM accepts it and logs that it is not needed
    defaults = engine_kwargs(build_parser().parse_args(["generate"]))
    llm_params = inspect.signature(polyrunner.LLM.__init__).parameters
    for name, value in defaults.items():   # one definition: every option is an LLM argument, with LLM's default
        assert name in llm_params, name
        if llm_params[name].default is not inspect.Parameter.empty:
            assert value == llm_params[name].default, name


def test_bench_takes_the_shared_engine_options():
    args = build_parser().parse_args(["bench", "m.gguf", "--dtype", "bfloat16", "--enforce-eager"])
    assert engine_kwargs(args) == {"model": "m.gguf", "dtype": "bfloat16", "quantization": None,
                                   "enforce_eager": True}
    assert set(ENGINE_ARGS) >= {"dtype", "quantization", "enforce_eager"}


def test_model_positional_or_option_but_not_two_different(capsys):
    assert engine_kwargs(build_parser().parse_args(["generate", "--model", "a"]))["model"] == "a"
    assert engine_kwargs(build_parser().parse_args(["chat", "a", "--model", "a"]))["model"] == "a"
    assert main(["generate", "./a", "--model", "./b", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "'./a'" in err and "'./b'" in err and "given twice" in err


def test_log_level_flag_and_environment(monkeypatch):
    logger = logging.getLogger("polyrunner")
    assert main(["backends", "--log-level", "debug"]) == 0
    assert logger.level == logging.DEBUG
    monkeypatch.setenv("POLYRUNNER_LOGGING_LEVEL", "warning")
    assert main(["backends"]) == 0
    assert logger.level == logging.WARNING
    monkeypatch.setenv("POLYRUNNER_LOGGING_LEVEL", "loud")
    assert main(["backends"]) == 2


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}\\n{% endfor %}") == \
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="looks like a file path, but it failed to be opened"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def _word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer.json with `vocab_size` entries: '[', ']', 'hi', then t3.."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[": 0, "]": 1, "hi": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_serve_positional_model_with_vllm_flags(tiny_model_factory, tmp_path):
    """Done-means: `polyrunner serve MODEL_DIR --gpu-memory-utilization 0.5 --no-enable-prefix-caching
    --block-size 32` starts and answers; --tokenizer and --chat-template reach the chat endpoint."""
    import httpx

    from processes import serve_process
    folder, hf = tiny_model_factory("llama")
    tok = _word_tokenizer(tmp_path / "tok", hf.config.vocab_size)
    template = "{% for m in messages %}[ {{ m.content }} ]{% endfor %}"
    with serve_process(str(folder), "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
                       "--block-size", "32", "--max-model-len", "128", "--max-num-seqs", "2",
                       "--tokenizer", str(tok), "--chat-template", template, "--trust-remote-code",
                       "--log-level", "info") as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == folder.name and body["usage"]["completion_tokens"] == 4
        r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [0, 2, 1]   # "[ hi ]" rendered by --chat-template, words of --tokenizer
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = proc.stdout.read()
    assert "trust_remote_code=True is not needed" in log, log


def test_chat_uses_chat_template_and_tokenizer(tiny_model_factory, tmp_path, capsys):
    folder, hf = tiny_model_factory("llama")
    tok = _word_tokenizer(tmp_path / "tok", hf.config.vocab_size)
    base = ["chat", str(folder), "--tokenizer", str(tok), "--max-model-len", "64", "--message", "hi",
            "--max-tokens", "2"]
    assert main([*base, "--chat-template", "{{ raise_exception('from the CLI template') }}"]) == 2
    assert "the chat template cannot render these messages: from the CLI template" in capsys.readouterr().err
    assert main([*base, "--chat-template", "{% for m in messages %}[ {{ m.content }} ]{% endfor %}"]) == 0
    assert len(capsys.readouterr().out.split()) == 2   # two words of --tokenizer's vocabulary


# --------------------------------------------------------------- Hugging Face names

def _fake_hub_cache(root: Path, folder: Path, repo: str = "org/tiny", commit: str = "0123abcd" * 5) -> Path:
    """`folder`'s files laid out as huggingface_hub's cache holds repo `repo` (refs/main -> commit)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_hugging_face_name_resolves_from_the_local_cache(tiny_model_factory, tmp_path):
    pytest.importorskip("huggingface_hub")
    folder, _ = tiny_model_factory("llama")
    snapshot = _fake_hub_cache(tmp_path / "hub", folder)
    code = """if True:
        import json
        from polyrunner import LLM, SamplingParams
        from polyrunner.models.source import resolve_model_folder
        out = LLM("org/tiny", max_model_len=64, max_num_seqs=1).generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        print(json.dumps({"folder": str(resolve_model_folder("org/tiny")), "n": len(out.outputs[0].token_ids)}))
    """
    proc = _run_python(code, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"folder": str(snapshot), "n": 3}


def test_hugging_face_name_missing_offline_is_a_clear_error(tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "polyrunner", "generate", "org/not-there", "--prompt", "x"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "'org/not-there'" in err and str(cache) in err and "HF_HUB_OFFLINE" in err, err


def test_hugging_face_name_without_huggingface_hub(monkeypatch):
    from polyrunner.models.hub import is_hub_name, resolve_hub_model
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # import fails, as when it is not installed
    with pytest.raises(FileNotFoundError, match="'org/name'.*huggingface_hub is not installed"):
        resolve_hub_model("org/name")
    assert is_hub_name("org/name") and is_hub_name("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_hub_name("./org/name") and not is_hub_name("/abs/path") and not is_hub_name("name")
    assert not is_hub_name("org/model.gguf") and not is_hub_name("a/b/c")
