"""Where a llama forward asks for the next GEMV's weights in L2 (kernels/l2_prefetch.py): before each layer's
qkv, o, gate_up and down GEMVs and the lm_head, in the order the GEMVs run (the short kernels between two
GEMVs are where the memory would idle)."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

import kilnx.ops as kops


def test_a_model_asks_for_the_next_weights_where_a_gemv_hands_over_to_short_kernels():
    asked = []

    class Recording:
        def __getattr__(self, name):
            return getattr(kops, name)

        @staticmethod
        def prefetch_weights(parts, x, site):
            asked.append([id(p) for p in parts])

    model = tiny_model("llama", ops=Recording(), fmt="q4")
    cache_cls = __import__("kilnx.runtime.kv_cache", fromlist=["KVCache"]).KVCache
    cache = cache_cls.for_model(model.config, 1, 8)
    model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache)
    w = model.weights
    want = []
    for layer in w.layers:
        want += [[id(p) for p in layer.qkv], [id(layer.o)], [id(p) for p in layer.gate_up], [id(layer.down)]]
    want.append([id(p) for p in w.lm_head])
    assert asked == want
