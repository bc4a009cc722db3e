"""FX passes over each compiled piece: the fusions a family gets without a model file.

vLLM builds one pass manager per compiled model (``Platform.get_pass_manager_cls``) and hands it
to the compile backend (compiler.py), which runs it over every piece Dynamo traced. A pass finds
a torch_npu operator in the piece and checks its neighbours by graph structure (who reads what),
not by the model's module names, so it holds for any family whose layers call the same
operators: upstream vllm-ascend's graph_fusion_pass_manager.py and its passes/, on Dynamo's
graph instead of the ATen one.

- ``NormQuantFusion``: a residual add + RMSNorm whose output only a W8A8_DYNAMIC linear layer
  reads, quantized per token there, becomes one ``npu_add_rms_norm_dynamic_quant`` (upstream's
  AddRMSNormDynamicQuantPattern); the W8A8 (static) twin quantizes with the layer's calibrated
  scale and offset, through ``npu_add_rms_norm_quant`` (AddRMSNormQuantPattern).

- ``QKRopeMerge``: the q and the k of one QKV split, rotated by two npu_rotary_mul calls with the
  same cos/sin, rotated in one call on the adjacent q|k columns (the Llama and Qwen2 files'
  ``split_qkv_norm_rope``).

QKV split + q/k norm + RoPE otherwise needs no pass: every family's RMSNorm and RoPE ops already
run the files' torch_npu calls (ops/layernorm.py, ops/rotary_embedding.py). What the files still
add: docs/adding_a_model.md.
"""

import operator

import torch
from torch import fx

from vllm_ascend import device
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)
STATIC_QUANTIZE = "vllm_ascend.quantize.default"  # W8A8's activation quantization (w8a8.py)


def api(node: fx.Node) -> str | None:
    return device.current.graph_api(node.target) if node.op == "call_function" else None


def getitems(node: fx.Node) -> dict[int, fx.Node] | None:
    """{index: node} of a multi-output node's users, or None if any user is not ``x[i]``."""
    items = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        items[user.args[1]] = user
    return items


def arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def sole_reader(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


class NormQuantFusion:
    """npu_add_rms_norm -> [0] -> (its only reader) the activation quantization of a W8A8 linear
    layer, into the fused norm + quantization operator."""

    name = "norm_quant_fusion"

    def __call__(self, graph: fx.Graph) -> int:
        fused = 0
        for norm in list(graph.nodes):
            if api(norm) != "npu_add_rms_norm":
                continue
            outputs = getitems(norm)
            # [1] (the inverse RMS) has no counterpart in the fused operators.
            if outputs is None or 0 not in outputs or set(outputs) - {0, 2}:
                continue
            quant = sole_reader(outputs[0])
            if quant is None:
                continue
            if api(quant) == "npu_dynamic_quant":
                fused += self._fuse_dynamic(graph, norm, outputs, quant)
            elif str(quant.target) == STATIC_QUANTIZE:
                fused += self._fuse_static(graph, norm, outputs, quant)
        return fused

    def _fuse_dynamic(self, graph, norm, outputs, quant) -> int:
        if len(quant.args) != 1 or set(quant.kwargs) - {"dst_type"} or \
                quant.kwargs.get("dst_type", torch.int8) != torch.int8:
            return 0  # smoothing scales or another output type: not the fused op's contract
        quant_outputs = getitems(quant)
        if quant_outputs is None:
            return 0
        with graph.inserting_before(norm):
            fused = graph.call_function(
                device.current.graph_op("npu_add_rms_norm_dynamic_quant"), _norm_inputs(norm),
                {"epsilon": _epsilon(norm), "output_mask": [True, False]})
        # npu_dynamic_quant's (y, scale) are the fused op's [0] and [3].
        for index, item in quant_outputs.items():
            item.args = (fused, {0: 0, 1: 3}[index])
        graph.erase_node(quant)
        _finish(graph, norm, outputs, fused)
        return 1

    def _fuse_static(self, graph, norm, outputs, quant) -> int:
        _, scale, _, offset = quant.args
        with graph.inserting_before(norm):
            fused = graph.call_function(
                device.current.graph_op("npu_add_rms_norm_quant"),
                (*_norm_inputs(norm), scale, offset), {"epsilon": _epsilon(norm)})
            quantized = graph.call_function(operator.getitem, (fused, 0))
        quant.replace_all_uses_with(quantized)
        graph.erase_node(quant)
        _finish(graph, norm, outputs, fused)
        return 1


def _norm_inputs(norm: fx.Node) -> tuple:
    return arg(norm, 0, "x1"), arg(norm, 1, "x2"), arg(norm, 2, "gamma")


def _epsilon(norm: fx.Node) -> float:
    return arg(norm, 3, "epsilon", 1e-6)


def _finish(graph: fx.Graph, norm: fx.Node, outputs: dict[int, fx.Node], fused: fx.Node) -> None:
    """The norm's sum (x + residual, [2]) is the fused op's [2]; its normed output is now read
    by no one: drop it and the norm."""
    if 2 in outputs:
        outputs[2].args = (fused, 2)
    graph.erase_node(outputs[0])
    graph.erase_node(norm)


class QKRopeMerge:
    """Two npu_rotary_mul calls with the same cos/sin, on the q and the k of one QKV split
    (heads viewed as [1, T, heads, head]), into one call on the adjacent q|k columns, split
    after: what the Llama and Qwen2 files do by hand (ops/qkv.py). The rotation is per element,
    so the values are the same."""

    name = "qk_rope_merge"

    def __call__(self, graph: fx.Graph) -> int:
        merged = 0
        rotations = [n for n in graph.nodes if api(n) == "npu_rotary_mul"]
        by_split: dict = {}
        for node in rotations:
            source = _head_view_of_split(node.args[0])
            if source is not None:
                split, index, head = source
                key = (split, node.args[1:], tuple(sorted(node.kwargs.items())), head)
                by_split.setdefault(key, {})[index] = node
        for (split, _, _, head), pair in by_split.items():
            if set(pair) >= {0, 1}:
                merged += self._merge(graph, split, head, pair[0], pair[1])
        return merged

    @staticmethod
    def _merge(graph, split, head, q_rot, k_rot) -> int:
        q_size, kv_size = _split_sizes(split)[:2]
        first = q_rot if _before(q_rot, k_rot) else k_rot
        with graph.inserting_before(first):
            qk = graph.call_function(operator.getitem, (split.args[0], (
                slice(None), slice(None, q_size + kv_size))))
            heads = graph.call_method("view", (qk, 1, -1, (q_size + kv_size) // head, head))
            rotated = graph.call_function(q_rot.target, (graph.call_method(
                "contiguous", (heads,)), *q_rot.args[1:]), dict(q_rot.kwargs))
            q = graph.call_method("contiguous", (graph.call_function(operator.getitem, (
                rotated, (slice(None), slice(None), slice(None, q_size // head)))),))
            k = graph.call_method("contiguous", (graph.call_function(operator.getitem, (
                rotated, (slice(None), slice(None), slice(q_size // head, None)))),))
        for old, new in ((q_rot, q), (k_rot, k)):
            old.replace_all_uses_with(new)
            _erase_chain(graph, old)
        return 1


def _split_sizes(split: fx.Node) -> list | None:
    sizes = arg(split, 1, "split_size", None) if split.op == "call_method" else None
    return list(sizes) if isinstance(sizes, (list, tuple)) else None


def _head_view_of_split(node) -> tuple | None:
    """(split, output index, head size) when ``node`` is ``qkv.split([q, kv, kv],
    dim=-1)[i].view(1, T, -1, head).contiguous()``, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "contiguous"):
        return None
    view = node.args[0]
    if not (isinstance(view, fx.Node) and view.op == "call_method" and view.target == "view"
            and len(view.args) == 5 and view.args[1] == 1 and isinstance(view.args[4], int)):
        return None
    item = view.args[0]
    if not (isinstance(item, fx.Node) and item.target is operator.getitem):
        return None
    split, index = item.args
    if not (isinstance(split, fx.Node) and split.op == "call_method" and split.target == "split"
            and arg(split, 2, "dim", 0) in (-1, 1)):
        return None
    sizes = _split_sizes(split)
    head = view.args[4]
    if sizes is None or len(sizes) != 3 or sizes[1] != sizes[2] or sizes[0] % head or \
            sizes[1] % head or len(node.users) != 1:
        return None
    return split, index, head


def _before(a: fx.Node, b: fx.Node) -> bool:
    for node in a.graph.nodes:
        if node is a:
            return True
        if node is b:
            return False
    return False


def _erase_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the inputs only it read, up to the split."""
    while node is not None and not node.users and node.op != "placeholder":
        inputs = [n for n in node.all_input_nodes if n.op == "call_method"
                  and n.target in ("contiguous", "view")]
        graph.erase_node(node)
        node = inputs[0] if inputs else None


class AscendPassManager:
    """vLLM's pass-manager protocol (configure, add, call) over the passes above, counting what
    each one fused."""

    def __init__(self):
        self.passes: list = []
        self.counts: dict[str, int] = {}

    @staticmethod
    def pass_names(vllm_config) -> list[str]:
        return [NormQuantFusion.name, QKRopeMerge.name]

    def configure(self, vllm_config) -> None:
        self.passes = [NormQuantFusion(), QKRopeMerge()]
        logger.info("vllm-ascend: compile backend: Ascend FX passes on each piece (%s), no code "
                    "generation", ", ".join(p.name for p in self.passes))

    def add(self, pass_) -> None:
        self.passes.append(pass_)

    def __call__(self, module: fx.GraphModule) -> fx.GraphModule:
        changed = False
        for pass_ in self.passes:
            n = pass_(module.graph)
            self.counts[pass_.name] = self.counts.get(pass_.name, 0) + n
            changed |= bool(n)
        if changed:
            module.graph.lint()
            module.recompile()
        return module
