"""Checkpoints: HF safetensors (``hf``), Megatron legacy torch layout (``megatron_read``, ``megatron_write``), TP/PP cutting rules
(``layout``), lazy pread readers (``reader``), streaming torch.save writer (``torchfile``), format detection
(``load``), LoRA overlay/PEFT export (``lora_merge``), the convert job (``job``), the trainer's own checkpoints
(``dcp``), the one weight-source protocol every reader implements plus the seeded initial weights (``sources``) and
filling a meta-built, sharded model with a rank's own slices (``sharded``)."""
