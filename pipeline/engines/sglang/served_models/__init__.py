"""SGLang's model registry for the one model lpx's launcher serves (engines/sglang/launch.py).

The launcher names this package as ``SGLANG_EXTERNAL_MODEL_PACKAGE``: SGLang then registers
what it finds here instead of importing all of its ~250 model modules at start (2.7 of a
start's 19 CPU-seconds on two cores), and imports them all after all where the model's
architecture is not found here, as it would have.
"""
