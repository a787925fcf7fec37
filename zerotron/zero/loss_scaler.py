"""Dynamic loss scaling for fp16 (Micikevicius et al.; the rules DeepSpeed and Megatron use).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero.
An overflow (inf/NaN anywhere in the global gradient, detected on every rank by the same
all-reduce that computes the clipping norm) skips the step everywhere; after ``hysteresis``
overflows the scale is halved (never below ``min_scale``). After ``window`` clean steps it doubles
and the hysteresis budget is restored. bf16 and fp32 use a constant scale of 1.
"""

from __future__ import annotations


class LossScaler:
    """Constant scale (bf16, fp32): never skips for scale reasons, never changes."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale, "dynamic": False}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a constant scale belongs to the precision, not to the run's history
        (a bf16 run resumed from an fp16 checkpoint must not inherit its loss scale)."""


class DynamicLossScaler(LossScaler):
    """fp16 scaler: halve on overflow (after ``hysteresis`` of them), double after ``window`` clean steps."""

    dynamic = True

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float):
        super().__init__(initial_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, float(min_scale)
        self.hysteresis_left = hysteresis
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps,
                "dynamic": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("dynamic", "hysteresis_left" in state):
            return  # saved by a constant-scale (bf16/fp32) run: start from initial_loss_scale
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        self.clean_steps = int(state.get("clean_steps", 0))


def make_loss_scaler(precision: str, initial_loss_scale: float = 2.0 ** 16, loss_scale_window: int = 1000,
                     hysteresis: int = 2, min_loss_scale: float = 1.0) -> LossScaler:
    """The scaler a precision needs: dynamic for fp16 (DeepSpeed's ``fp16`` section defaults), a
    constant 1 otherwise. Raises ``ValueError`` naming the setting and the fix."""
    if precision != "fp16":
        return LossScaler(1.0)
    check_loss_scaling(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale)
    return DynamicLossScaler(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale)


def check_loss_scaling(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale) -> None:
    """Raise ``ValueError`` starting with the setting's name (``min_loss_scale=...``) and the fix."""
    if not (_is_number(initial_loss_scale) and initial_loss_scale > 0):
        raise ValueError(f"initial_loss_scale={initial_loss_scale!r}: must be > 0, e.g. 65536")
    if not (_is_number(min_loss_scale) and 0 < min_loss_scale <= initial_loss_scale):
        raise ValueError(f"min_loss_scale={min_loss_scale!r}: must be > 0 and <= initial_loss_scale="
                         f"{initial_loss_scale!r}")
    for name, value in (("loss_scale_window", loss_scale_window), ("hysteresis", hysteresis)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
