"""AdamW on one flat fp32 partition slice, with decoupled weight decay on selected segments.

Pos (ZeRO §5.1) keeps the fp32 master weights and both Adam moments (K = 12 bytes/param) only
for the rank's own partition, so the update is one call over a flat slice instead of hundreds of
per-tensor calls. Weight decay is decoupled (Loshchilov & Hutter, torch.optim.AdamW): applied as
``p *= 1 - lr*wd`` before the Adam update, only to the segments whose parameter has ndim >= 2
(no decay on biases and LayerNorm). With ``adam_w_mode=False`` (DeepSpeed's key) it is Adam's
classic L2 instead: ``grad += wd * p`` on the same segments, before the moments see it, as
DeepSpeed's ``FusedAdam(adam_w_mode=False)`` does. The update itself uses, in order of preference, NVIDIA
apex's multi-tensor Adam (when importable and the tensors are on a GPU), torch's fused AdamW
kernel, or the plain tensor arithmetic of torch's single-tensor AdamW.
"""

from __future__ import annotations

import torch


def _apex_adam():
    try:  # apex is only ever used when importable; the PyPI "apex" is unrelated and lacks these
        import amp_C  # type: ignore
        from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore
        return amp_C.multi_tensor_adam, multi_tensor_applier
    except Exception:  # noqa: BLE001
        return None


class FlatAdamW:
    """Stateless AdamW math; the state tensors belong to the optimizer (and may live on the host)."""

    def __init__(self, device: torch.device, prefer_fused: bool = True, adam_w_mode: bool = True):
        self.adam_w_mode = adam_w_mode
        self.apex = _apex_adam() if device.type == "cuda" else None
        self.fused = prefer_fused and hasattr(torch, "_fused_adamw_")
        self.kind = "apex" if self.apex else ("torch_fused" if self.fused else "torch")
        self._on_device: dict[torch.device, tuple[int, torch.Tensor]] = {}

    def _device_step(self, step: int, device: torch.device) -> torch.Tensor:
        """The step count as the fused kernel's float32 device scalar, made once per step and device
        and shared by every chunk of the step (a fresh host-to-device fill per chunk was not)."""
        held = self._on_device.get(device)
        if held is None or held[0] != step:
            held = (step, torch.full((), float(step), dtype=torch.float32, device=device))
            self._on_device[device] = held
        return held[1]

    def update(self, master, grad, exp_avg, exp_avg_sq, step: int, lr: float, betas, eps: float,
               weight_decay: float, decay_segments) -> None:
        beta1, beta2 = betas
        if weight_decay and decay_segments:
            views = [master.narrow(0, a, b - a) for a, b in decay_segments]
            if self.adam_w_mode:
                torch._foreach_mul_(views, 1.0 - lr * weight_decay)
            else:  # L2: the decay goes through the moments (grad is consumed by this step)
                torch._foreach_add_([grad.narrow(0, a, b - a) for a, b in decay_segments], views,
                                    alpha=weight_decay)
        if self.apex is not None:
            kernel, applier = self.apex
            overflow = torch.zeros(1, dtype=torch.int, device=master.device)
            applier(kernel, overflow, [[grad], [master], [exp_avg], [exp_avg_sq]],
                    lr, beta1, beta2, eps, step, 1, 1, 0.0)
            return
        if self.fused:
            steps = [self._device_step(step, master.device)]
            torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=beta1,
                                beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
            return
        # torch.optim.AdamW's single-tensor arithmetic, operation for operation
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denom = (exp_avg_sq.sqrt() / (bias_correction2 ** 0.5)).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
