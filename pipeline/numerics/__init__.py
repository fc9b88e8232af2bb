"""Reduced-precision numerics computed the way engines compute them: the formats'
arithmetic (`formats`) and a Hugging Face model made to compute with them (`emulate`). What
numerics are called and how they are written down: `pipeline/contracts/numerics.py`."""
