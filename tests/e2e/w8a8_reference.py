"""The fp32 reference for a ModelSlim W8A8 checkpoint: HF transformers' model with each quantized
layer's weights dequantized (int8 x scale) and its input quantized as the checkpoint says, then
dequantized (per token for W8A8_DYNAMIC; with the calibrated scale and offset for W8A8, whose
float bias is read back from quant_bias). W8A8_DYNAMIC experts (one checkpoint tensor per
expert and projection) become HF's fused expert tensors, dequantized, and each expert's input to
each projection is quantized per token, then dequantized, as the engine does. Read from the
checkpoint's own files, not from the plugin."""

import json
import pathlib
import re
import types

import torch

EXPERT = r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"


def _fake_quant_per_token(x):
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-128, 127) * scale


def _fake_quant_static(scale, offset):
    def quant(x):
        return (torch.round(x / scale + offset).clamp(-128, 127) - offset) * scale
    return quant


def _quantized_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """HF's experts (transformers' loop over the hit experts) with each projection's input
    quantized per token, then dequantized: W8A8_DYNAMIC experts."""
    out = torch.zeros_like(hidden_states)
    for e in top_k_index.unique().tolist():
        token, position = torch.where(top_k_index == e)
        gate, up = torch.nn.functional.linear(_fake_quant_per_token(hidden_states[token]),
                                              self.gate_up_proj[e]).chunk(2, dim=-1)
        down = torch.nn.functional.linear(_fake_quant_per_token(self.act_fn(gate) * up),
                                          self.down_proj[e])
        out.index_add_(0, token, down * top_k_weights[token, position, None])
    return out


def _deq_scale(t):
    return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32) if t.dtype == torch.int64 \
        else t.float()


def load(path: str):
    import safetensors.torch
    import transformers

    root = pathlib.Path(path)
    description = json.loads((root / "quant_model_description.json").read_text())
    tensors = {}
    for f in root.glob("*.safetensors"):
        tensors.update(safetensors.torch.load_file(str(f)))
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state, hooks, experts = {}, {}, {}
    for name, t in tensors.items():
        numbered = re.match(r"model\.layers\.(\d+)\.", name)
        if numbered and int(numbered.group(1)) >= config.num_hidden_layers:
            continue  # DeepSeek's MTP layers, which HF's model does not have
        module, suffix = name.rsplit(".", 1)
        expert = re.match(EXPERT, name)
        if expert and description[name] == "W8A8_DYNAMIC":
            layer, e, proj = expert.groups()
            experts.setdefault(layer, {})[int(e), proj] = (
                t.float() * tensors[f"{module}.weight_scale"].float())
            continue
        if re.match(EXPERT.replace(r"\.weight$", r"\.weight_(scale|offset)$"), name):
            continue
        quant_type = description.get(f"{module}.weight", description[name])
        if quant_type == "FLOAT" or (suffix == "bias" and quant_type == "W8A8_DYNAMIC"):
            state[name] = t.float()
        elif suffix == "weight" and quant_type == "W8A8_DYNAMIC":
            state[name] = t.float() * tensors[f"{module}.weight_scale"].float()
            hooks[module] = _fake_quant_per_token
        elif suffix == "weight":  # W8A8
            in_scale = tensors[f"{module}.input_scale"].float()
            in_offset = tensors[f"{module}.input_offset"].float()
            deq = _deq_scale(tensors[f"{module}.deq_scale"])
            state[name] = t.float() * (deq / in_scale).unsqueeze(1)
            hooks[module] = _fake_quant_static(in_scale, in_offset)
            if f"{module}.bias" in model.state_dict():
                state[f"{module}.bias"] = (tensors[f"{module}.quant_bias"].float()
                                           + in_offset * t.float().sum(1)) * deq
    for layer, weights in experts.items():
        count = 1 + max(e for e, _ in weights)
        state[f"{layer}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[e, "gate"], weights[e, "up"]]) for e in range(count)])
        state[f"{layer}.down_proj"] = torch.stack([weights[e, "down"] for e in range(count)])
    model.load_state_dict(state, strict=True)
    for layer in experts:
        module = model.get_submodule(layer)
        module.forward = types.MethodType(_quantized_experts_forward, module)
    for module, quant in hooks.items():
        model.get_submodule(module).register_forward_pre_hook(
            lambda m, args, quant=quant: (quant(args[0]),))
    return model
