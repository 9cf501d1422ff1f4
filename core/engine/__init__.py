"""The engine side: requests, scheduling, the KV block pool, tokenization and
output processing. `LLMEngine` (in `llm_engine`) steps it all."""
