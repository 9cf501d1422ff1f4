"""A whole device plugin: "minimal_cpu" (host CPU, power-of-two buckets, the core's reference attention). Certify:
PYTHONPATH=examples polyrunner conformance --plugin minimal_plugin --backend minimal_cpu"""

import os

import torch

from polyrunner.plugin_api import (
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    GraphExecutor,
    exponential_sizes,
    hookimpl,
    reference_paged_attention,
)

PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


class PaddedEagerExecutor(GraphExecutor):  # eager runs of padded batches; a "graph" = a padded token count
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.shapes: set[int] = set()

    def prepare(self, run_dummy, buckets: BucketPolicy) -> None:
        for tokens in buckets.token_buckets:  # start-up: run every token bucket once
            run_dummy(tokens, min(tokens, buckets.request_buckets[-1]))

    def run(self, inputs) -> torch.Tensor:
        self.shapes.add(int(inputs.input_ids.shape[0]))
        return super().run(inputs)

    def num_graphs(self) -> int:
        return len(self.shapes)


class MinimalCPUBackend(Backend):
    name = "minimal_cpu"
    priority = -100  # chosen only by name
    capabilities = Capabilities(graph_mode="eager", static_shapes=True, counts_graphs=True)

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "", "host cpu")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def bucket_policy(self) -> BucketPolicy:  # self.config: the engine's configuration
        s = self.config.scheduler
        return BucketPolicy(exponential_sizes(1, s.max_num_batched_tokens), exponential_sizes(1, s.max_num_seqs))

    def attention(self, q, k, v, kv_cache, meta, spec) -> torch.Tensor:
        return reference_paged_attention(q, k, v, kv_cache, meta, spec)

    def make_executor(self, model) -> GraphExecutor:
        return PaddedEagerExecutor(model)

    def memory_info(self) -> tuple[int, int]:  # (free, total) bytes of the memory the KV cache lives in
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [MinimalCPUBackend]
