"""Reduced-precision numerics as a fixture, a calibration and a history key write them: the
quantization of the linear layers (FP8, MXFP8, INT8 at a granularity) and the KV cache's
precision, parsed from what users and engines call them and named one canonical way.

A side's *precision* is its dtype, then what it adds: ``bfloat16``, ``float32+tf32``,
``bfloat16+fp8_e4m3:w=block128,a=group128+kv=fp8_e4m3``. Calibration pairs, floors and
case keys use that text, so two sides compare as "the same numerics" exactly when their
texts are equal. The formats' arithmetic is `pipeline/numerics/`.

Granularities (how many values share one scale):
- weights [out, in]: ``tensor`` (one), ``channel`` (one per output row), ``block128`` (one
  per 128 x 128 tile), ``mx32`` (one per 32 along the input, a power of two: OCP MX);
- activations [tokens, in], computed at run time: ``tensor`` (one per matmul call),
  ``token`` (one per row), ``group128`` (one per 128 of a row), ``mx32``, or ``none``
  (weight-only: the matmul takes the activations as they are, W8A16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "int8", "fp4_e2m1")
KV_ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
WEIGHT_GRANULARITIES = ("tensor", "channel", "block128", "mx32", "nv16")
ACTIVATION_GRANULARITIES = ("none", "tensor", "token", "group128", "mx32", "nv16")
# FP4 is block-scaled only: OCP MX's 32 (MXFP4) or NVIDIA's 16 with E4M3 scales (NVFP4)
FP4_GRANULARITIES = ("mx32", "nv16")
# which linear layers a quantization reaches: all (""), the MLPs only (attention kept, as
# NeMo-RL and verl FP8 recipes may), or the routed MoE experts only (FP4 expert recipes)
ONLY = ("", "mlp", "experts")
# how a quantized GEMM's arithmetic runs: ``scaled`` multiplies the quantized operands and
# applies the scales to a float32 (or integer) accumulator, then casts (W8A8 GEMMs,
# CUTLASS); ``dequantized`` multiplies operands dequantized into the model's dtype (bf16)
# in that dtype (a weight-only kernel's way, which some W8A8 paths take too)
GEMMS = ("scaled", "dequantized")
# float: a float32 scale = amax / the element's largest value; ue8m0: that scale rounded up
# to a power of two (DeepGEMM's scale_fmt ue8m0; what vLLM, SGLang and torchao's RCEIL give
# MX blocks); ocp: OCP MX v1.0's rule, 2^(floor(log2 amax) - emax), the largest values
# saturating (torchao's FLOOR). mx32 takes a power of two: ue8m0 unless ocp is named.
SCALE_RULES = ("float", "ue8m0", "ocp")
# layers that stay in the model's dtype unless a spec names them: what every engine keeps
OPTIONAL_LAYERS = ("lm_head", "embeddings", "router")

# What users and engines call a quantization, and what it computes. vLLM's online `fp8`:
# one E4M3 scale per (fused) weight matrix, dynamic per-token activations where CUTLASS FP8
# runs (sm89+), per-tensor elsewhere (`fp8-tensor`), weight-only on GPUs without FP8 and on
# AMX CPUs (`fp8-w8a16`); verl's `fp8`, slime's, NeMo-RL's and DeepSeek's: 128 x 128 weight
# blocks, 1 x 128 activation groups; `mxfp8`: E4M3 with one power-of-two scale per 32;
# `int8`: w8a8 (per-channel weights, per-token activations).
PRESETS = {
    "fp8": "fp8_e4m3:w=tensor,a=token",
    "fp8-tensor": "fp8_e4m3:w=tensor,a=tensor",
    "fp8-w8a16": "fp8_e4m3:w=tensor,a=none",
    "fp8-channel": "fp8_e4m3:w=channel,a=token",
    "fp8-block": "fp8_e4m3:w=block128,a=group128",
    "fp8-block-ue8m0": "fp8_e4m3:w=block128,a=group128,scales=ue8m0",
    "fp8-block-w8a16": "fp8_e4m3:w=block128,a=none",
    "mxfp8": "fp8_e4m3:w=mx32,a=mx32,scales=ue8m0",
    "mxfp8-w8a16": "fp8_e4m3:w=mx32,a=none,scales=ue8m0",
    "int8": "int8:w=channel,a=token",
    "int8-w8a16": "int8:w=channel,a=none",
    # NVFP4 (ModelOpt's, vLLM's and SGLang's modelopt_fp4): E2M1 in blocks of 16 with E4M3
    # scales under an FP32 tensor scale, W4A4 or weight-only; MXFP4 (OCP): blocks of 32
    "nvfp4": "fp4_e2m1:w=nv16,a=nv16",
    "nvfp4-w4a16": "fp4_e2m1:w=nv16,a=none",
    "mxfp4": "fp4_e2m1:w=mx32,a=mx32,scales=ue8m0",
    "mxfp4-w4a16": "fp4_e2m1:w=mx32,a=none,scales=ue8m0",
}
# vLLM 0.33's names for its online quantizations
PRESET_ALIASES = {
    "fp8_per_tensor": "fp8",
    "fp8_per_block": "fp8-block",
    "fp8_per_channel": "fp8-channel",
    "w8a8_int8": "int8",
    "w8a8_fp8": "fp8",
    "modelopt_fp4": "nvfp4",
}
KV_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
              "nvfp4": "fp4_e2m1", "fp4_e2m1": "fp4_e2m1"}  # fmt: skip
NO_KV = ("", "auto", "none", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
NO_QUANTIZATION = ("", "none", "null")


@dataclass(frozen=True)
class LinearQuantization:
    """How the linear layers compute: ``element`` values at ``weights`` and ``activations``
    granularity, under a scale rule; the decoder layers ``keep_first``/``keep_last`` and the
    layers not in ``quantized_too`` stay in the model's dtype (norms always do)."""

    element: str = "fp8_e4m3"
    weights: str = "tensor"
    activations: str = "tensor"
    scales: str = "float"
    keep_first: int = 0
    keep_last: int = 0
    quantized_too: tuple[str, ...] = ()
    only: str = ""
    gemm: str = "scaled"

    def __post_init__(self):
        _one_of("element", self.element, ELEMENTS)
        _one_of("weight granularity w", self.weights, WEIGHT_GRANULARITIES)
        _one_of("activation granularity a", self.activations, ACTIVATION_GRANULARITIES)
        _one_of("scales", self.scales, SCALE_RULES)
        _one_of("only", self.only, ONLY)
        _one_of("gemm", self.gemm, GEMMS)
        fp4 = self.element == "fp4_e2m1"
        for what, granularity in (("w", self.weights), ("a", self.activations)):
            if granularity == "none":
                continue
            if fp4 and granularity not in FP4_GRANULARITIES:
                raise ValueError(f"fp4_e2m1 is block-scaled: {what}= takes "
                                 f"{' or '.join(FP4_GRANULARITIES)}, not {granularity}")  # fmt: skip
            if granularity == "nv16" and not fp4:
                raise ValueError("nv16 (NVFP4's blocks of 16) scales fp4_e2m1 values only")
        for name in self.quantized_too:
            _one_of("layer", name, OPTIONAL_LAYERS)
        if self.keep_first < 0 or self.keep_last < 0:
            raise ValueError("keep_first and keep_last count layers: give 0 or more")
        if self.element == "int8" and "mx32" in (self.weights, self.activations):
            raise ValueError("mx32 scales a floating-point element; int8 takes tensor, channel, "
                             "token or block granularity")  # fmt: skip
        if self.element == "int8" and self.scales != "float":
            raise ValueError("int8 takes float scales (amax / 127)")
        if "mx32" in (self.weights, self.activations) and self.scales == "float":
            object.__setattr__(self, "scales", "ue8m0")  # MX scales are powers of two

    @property
    def text(self) -> str:
        parts = [f"w={self.weights}", f"a={self.activations}"]
        if self.scales != "float":
            parts.append(f"scales={self.scales}")
        if self.keep_first:
            parts.append(f"keep_first={self.keep_first}")
        if self.keep_last:
            parts.append(f"keep_last={self.keep_last}")
        if self.only:
            parts.append(f"only={self.only}")
        if self.gemm != "scaled":
            parts.append(f"gemm={self.gemm}")
        parts += sorted(self.quantized_too)
        return f"{self.element}:{','.join(parts)}"

    @property
    def description(self) -> str:
        """In words: ``E4M3 weights per 128 x 128 block, activations per 1 x 128 group``."""
        element = {"fp8_e4m3": "E4M3", "fp8_e5m2": "E5M2", "int8": "INT8",
                   "fp4_e2m1": "FP4 (E2M1)"}[self.element]  # fmt: skip
        weights = {"tensor": "one scale per weight matrix", "channel": "per output channel",
                   "block128": "per 128 x 128 block", "mx32": "per 32 (MX)",
                   "nv16": "per 16 (NVFP4: E4M3 scales)"}[self.weights]  # fmt: skip
        activations = {"none": "activations unquantized (weight-only)",
                       "tensor": "activations per tensor (dynamic)",
                       "token": "activations per token (dynamic)",
                       "group128": "activations per 1 x 128 group",
                       "mx32": "activations per 32 (MX)",
                       "nv16": "activations per 16 (NVFP4)"}[self.activations]  # fmt: skip
        scales = {"float": "", "ue8m0": ", power-of-two scales", "ocp": ", OCP MX scales"}
        kept = []
        if self.keep_first or self.keep_last:
            kept.append(f"first {self.keep_first} and last {self.keep_last} layers kept")
        if self.only:
            kept.append({"mlp": "MLP layers only, attention kept",
                         "experts": "routed experts only"}[self.only])  # fmt: skip
        if self.gemm == "dequantized":
            kept.append("GEMM on operands dequantized into the model's dtype")
        kept += [f"{name} quantized too" for name in self.quantized_too]
        extra = f" ({'; '.join(kept)})" if kept else ""
        return f"{element} weights {weights}, {activations}{scales[self.scales]}{extra}"

    @property
    def label(self) -> str:
        """The preset's name where one computes this (with what it keeps or adds: ``mxfp8
        (keep_first=2, lm_head)``), else the canonical text."""
        base = replace(self, keep_first=0, keep_last=0, quantized_too=(), only="", gemm="scaled")
        for name, text in PRESETS.items():
            if text == base.text:
                extras = self.text[len(text) :].lstrip(",")
                return f"{name} ({extras.replace(',', ', ')})" if extras else name
        return self.text


KV_ROUNDINGS = ("nearest", "toward_zero")


@dataclass(frozen=True)
class KVCacheQuantization:
    """The KV cache stored as ``element`` values of K / k_scale and V / v_scale (keys after
    the rotary embedding, as engines store them), rounded to nearest (SGLang, vLLM's CUDA
    kernels) or toward zero (vLLM-CPU's store cuts the mantissa); attention reads them back
    multiplied by the scales. ``from_position``: only queries at that position and later
    read the rounded cache (an FP8 attention path that parts prefill from decode, as
    FlashAttention-3's did at 97 and SGLang's at 96); earlier ones read K/V as computed."""

    element: str = "fp8_e4m3"
    k_scale: float = 1.0
    v_scale: float = 1.0
    rounding: str = "nearest"
    from_position: int = 0

    def __post_init__(self):
        _one_of("kv cache element", self.element, KV_ELEMENTS)
        _one_of("kv cache rounding", self.rounding, KV_ROUNDINGS)
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and value < float("inf")):
                raise ValueError(f"kv cache {name} must be a positive number, not {value!r}")
        if not isinstance(self.from_position, int) or self.from_position < 0:
            raise ValueError(f"kv cache from= takes a position (0 or more), not "
                             f"{self.from_position!r}")  # fmt: skip

    @property
    def text(self) -> str:
        """``kv=fp8_e4m3``, ``kv=fp8_e4m3:toward_zero``, ``kv=fp8_e5m2@0.5/0.25``,
        ``kv=fp8_e4m3,from=96``."""
        text = f"kv={self.element}"
        if self.rounding != "nearest":
            text += f":{self.rounding}"
        if (self.k_scale, self.v_scale) != (1.0, 1.0):
            text += f"@{self.k_scale:.9g}/{self.v_scale:.9g}"
        if self.from_position:
            text += f",from={self.from_position}"
        return text


@dataclass(frozen=True)
class Numerics:
    """What a side computes beyond its dtype. Empty (both None): the dtype alone."""

    linear: LinearQuantization | None = None
    kv_cache: KVCacheQuantization | None = None
    extra: tuple[str, ...] = field(default=())  # parts of a precision lpx does not know

    def __bool__(self) -> bool:
        return self.linear is not None or self.kv_cache is not None

    @property
    def text(self) -> str:
        """Canonical: ``fp8_e4m3:w=tensor,a=tensor+kv=fp8_e4m3`` ('' when empty)."""
        parts = [self.linear.text] if self.linear else []
        parts += [self.kv_cache.text] if self.kv_cache else []
        return "+".join([*parts, *self.extra])

    @property
    def description(self) -> str:
        parts = [f"{self.linear.label}: {self.linear.description}"] if self.linear else []
        if self.kv_cache:
            element = {"fp8_e4m3": "E4M3", "fp8_e5m2": "E5M2",
                       "fp4_e2m1": "NVFP4"}[self.kv_cache.element]  # fmt: skip
            scales = (self.kv_cache.k_scale, self.kv_cache.v_scale)
            rounded = "rounded toward zero" if self.kv_cache.rounding == "toward_zero" else (
                "rounded to nearest")  # fmt: skip
            onset = self.kv_cache.from_position
            read = f", read by the queries from position {onset} on" if onset else ""
            parts.append(
                f"an {element} KV cache ({rounded}, K/V scales {scales[0]:g}/{scales[1]:g}{read})"
            )
        return "; ".join(parts) or "no reduced-precision numerics"

    @property
    def label(self) -> str:
        """What a person reads: ``fp8-block + kv fp8_e4m3``."""
        parts = [self.linear.label] if self.linear else []
        if self.kv_cache:
            parts.append(self.kv_cache.text.replace("kv=", "kv ", 1))
        return " + ".join(parts) or "none"

    def as_dict(self) -> dict:
        """What the fixture's metadata records (``metadata.numerics``)."""
        out: dict = {"text": self.text, "label": self.label}
        if self.linear:
            out["quantization"] = {
                **asdict(self.linear),
                "quantized_too": list(self.linear.quantized_too),
            }
        if self.kv_cache:
            out["kv_cache"] = asdict(self.kv_cache)
        return out


NONE = Numerics()


def parse_quantization(text: str) -> LinearQuantization | None:
    """A preset (``fp8``, ``fp8-block``, ``mxfp8``, ``int8``, ...), optionally with options
    (``fp8-block:keep_first=2,keep_last=2,lm_head``), or the canonical text
    (``fp8_e4m3:w=channel,a=token``); None for none."""
    text = str(text or "").strip().lower()
    if text in NO_QUANTIZATION:
        return None
    head, _, options = text.partition(":")
    head = PRESET_ALIASES.get(head, head)
    if head in PRESETS:
        base_element, _, base_options = PRESETS[head].partition(":")
        options = ",".join(part for part in (base_options, options) if part)
        head = base_element
    if head not in ELEMENTS:
        raise ValueError(
            f"unknown quantization {text!r}; use one of {', '.join(PRESETS)} or "
            "ELEMENT:w=GRANULARITY,a=GRANULARITY (elements: " + ", ".join(ELEMENTS) + ")"
        )
    fields: dict = {"element": head}
    too: list[str] = []
    names = {"w": "weights", "a": "activations", "scales": "scales",
             "keep_first": "keep_first", "keep_last": "keep_last", "only": "only",
             "gemm": "gemm"}  # fmt: skip
    for option in filter(None, (o.strip() for o in options.split(","))):
        key, eq, value = option.partition("=")
        if not eq:
            too.append(key)
            continue
        if key not in names:
            raise ValueError(
                f"quantization {text!r}: unknown option {key!r}; options are "
                f"{', '.join(names)} and the layers to quantize too ({', '.join(OPTIONAL_LAYERS)})"
            )
        if key.startswith("keep_"):
            try:
                fields[names[key]] = int(value)
            except ValueError:
                raise ValueError(f"quantization {text!r}: {key} takes a number of layers") from None
        else:
            fields[names[key]] = value  # a later option overrides a preset's
    return LinearQuantization(**fields, quantized_too=tuple(sorted(set(too))))


def parse_kv_cache(
    text: str, k_scale: float = 1.0, v_scale: float = 1.0, rounding: str = "nearest"
):
    """An engine's kv_cache_dtype (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ``nvfp4``; ``auto``
    and the model's dtypes: none), or the canonical ``kv=fp8_e4m3:toward_zero@0.5/0.25``
    with its rounding and scales, and ``,from=96`` where only later queries read it."""
    text = str(text or "").strip().lower().removeprefix("kv=")
    if text in NO_KV:
        return None
    text, _, onset = text.partition(",from=")
    try:
        from_position = int(onset or 0)
    except ValueError:
        raise ValueError(f"kv cache {text!r}: from= takes a position, not {onset!r}") from None
    element, _, scales = text.partition("@")
    element, _, named_rounding = element.partition(":")
    rounding = named_rounding or rounding
    if element not in KV_ALIASES:
        raise ValueError(
            f"unknown kv cache dtype {text!r}; use auto, fp8 (E4M3), fp8_e4m3, fp8_e5m2 or nvfp4"
        )
    if scales:
        k_scale, v_scale = parse_kv_scales(scales, f"kv cache {text!r}")
    return KVCacheQuantization(
        KV_ALIASES[element], float(k_scale), float(v_scale), rounding, from_position
    )


def parse_kv_scales(text: str, what: str) -> tuple[float, float]:
    """``0.5/0.25`` (K and V) or one number for both; ValueError naming ``what``."""
    k_text, _, v_text = str(text).strip().partition("/")
    try:
        return float(k_text), float(v_text or k_text)
    except ValueError:
        raise ValueError(f"{what}: scales are K/V numbers (0.5/0.25) or one for both") from None


def parse_numerics(text: str) -> Numerics:
    """The canonical text (``Numerics.text``) read back; parts it does not know are kept
    apart, never dropped (they still tell two precisions apart)."""
    linear, kv_cache, extra = None, None, []
    for part in filter(None, str(text or "").split("+")):
        if part.startswith("kv="):
            kv_cache = parse_kv_cache(part)
        elif part.split(":", 1)[0] in (*ELEMENTS, *PRESETS, *PRESET_ALIASES):
            linear = parse_quantization(part)
        else:
            extra.append(part)
    return Numerics(linear, kv_cache, tuple(extra))


# --- precisions: a dtype and its numerics as one text -----------------------------------------

TF32_PART = "tf32"


def precision_text(dtype: str, numerics: Numerics | None = None, tf32: bool = False) -> str:
    """``bfloat16``, ``float32+tf32``, ``bfloat16+fp8_e4m3:w=tensor,a=tensor``."""
    parts = [dtype, *([TF32_PART] if tf32 else []), *([numerics.text] if numerics else [])]
    return "+".join(parts)


def split_precision(precision: str) -> tuple[str, bool, Numerics]:
    """(dtype, TF32, numerics) of a precision text."""
    dtype, _, rest = str(precision).partition("+")
    tf32 = rest == TF32_PART or rest.startswith(TF32_PART + "+")
    if tf32:
        rest = rest[len(TF32_PART) :].removeprefix("+")
    return dtype, tf32, parse_numerics(rest)


DTYPES = ("float32", "bfloat16", "float16")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def canonical_precision(text: str) -> str:
    """A precision as a user writes it (``bf16+fp8-block+kv=fp8``, ``fp32+tf32``) in its
    canonical text; ValueError naming what is wrong."""
    dtype, _, rest = str(text).strip().partition("+")
    dtype = DTYPE_NAMES.get(dtype.lower(), dtype.lower())
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {text.partition('+')[0]!r} in {text!r}; use fp32, bf16 "
                         "or fp16, then +NUMERICS (bf16+fp8-block+kv=fp8_e4m3)")  # fmt: skip
    tf32, linear, kv_cache = False, None, None
    for part in filter(None, (p.strip() for p in rest.split("+"))):
        if part.lower() == TF32_PART:
            tf32 = True
        elif part.lower().startswith("kv="):
            kv_cache = parse_kv_cache(part)
        else:
            linear = parse_quantization(part)
    return precision_text(dtype, Numerics(linear, kv_cache), tf32)


def check_precision(text: str) -> str:
    """A precision text as a file holds it: canonical, or ValueError."""
    if not isinstance(text, str) or canonical_precision(text) != text:
        raise ValueError(f"{text!r} is not a precision lpx writes (dtype[+tf32][+numerics])")
    return text


def without_tf32(precision: str) -> str:
    """The precision as measured where TF32 cannot be (a CPU): its dtype and numerics."""
    dtype, _, numerics = split_precision(precision)
    return precision_text(dtype, numerics)


def base_dtype(precision: str) -> str:
    """The dtype a precision computes in (``bfloat16`` of ``bfloat16+fp8...``)."""
    return str(precision).partition("+")[0]


def numerics_of(meta: dict) -> Numerics:
    """A side's numerics as its metadata records them (``numerics.text``); none when it
    records none (every fixture before numerics were recorded)."""
    recorded = (meta or {}).get("numerics") or {}
    return parse_numerics(recorded.get("text", "") if isinstance(recorded, dict) else "")


def with_numerics(numerics: Numerics, **changes) -> Numerics:
    return replace(numerics, **changes)


def _one_of(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")
