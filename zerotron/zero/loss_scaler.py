"""Dynamic loss scaling for fp16 (Micikevicius et al.; the rules DeepSpeed and Megatron use).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero.
An overflow (inf/NaN anywhere in the global gradient, detected on every rank by the same
all-reduce that computes the clipping norm) skips the step everywhere; after ``hysteresis``
overflows the scale is halved (never below ``min_scale``). After ``window`` clean steps it doubles
and the hysteresis budget is restored (with ``consecutive_hysteresis``, DeepSpeed's option, every
clean step restores it, so only consecutive overflows halve the scale). bf16 and fp32 use a
constant scale of 1.

A *static* fp16 scale (DeepSpeed's ``fp16.loss_scale > 0``) multiplies the loss by a constant and
still skips overflowed steps -- what DeepSpeed's static ``LossScaler`` does -- but never changes.

``scaled`` says whether the loss is multiplied and overflow checked (every fp16 scaler);
``dynamic`` whether the scale moves.
"""

from __future__ import annotations


class LossScaler:
    """Constant scale (bf16, fp32): never skips for scale reasons, never changes."""

    dynamic = False
    scaled = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale, "dynamic": False}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a constant scale belongs to the precision, not to the run's history
        (a bf16 run resumed from an fp16 checkpoint must not inherit its loss scale)."""


class StaticLossScaler(LossScaler):
    """fp16 with a constant scale (DeepSpeed's ``fp16.loss_scale > 0``): the loss is scaled and an
    overflowed step skipped, as with the dynamic scaler, but the scale never moves."""

    scaled = True


class DynamicLossScaler(LossScaler):
    """fp16 scaler: halve on overflow (after ``hysteresis`` of them), double after ``window`` clean steps."""

    dynamic = True
    scaled = True

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float,
                 consecutive_hysteresis: bool = False):
        super().__init__(initial_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
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
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
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
                     hysteresis: int = 2, min_loss_scale: float = 1.0, loss_scale: float = 0.0,
                     consecutive_hysteresis: bool = False) -> LossScaler:
    """The scaler a precision needs: for fp16 dynamic (DeepSpeed's ``fp16`` section defaults) or,
    with ``loss_scale > 0``, static at that scale; a constant 1 otherwise. Raises ``ValueError``
    naming the setting and the fix."""
    if precision != "fp16":
        return LossScaler(1.0)
    check_loss_scaling(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale, loss_scale,
                       consecutive_hysteresis)
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale,
                             consecutive_hysteresis)


def check_loss_scaling(initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale, loss_scale=0.0,
                       consecutive_hysteresis=False) -> None:
    """Raise ``ValueError`` starting with the setting's name (``min_loss_scale=...``) and the fix."""
    if not (_is_number(loss_scale) and loss_scale >= 0):
        raise ValueError(f"loss_scale={loss_scale!r}: must be >= 0 (0: dynamic scaling from initial_loss_scale; "
                         f"> 0: that constant scale)")
    if not isinstance(consecutive_hysteresis, bool):
        raise ValueError(f"consecutive_hysteresis={consecutive_hysteresis!r}: must be true or false")
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
