"""polyrunner: a multi-backend LLM runner with one device-neutral core.

    from polyrunner import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder-or.gguf", backend="cpu")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from polyrunner.outputs import CompletionOutput, Logprob, RequestOutput
from polyrunner.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import polyrunner` stays light for plugins and the CLI's `backends` table.
    if name == "LLM":
        from polyrunner.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from polyrunner.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "LLMEngine":
        from polyrunner.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'polyrunner' has no attribute {name!r}")
