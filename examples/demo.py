"""The first-run demo: a few prompts on the embedded SmolLM2-135M-Instruct.

    python examples/demo.py
"""

import time

from polyrunner import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "What is 12 times 12?",
]


def main() -> None:
    start = time.perf_counter()
    llm = LLM()  # embedded default model on the best available backend
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=48)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[1:]]
    outs = llm.generate(PROMPTS[:1], params) + llm.chat(chats, params, use_tqdm=True)
    elapsed = time.perf_counter() - loaded
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    print(f"\n{len(outs)} prompts, {tokens} tokens in {elapsed:.2f} s "
          f"({tokens / elapsed:.1f} tokens/s); model load {loaded - start:.2f} s; "
          f"backend {llm.engine.backend.name}")


if __name__ == "__main__":
    main()
