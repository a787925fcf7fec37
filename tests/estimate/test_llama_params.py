"""The memory model's parameter terms for the Llama family, against the parameters a GPT really has.

Reference: the ``GPT`` built on the meta device (shapes only) for every Llama-family preset and
variants that turn on what no preset has (q/k/v biases with qk_layernorm, all biases, LayerNorm):
``params_per_rank`` is the sum of its parameters' sizes, ``block_params_per_rank`` one block's, and
``GPTConfig.exact_num_params`` the same count.
"""

from __future__ import annotations

import dataclasses

import pytest

from zerotron.estimate.memory_model import block_params_per_rank, largest_param, params_per_rank
from zerotron.estimate.stage3_memory import block_param_numels, root_param_numels
from zerotron.model import GPT, get_preset
from zerotron.model.presets import PRESETS
from zerotron.parallel import Grid, ParallelDims

LLAMA = [n for n in PRESETS if n.startswith(("llama", "qwen", "mistral", "tiny-llama"))]


def _small(cfg, **kw):  # the preset's architecture at 2 layers: fewer names to build
    return dataclasses.replace(cfg, num_layers=2, **kw)


@pytest.mark.parametrize("name", LLAMA)
def test_params_per_rank_counts_the_built_model(name):
    grid = Grid(ParallelDims(), rank=0, world_size=1)
    base = _small(get_preset(name))
    variants = [base, dataclasses.replace(base, add_qkv_bias=True, qk_layernorm=True),
                dataclasses.replace(base, add_bias_linear=True, normalization="LayerNorm")]
    for cfg in variants:
        model = GPT(cfg, grid, device="meta")
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        assert params_per_rank(cfg) == sum(sizes.values()) == cfg.exact_num_params(), cfg
        block = sum(v for n, v in sizes.items() if n.startswith("blocks.0."))
        assert block_params_per_rank(cfg) == block
        # stage 3's units, parameter by parameter (the persistence threshold sorts them by size)
        assert sorted(block_param_numels(cfg)) == sorted(v for n, v in sizes.items()
                                                         if n.startswith("blocks.0."))
        assert sorted(root_param_numels(cfg)) == sorted(v for n, v in sizes.items()
                                                        if not n.startswith("blocks."))
        assert largest_param(cfg) == max(sizes.values())
    assert len(LLAMA) == 10
