"""Llama: the dense baseline (no biases, no q/k norms)."""

from pipeline.families.family import Family

FAMILY = Family(name="llama", config_class="LlamaConfig")
