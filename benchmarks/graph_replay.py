"""Replay of a simulated ACL graph vs eager execution of the same callable, side by side.

    source scripts/env.sh && python benchmarks/graph_replay.py

The callable is a stack of small decoder-like layers (norm, projections, SwiGLU, residual) as
nn.Modules, at decode-like token counts: the regime where launching one graph instead of many
ops pays.
"""

import time

import torch

from vllm_ascend.device.sim import npu


class Layer(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + self.o(q * k.sigmoid() + v)
        g, u = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(g) * u)


def bench(fn, n):
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main():
    print(f"{'hidden':>6} {'layers':>6} {'tokens':>6} {'eager us':>9} {'replay us':>9} {'speed-up':>8}")
    with torch.inference_mode():
        for hidden, layers, tokens in [(64, 30, 1), (64, 30, 8), (256, 8, 1), (576, 30, 1)]:
            model = torch.nn.Sequential(*[Layer(hidden) for _ in range(layers)]).eval()
            x = torch.randn(tokens, hidden)
            graph = npu.NPUGraph()
            with npu.graph(graph):
                out = model(x)
            n = 300 if hidden < 500 else 50
            eager, replay = bench(lambda: model(x), n), bench(graph.replay, n)
            torch.testing.assert_close(out, model(x))
            print(f"{hidden:6d} {layers:6d} {tokens:6d} {eager:9.1f} {replay:9.1f} "
                  f"{eager / replay:7.2f}x")
            graph.reset()


if __name__ == "__main__":
    main()
