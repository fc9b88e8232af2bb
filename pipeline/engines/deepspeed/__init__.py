"""The DeepSpeed engine: the HF model under deepspeed.initialize with ZeRO 0-3, scored on N ranks (replay)."""
