"""The causes a diagnosis can name, and what a finding says of its own certainty.

`Cause`, `Status` and `Severity` are string enums: they compare equal to their values and are
written to JSON as them, so a report stays plain text and a reader of an older one still
matches.
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    TOKEN_SHIFT = "token_shift"
    MASK_PADDING = "mask_padding"
    POSITION_IDS = "position_ids"
    PROMPT_MISMATCH = "prompt_mismatch"
    TEMPERATURE = "temperature"
    TOP_K = "top_k"
    TOP_P = "top_p"
    # between logits and logprobs: penalties, soft-cap, logit bias, min-p, generation
    # defaults (the parameters say which; temperature, top-k and top-p alone keep their own)
    LOGITS_PROCESSING = "logits_processing"
    STALE_WEIGHTS = "stale_weights"
    # no store to re-score under: every data and sampling cause ruled out
    WEIGHTS_DIFFER = "weights_differ"
    VERSION_CHANGE = "version_change"
    CLAIMED_VERSION = "claimed_version"
    MISSING_VERSION = "missing_version"
    ROUTING_FLIP = "routing_flip"
    DTYPE = "dtype"  # precision: the drift the declared dtypes give
    # a side computed with reduced-precision numerics it does not declare: its linear layers
    # quantized (FP8, MXFP8, INT8), or its KV cache stored in FP8 (the format in details)
    QUANTIZATION = "quantization"
    KV_CACHE_PRECISION = "kv_cache_precision"
    # the two sides computed with model configs that differ (RoPE, windows, eps, soft-caps,
    # a tied head): named from the configs they recorded, or found by re-scoring a misread
    MODEL_CONFIG = "model_config"
    # a multi-turn trajectory whose engine context parts from the tokens the trainer scores
    # (a re-merge, a template separator, thinking stripped, a mask off by one; details say
    # which class): a token gap, never an engine's drift (pipeline/trajectory/parting.py)
    TRAJECTORY_TOKENS = "trajectory_tokens"
    # a multi-turn trajectory's drift that grows with its turns beyond what precision does
    # (pipeline/compare/turn_growth.py): a shape, measured with a stated error rate; the
    # other findings on the same tokens name what grows
    TURN_GROWTH = "turn_growth"
    UNEXPLAINED = "unexplained"  # beyond precision, and no signature names it


# Every cause but precision and "unexplained" names a fault someone committed.
FAULT_CAUSES = tuple(c for c in Cause if c not in (Cause.DTYPE, Cause.UNEXPLAINED))
KNOWN_CAUSES = tuple(Cause)  # what a policy's fail_on_findings may name


class Status(StrEnum):
    # verified: re-scoring with the bug committed reproduced the drift down to the noise
    # floor (or, for precision, the drift is within the calibrated floor); plausible: the
    # signatures fit, nothing re-scored; ruled_out is only ever on what a finding tested.
    VERIFIED = "verified"
    PLAUSIBLE = "plausible"
    RULED_OUT = "ruled_out"


class Severity(StrEnum):
    FAULT = "fault"  # fails the verdict where the policy's fail_on_findings names the cause
    INFO = "info"  # said, never judged (precision within its floor)
