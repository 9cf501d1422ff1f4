"""Environment variables of the XLA backend.

Declared through `polyrunner.envs`, which imports no torch; listed in the README.
"""

from __future__ import annotations

from polyrunner.envs import declare

_S = "xla"

TOKEN_BUCKETS = declare("POLYRUNNER_XLA_TOKEN_BUCKETS", list, None,
                        "explicit token buckets, e.g. 16,32,64 (the last must be >= max_num_batched_tokens); "
                        "`RunnerConfig.token_buckets` wins", section=_S)
REQUEST_BUCKETS = declare("POLYRUNNER_XLA_REQUEST_BUCKETS", list, None,
                          "explicit request buckets, e.g. 8,16; `RunnerConfig.request_buckets` wins", section=_S)
MIN_TOKENS = declare("POLYRUNNER_XLA_MIN_TOKENS", int, 16,
                     "smallest generated token bucket (a power of two)", ge=1, section=_S)
BUCKET_GAP = declare("POLYRUNNER_XLA_BUCKET_GAP", int, 0,
                     "generated token buckets: 0 doubles up to max_num_batched_tokens; N > 0 doubles up to N, "
                     "then grows by N", ge=0, section=_S)
STRICT = declare("POLYRUNNER_XLA_STRICT", bool, False,
                 "any compilation after warm-up raises RecompilationError (as "
                 "`RunnerConfig.strict_no_recompile`)", section=_S)
MAX_LOGPROBS = declare("POLYRUNNER_XLA_MAX_LOGPROBS", int, 20,
                       "K of the logprob graph; requests asking more are served on the host (read at import)",
                       ge=0, section=_S)
STOP_WIDTH = declare("POLYRUNNER_XLA_STOP_WIDTH", int, 8,
                     "stop ids per row for min_tokens in the graph; more are served on the host (read at import)",
                     ge=0, section=_S)
CPU_KV_BYTES = declare("POLYRUNNER_XLA_CPU_KV_BYTES", int, 1 << 30,
                       "KV cache budget cap in bytes on the CPU PJRT device when kv_cache_memory_bytes is unset",
                       ge=0, section=_S)
PALLAS = declare("POLYRUNNER_XLA_PALLAS", bool, True,
                 "on a TPU, 0 uses the static-shape torch attention instead of Pallas", section=_S)
CACHE_DIR = declare("POLYRUNNER_XLA_CACHE_DIR", str, None,
                    "persistent XLA compilation cache folder (torch_xla's `initialize_cache`); unset: "
                    "`<POLYRUNNER_CACHE>/xla-compile` on a TPU, none on the CPU PJRT device (torch_xla 2.9 "
                    "cannot load its serialized executables there); `off`: none", section=_S)
DYNAMO = declare("POLYRUNNER_XLA_DYNAMO", bool, True,
                 "compile the forward once per bucket with torch.compile (openxla backend); 0 re-traces the "
                 "model lazily every step", section=_S)
PAD_HEAD = declare("POLYRUNNER_XLA_PAD_HEAD", bool, False,
                   "1 pads the head size to a multiple of 128 at the attention op on the CPU XLA device too "
                   "(always done for Pallas on a TPU)", section=_S)
MIN_CONTEXT = declare("POLYRUNNER_XLA_MIN_CONTEXT", int, 1024,
                      "static-shape attention: smallest context bucket in tokens (buckets double up to "
                      "max_model_len; each is a backbone graph per token bucket)", ge=1, section=_S)
STATIC_GATHER_BYTES = declare("POLYRUNNER_XLA_STATIC_GATHER_BYTES", int, 1 << 30,
                              "on a real device, the largest per-layer gather the static-shape attention may "
                              "compile; above it the engine refuses (use Pallas)", ge=0, section=_S)
