"""The packed reduce buckets (``zero/grad_buckets.py``), in one process: gradients arrive in a
chosen order at a ``GradReducer`` whose reduce-scatter is a copy (one shard), and the test counts
the temporary buckets it allocates -- the fallback when every bucket is held by a chunk still
filling. Neither case below needs one: a claim that cannot be completed is given back, and the
persistent group reduces through its own buffer. The reference is the sum the partition must
hold, each gradient where the layout puts it."""

from types import SimpleNamespace

import torch

from zerotron.zero import grad_reduce
from zerotron.zero.grad_reduce import GradReducer
from zerotron.zero.partition import Layout


class Copy:
    def reduce_scatter(self, out, bucket, async_op):
        out.copy_(bucket[:out.numel()])
        return SimpleNamespace(wait=lambda: None)


def _arrive(shapes, groups, persistent, order, monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    layout = Layout(shapes, groups, 1, 0, 64, persistent)
    reducer = GradReducer(layout, params, SimpleNamespace(size=1), 3, flat=False, overlap=False,
                          dtype=torch.float32, device=torch.device("cpu"), scatter=Copy())
    want, temporaries, zeros = torch.zeros(layout.full_numel), [], torch.zeros
    counting = lambda *a, **k: temporaries.append(a) or zeros(*a, **k)  # noqa: E731
    monkeypatch.setattr(grad_reduce.torch, "zeros", counting)
    for i in order:
        grad = torch.full(shapes[i], float(i + 1))
        layout.param_view(want, i).copy_(grad)
        params[i].grad = grad
        reducer._on_grad(params[i])
    monkeypatch.setattr(grad_reduce.torch, "zeros", zeros)
    reducer.flush()
    return temporaries, reducer.part_grad, want


def test_a_claim_that_cannot_be_completed_is_given_back(monkeypatch):
    # chunk 0 = a + b[:32], chunk 1 = b[32:]; b arrives first and cannot stage (one bucket for two)
    shapes = [torch.Size([32]), torch.Size([64])]
    temporaries, got, want = _arrive(shapes, [[0, 1]], [False], [1, 0], monkeypatch)
    assert temporaries == []  # chunk 1 reduced through the bucket b's failed claim did not keep
    assert torch.equal(got, want)


def test_the_persistent_group_never_holds_the_shared_bucket(monkeypatch):
    # group 0: two chunks of 64; group 1 (persistent): two small ones, the first arriving first
    # and the last at the end of backward, as a block's LayerNorm and the first block's bias do
    shapes = [torch.Size([64]), torch.Size([64]), torch.Size([4]), torch.Size([4])]
    groups, persistent = [[0, 1], [2, 3]], [False, True]
    temporaries, got, want = _arrive(shapes, groups, persistent, [2, 1, 0, 3], monkeypatch)
    assert temporaries == []
    assert torch.equal(got, want)
