"""GPT-2 models with Megatron-LM tensor parallelism, their configurations and FLOP counting."""

from zerotron.model.block import TransformerBlock
from zerotron.model.config import GPTConfig
from zerotron.model.flops import PEAK_TFLOPS, flops_per_iteration, peak_tflops, throughput
from zerotron.model.gpt import GPT
from zerotron.model.presets import PRESETS, get_preset

__all__ = [
    "GPT", "GPTConfig", "PEAK_TFLOPS", "PRESETS", "TransformerBlock", "flops_per_iteration",
    "get_preset", "peak_tflops", "throughput",
]
