"""Device-neutral sampling: persistent per-row state, per-step metadata, the sampler.

The InputBatch mirrors its row changes into a `SamplingState`; each step
`SamplingState.make_metadata(...)` gives a `SamplingMetadata` and
`Sampler()(logits, metadata)` gives a `SamplerOutput`.
"""

from polyrunner.sample.logprobs import (
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
