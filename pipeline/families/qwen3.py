"""Qwen3: no qkv bias; an RMSNorm on each head's q and k before RoPE; head_dim set apart
from hidden_size / heads (Qwen3-8B: 4096 wide, 32 heads of 128)."""

from pipeline.families.family import Family

FAMILY = Family(name="qwen3", config_class="Qwen3Config", qk_norm=True, tiny={"head_dim": 32})
