"""ZeRO-DP (arXiv 1910.02054 §5): plain DP, Pos, Pos+g and Pos+g+p behind one optimizer front.

    from zerotron.zero import ZeroConfig, ZeroOptimizer
    opt = ZeroOptimizer(model, grid, ZeroConfig(stage=2).validate(), lr=3e-4, precision="bf16")
"""

from zerotron.zero.accounting import expected_model_state_bytes
from zerotron.zero.config import ZeroConfig
from zerotron.zero.loss_scaler import DynamicLossScaler, LossScaler
from zerotron.zero.optimizer import ZeroOptimizer
from zerotron.zero.stage3 import default_units

__all__ = ["DynamicLossScaler", "LossScaler", "ZeroConfig", "ZeroOptimizer", "default_units",
           "expected_model_state_bytes"]
