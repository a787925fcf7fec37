"""zerotron: Megatron-style 3D-parallel GPT pretraining built around ZeRO (arXiv 1910.02054).

Sub-packages, in the one direction data flows (scripts -> training -> model/zero -> parallel):
``training`` (config, loop, checkpoints), ``model`` (GPT, presets, FLOPs), ``zero`` (ZeRO-DP and
ZeRO-R), ``data`` (tokenizer, token files, samplers) and ``parallel`` (grid, collectives, TP, PP).
"""

__version__ = "0.1.0"
