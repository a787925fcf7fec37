"""The fused AdamW's step count is one device scalar per step, shared by every chunk of the step.

Reference: ``torch.optim.AdamW(fused=True)`` on the same tensors -- torch's own optimizer keeps
its step as a device tensor too, so the flat update must be bitwise its result, step after step.
"""

import torch

from zerotron.zero.adam import FlatAdamW


def test_one_step_scalar_per_step_and_bitwise_torch_fused_adamw():
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g) for n in (37, 64)]
    ref = [torch.nn.Parameter(c.clone()) for c in chunks]
    torch_opt = torch.optim.AdamW(ref, weight_decay=0.0, fused=True, **hyper)
    adam = FlatAdamW(torch.device("cpu"))
    assert adam.kind == "torch_fused"
    state = [(torch.zeros_like(c), torch.zeros_like(c)) for c in chunks]
    made = []
    for step in (1, 2, 3):
        grads = [torch.randn(c.shape, generator=g) for c in chunks]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        torch_opt.step()
        for c, gr, (m, v) in zip(chunks, grads, state):
            adam.update(c, gr.clone(), m, v, step, hyper["lr"], hyper["betas"], hyper["eps"], 0.0, [])
            made.append(adam._device_step(step, c.device))
        assert made[-1] is made[-2] and made[-1].item() == step  # shared, and the kernel left it alone
        for c, p in zip(chunks, ref):
            assert torch.equal(c, p.detach())
    assert len({id(t) for t in made}) == 3  # one per step
