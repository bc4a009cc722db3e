"""``vllm-ascend plan <model> [vllm serve arguments]``: what each rank of that server would hold
(vllm_ascend/plan.py), from the config alone, without starting an engine or loading a weight.

The arguments are `vllm serve`'s, parsed by vLLM's own parser; the config is built as `vllm
serve` builds it (the platform's graph mode, capture sizes and start-up checks included). The
device's memory is asked of the device backend (on a chip: device 0's properties, which open a
context on it), or given with ``--device-memory-gib``. Exit status 1 when the plan cannot start,
with the reasons and fixes printed.
"""

import sys

from vllm_ascend.plan import GiB

USAGE = "vllm-ascend plan [model_tag] [vllm serve options] [--device-memory-gib N]"


def plan_main(argv: list[str]) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_ascend import device, plan

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-ascend plan", usage=USAGE))
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="the device's memory (default: asked of the device backend)")
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)
    backend = device.current
    total = int(args.device_memory_gib * GiB) if args.device_memory_gib else \
        backend.device_memory_for_plan()
    parallel = config.parallel_config
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    print(f"vllm-ascend plan for {config.model_config.model} on {backend.name}: "
          f"{parallel.data_parallel_size} data-parallel engine(s) of {ranks} rank(s) each "
          "(the figures are one rank's; weights those of the fullest pipeline stage)")
    startup = plan.startup_plan(config, backend, total)
    for line in startup.lines():
        print(f"  {line}")
    problems = startup.problems()
    for problem in problems:
        print(f"  cannot start: {problem}")
    return 1 if problems else 0


def main(argv: "list[str] | None" = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "plan":
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    return plan_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
