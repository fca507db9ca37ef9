"""Inputs shared by the CPU and GPU attention tests."""

from __future__ import annotations

import torch

from kilnx.kernels import attention_split as AS


def random_merge_parts(ranges: int, B: int = 3, T: int = 1, Hq: int = 8, D: int = 128):
    """Partial results as the split writes them over `ranges` key ranges, the last range of row 1 without keys (max
    MASKED_MAX, sum 0, acc 0): ([part_acc, part_max, part_sum], a bf16 q of the output's shape, the merge spec's
    output in fp32)."""
    g = torch.Generator().manual_seed(ranges)
    part_acc = torch.randn(ranges, B, T, Hq, D, generator=g)
    part_max = torch.randn(ranges, B, T, Hq, generator=g) * 3
    part_sum = torch.rand(ranges, B, T, Hq, generator=g) * 4 + 0.5
    part_max[-1, 1], part_sum[-1, 1], part_acc[-1, 1] = AS.MASKED_MAX, 0.0, 0.0
    q = torch.zeros(B, T, Hq, D, dtype=torch.bfloat16)
    return [part_acc, part_max, part_sum], q, AS._merge_spec(part_acc, part_max, part_sum, q).float()
