"""ZeRO-R for activations (arXiv 1910.02054 §6.1, §6.3): checkpointing with exact recompute, Pa, Pa+cpu, MD.

    from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing
    ckpt = apply_activation_checkpointing(model, grid, ActivationCheckpointConfig(
        checkpoint_activations=True, partition_activations=True).validate())
"""

from zerotron.activation.checkpoint import apply_activation_checkpointing
from zerotron.activation.config import ActivationCheckpointConfig

__all__ = ["ActivationCheckpointConfig", "apply_activation_checkpointing"]
