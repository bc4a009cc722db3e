"""The Ascend compile backend: vLLM's pieces run as traced, after this platform's FX passes.

There is no Inductor code generation on Ascend (and the simulator's graphs record dispatcher
ops, which generated kernels would bypass). vLLM's eager backend returns each piece untouched;
this one first runs the platform's pass manager over it (compilation/passes.py), as upstream
vllm-ascend's ``AscendCompiler`` (compilation/compiler_interface.py) does on the ATen graph. The
passes here rewrite Dynamo's graph directly: every pattern is anchored on a torch_npu operator,
so no AOT-autograd trace (seconds per engine on a CPU) is needed to find them.
"""

import hashlib
from collections.abc import Callable
from typing import Any

from torch import fx
from vllm.compilation.compiler_interface import CompilerInterface


class AscendCompiler(CompilerInterface):
    name = "ascend"

    def compute_hash(self, vllm_config) -> str:
        from vllm_ascend.compilation.passes import AscendPassManager

        return hashlib.sha256(" ".join(AscendPassManager.pass_names(vllm_config)).encode(),
                              usedforsecurity=False).hexdigest()[:10]

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compiler_config: dict[str, Any], compile_range, key: str | None = None
                ) -> tuple[Callable[..., Any] | None, Any | None]:
        from vllm.platforms import current_platform

        passes = compiler_config.get(current_platform.pass_key)
        if passes is not None:
            passes(graph)
        return graph, None  # nothing to cache: a piece is its graph
