"""What a run will cost before it runs: the ZeRO paper's memory model (model states §3.1,
residual states §3.2, Pa/Pa+cpu checkpoints §6.1, constant buffers §6.2), the largest model that
fits, the paper's Tables 1 and 2, and the ablation runner's reports. It reads model and ZeRO
configurations; nothing below it imports it."""
