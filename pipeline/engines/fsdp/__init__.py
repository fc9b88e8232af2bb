"""The FSDP2 engine: the HF model under fully_shard, scored on N ranks (replay)."""
