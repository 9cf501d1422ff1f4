"""Device-neutral sampling: persistent per-row state, per-step metadata, the sampler.

A `SamplingState` holds one row per request slot; each step
`SamplingState.make_metadata(idx_mapping, ...)` gathers the step's rows into a
`SamplingMetadata`, and `Sampler()(logits, metadata)` gives a `SamplerOutput`
(a static-shape backend may sample with its own function instead).
"""

from polyrunner.sample.logprobs import (
    LogprobsFuture,
    LogprobsLists,
    LogprobsTensors,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
)
from polyrunner.sample.metadata import SamplingMetadata
from polyrunner.sample.ops import apply_min_p, apply_top_k_top_p, random_sample
from polyrunner.sample.sampler import Sampler, SamplerOutput, apply_logits_processors, sample
from polyrunner.sample.state import SamplingState

__all__ = [
    "LogprobsFuture",
    "LogprobsLists",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "apply_logits_processors",
    "apply_min_p",
    "apply_top_k_top_p",
    "compute_logprobs",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "random_sample",
    "sample",
]
