"""Qwen2: Llama with a bias on q, k and v."""

from pipeline.families.family import Family

FAMILY = Family(name="qwen2", config_class="Qwen2Config", qkv_bias=True)
