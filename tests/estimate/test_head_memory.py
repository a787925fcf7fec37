"""The memory model's loss term (``working_memory.head_working_bytes``) against the storages the
vocab-parallel cross-entropy's forward really holds at its peak (``MemoryTracker``: live storages,
not the model's arithmetic), for 16-bit and fp32 logits, with and without padding columns."""

import pytest
import torch

from zerotron.estimate.working_memory import head_working_bytes
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.cross_entropy import vocab_parallel_cross_entropy
from zerotron.parallel.memory_tracker import MemoryTracker


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding", [0, 100], ids=["unpadded", "padded"])
def test_loss_forward_peak_is_the_models(dtype, padding):
    grid = Grid(ParallelDims(), rank=0, world_size=1)
    b, s, columns = 2, 8, 4096
    vocab = columns - padding
    target = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    tracker = MemoryTracker()
    with tracker:
        logits = torch.randn(b, s, columns, dtype=dtype)
        vocab_parallel_cross_entropy(logits, target, grid.tp_group, 0, vocab)
    peak = tracker.report()["peak_bytes"]
    model = head_working_bytes(b, s, columns, 1, logits.element_size(), padded=padding > 0)
    # beyond the logit-sized tensors only per-token ones: maxima, sums, targets, masks
    assert 0 <= peak - model <= 32 * b * s, (peak, model)
