"""SGLang's knobs, the server lpx starts for them (or the one it is pointed at), and the
knobs read back from the server: what it actually runs with."""

from __future__ import annotations

import contextlib
import json
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.engines.base import knobs_from_dict
from pipeline.engines.metadata import software_versions
from pipeline.engines.sglang import api as sglang_api
from pipeline.engines.sglang.server import running_server, sglang_python
from pipeline.errors import BadInput

# On a CPU SGLang's KV cache is sized from system RAM unless bounded (15 GB of 23 here).
CPU_KV_TOKENS = 8192


@dataclass(frozen=True)
class SGLangKnobs:
    """Every SGLang setting lpx exposes that can change a logprob. None = SGLang's default."""

    # a server already running (lpx starts none and stops none); empty: lpx starts one
    url: str = ""
    # the interpreter with SGLang; empty: LPX_SGLANG_PYTHON, this one, or setup's environment
    python: str = ""
    dtype: str = "float32"
    device: str = "auto"
    attention_backend: str | None = None  # on a CPU: torch_native, the one that runs there
    chunked_prefill_size: int | None = None
    radix_cache: bool | None = None
    deterministic_inference: bool | None = None
    sampling_backend: str | None = None
    tensor_parallel_size: int = field(default=1, metadata={"min": 1})
    # KV cache in tokens; 0: at least CPU_KV_TOKENS and the longest sequence (CPU only)
    max_total_tokens: int = 0
    mem_fraction_static: float | None = field(default=None, metadata={"max": 1.0})
    weight_version: str = ""  # the version SGLang tags tokens with until an update
    # an idle scheduler polls: a whole core on a CPU host (measured: 21 CPU-s in 20 s idle,
    # 1 with it), taken from whatever runs beside it. None: on where it runs on the CPU
    sleep_on_idle: bool | None = None
    # more server flags, as on SGLang's command line ("--schedule-policy lpm")
    server_args: str = ""
    startup_timeout_s: float = 600.0
    # requests in flight (rollout) and sequences per scoring request (replay)
    concurrency: int = field(default=8, metadata={"min": 1})
    batch_size: int = field(default=16, metadata={"min": 1})
    timeout_s: float = 600.0
    retries: int = 2
    resume_aborted: bool = True
    max_resumes: int = 4
    record_routing: bool = True  # MoE: the experts SGLang's routers chose
    # reduced-precision numerics, in SGLang's own words (docs/reduced-precision.md): its
    # --quantization (fp8, w8a8_fp8, w8a8_int8, mxfp8, ...) and --kv-cache-dtype (auto,
    # fp8_e4m3, fp8_e5m2; fp8 is taken as fp8_e4m3); read back from the server's arguments
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # SGLang's --json-model-override-args: config keys changed as the server loads the model,
    # as JSON ('{"rope_theta": 500000}'); recorded with the config the server resolved
    json_model_override_args: str = ""
    # a server lpx did not start: does it run with SGLANG_RETURN_ORIGINAL_LOGPROB=1?
    # None: lpx asks it (one probe request)
    original_logprobs: bool | None = None

    @classmethod
    def from_dict(cls, knobs: dict) -> SGLangKnobs:
        settings = knobs_from_dict(cls, knobs, "sglang")
        if settings.kv_cache_dtype == "fp8":  # SGLang names E4M3 only in full
            settings = replace(settings, kv_cache_dtype="fp8_e4m3")
        if settings.url and not settings.url.startswith(("http://", "https://")):
            raise BadInput(f"sglang url {settings.url!r}: give http://HOST:PORT.")
        try:
            shlex.split(settings.server_args)
        except ValueError as error:
            raise BadInput(f"sglang server_args {settings.server_args!r}: {error}.") from None
        return settings

    def connection(self, url: str) -> sglang_api.Connection:
        return sglang_api.Connection(url, self.timeout_s, self.retries)

    def server_part(self) -> tuple:
        """The knobs that need another server when they change."""
        return tuple(v for k, v in asdict(self).items() if k not in REQUEST_KNOBS)


# Knobs of how requests are sent: settings that differ only in these share one server.
REQUEST_KNOBS = ("concurrency", "batch_size", "timeout_s", "retries", "resume_aborted",
                 "max_resumes", "original_logprobs")  # fmt: skip


# knob -> (server argument, how its value reads as the knob's)
APPLIED = {
    "dtype": ("dtype", str),
    "device": ("device", str),
    "attention_backend": ("attention_backend", str),
    "chunked_prefill_size": ("chunked_prefill_size", int),
    "radix_cache": ("disable_radix_cache", lambda disabled: not disabled),
    "deterministic_inference": ("enable_deterministic_inference", bool),
    "sampling_backend": ("sampling_backend", str),
    "tensor_parallel_size": ("tp_size", int),
    "max_total_tokens": ("max_total_tokens", int),
    "mem_fraction_static": ("mem_fraction_static", float),
    "weight_version": ("weight_version", str),
    "sleep_on_idle": ("sleep_on_idle", bool),
    "quantization": ("quantization", str),
    "kv_cache_dtype": ("kv_cache_dtype", str),
    "json_model_override_args": ("json_model_override_args", str),
}
# read back and recorded, never set by a knob of lpx's
ALSO_RECORDED = ("page_size", "schedule_policy", "disable_overlap_schedule",
                 "random_seed", "sampling_defaults", "enable_return_routed_experts",
                 "skip_tokenizer_init", "context_length", "enable_mixed_chunk",
                 "max_prefill_tokens", "prefill_only_disable_kv_cache")  # fmt: skip


def server_arguments(
    settings: SGLangKnobs,
    model_dir: Path,
    device: str,
    longest: int,
    moe: bool,
    tokenizer: bool = False,
) -> list[str]:
    """SGLang's command line for the knobs (host and port aside). lpx sends ids, so the
    tokenizer is skipped unless a chat path is wanted (``tokenizer``)."""
    argv = ["--model-path", str(model_dir),
            *([] if tokenizer else ["--skip-tokenizer-init"]), "--random-seed", "0",
            "--dtype", settings.dtype, "--device", "cuda" if device.startswith("cuda") else "cpu",
            "--tp-size", str(settings.tensor_parallel_size)]  # fmt: skip
    backend = settings.attention_backend or ("torch_native" if device == "cpu" else None)
    if backend:
        argv += ["--attention-backend", backend]
    if device == "cpu" or settings.max_total_tokens:
        tokens = settings.max_total_tokens or max(CPU_KV_TOKENS, 2 * longest)
        argv += ["--max-total-tokens", str(tokens)]
    optional = {
        "--chunked-prefill-size": settings.chunked_prefill_size,
        "--sampling-backend": settings.sampling_backend,
        "--mem-fraction-static": settings.mem_fraction_static,
        "--weight-version": settings.weight_version or None,
        "--quantization": settings.quantization,
        "--kv-cache-dtype": None if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype,
        "--json-model-override-args": settings.json_model_override_args or None,
    }
    argv += [str(part) for flag, value in optional.items() if value is not None
             for part in (flag, value)]  # fmt: skip
    if settings.radix_cache is False:
        argv.append("--disable-radix-cache")
    if settings.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if settings.sleep_on_idle or (settings.sleep_on_idle is None and device == "cpu"):
        argv.append("--sleep-on-idle")
    if moe and settings.record_routing:
        argv.append("--enable-return-routed-experts")
    return argv + shlex.split(settings.server_args)


@dataclass
class Session:
    """A server to talk to, and what it said of itself."""

    connection: sglang_api.Connection
    info: dict
    started_by_lpx: bool
    log: str | None = None
    started_s: float | None = None
    argv: list[str] = field(default_factory=list)
    model_info: dict = field(default_factory=dict)  # GET /get_model_info

    @property
    def version(self) -> str:
        return str(self.info.get("version", "unknown"))

    def server_args(self) -> dict:
        """The resolved server arguments (older releases nest them under server_args)."""
        return self.info.get("server_args", self.info)


@contextlib.contextmanager
def session(
    settings: SGLangKnobs,
    model_dir: Path,
    *,
    longest: int,
    moe: bool,
    log_dir: Path | None,
    role: str,
    env: dict[str, str] | None = None,
    say=None,
    tokenizer: bool = False,
):
    """Yield a `Session` on the knobs' server: the one at ``url``, or one lpx starts on
    ``model_dir`` (stopped after; with its tokenizer where ``tokenizer``: a chat path)."""
    if settings.url:
        connection = settings.connection(settings.url)
        yield Session(
            connection,
            sglang_api.server_info(connection),
            started_by_lpx=False,
            model_info=sglang_api.model_info(connection),
        )
        return
    from pipeline.devices import resolve_device

    device = resolve_device(settings.device, "--device")
    python = sglang_python(settings.python)
    argv = server_arguments(settings, model_dir, device, longest, moe, tokenizer)
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="lpx-sglang-"))
    log = folder / f"sglang-{role}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    with running_server(python, argv, log, env, settings.startup_timeout_s, say) as server:
        connection = settings.connection(server.url)
        yield Session(
            connection,
            sglang_api.server_info(connection),
            started_by_lpx=True,
            log=str(log),
            started_s=round(server.started_s, 2),
            argv=argv,
            model_info=sglang_api.model_info(connection),
        )


def applied_knobs(settings: SGLangKnobs, found: Session) -> dict:
    """Every knob as the server reports it runs, lpx's request-side knobs as given."""
    args = found.server_args()
    applied = {
        knob: (None if args.get(name) is None else read(args[name]))
        for knob, (name, read) in APPLIED.items()
        if name in args
    }
    applied.update({name: args[name] for name in ALSO_RECORDED if name in args})
    given = ("url", "record_routing", "server_args", *REQUEST_KNOBS)
    applied.update({k: v for k, v in asdict(settings).items() if k in given})
    applied["server_started_by_lpx"] = found.started_by_lpx
    if applied.get("json_model_override_args") in ("", "{}"):
        # SGLang's default: said only where set, so a case without overrides keeps its key
        del applied["json_model_override_args"]
    return applied


def not_applied(settings: SGLangKnobs, applied: dict) -> dict:
    """Knobs the user set that the server does not run with: {knob: {requested, applied}}."""
    missed = {}
    for knob in APPLIED:
        requested = getattr(settings, knob)
        if requested is None or requested == "" or knob not in applied:
            continue
        if knob == "max_total_tokens" and not requested:
            continue
        if knob == "device" and requested == "auto":
            continue
        if knob == "dtype" and applied[knob] in ("auto", None):
            continue
        if knob == "kv_cache_dtype" and requested == "auto":
            continue
        if applied[knob] != requested:
            missed[knob] = {"requested": requested, "applied": applied[knob]}
    return missed


# SGLang's --quantization names and what lpx reads them as where it computes them online
# (pipeline/contracts/numerics.py presets); a checkpoint's own scheme is read from its config
SGLANG_QUANTIZATIONS = {"fp8": "fp8", "w8a8_fp8": "fp8-channel", "w8a8_int8": "int8",
                        "mxfp8": "mxfp8", "modelopt_fp8": "fp8"}  # fmt: skip


def resolved_config(model_dir: Path, found: Session) -> dict:
    """The model config the server computes with: the model's config.json with the override
    arguments the server reports it runs with (``json_model_override_args``), resolved as
    transformers resolves it (SGLang builds its model config with transformers' classes)."""
    from pipeline.engines.base import json_object
    from pipeline.engines.metadata import file_config_resolved

    given = found.server_args().get("json_model_override_args") or "{}"
    try:
        overrides = json_object(given, "SGLang's json_model_override_args")
    except BadInput:
        overrides = {}
    return file_config_resolved(model_dir, overrides)


def numerics_metadata(found: Session) -> dict:
    """``metadata.numerics`` of what the server runs, from its resolved arguments: its
    quantization and KV cache (SGLang stores the cache by torch's cast, rounding to nearest;
    measured bit for bit against lpx's emulation on the torch_native backend)."""
    from pipeline.contracts.numerics import Numerics, parse_kv_cache, parse_quantization

    args = found.server_args()
    name = args.get("quantization")
    if name and name not in SGLANG_QUANTIZATIONS:
        raise BadInput(
            f"SGLang runs --quantization {name}, which lpx cannot name; "
            f"docs/reduced-precision.md lists what it reads ({', '.join(SGLANG_QUANTIZATIONS)})."
        )
    kv = args.get("kv_cache_dtype")
    numerics = Numerics(
        parse_quantization(SGLANG_QUANTIZATIONS[name]) if name else None,
        parse_kv_cache(kv) if kv and str(kv).startswith("fp8") else None,
    )
    if not numerics:
        return {}
    return {"numerics": {**numerics.as_dict(), "computed_by": f"sglang {found.version}",
                         "read_back": {"quantization": name, "kv_cache_dtype": kv}}}  # fmt: skip


def engine_metadata(role: str, found: Session) -> dict:
    return {
        "name": "sglang",
        "role": role,
        "versions": {**software_versions(), "sglang": found.version},
        "server": {
            "started_by_lpx": found.started_by_lpx,
            "url": found.connection.url,
            "log": found.log,
            "start_s": found.started_s,
            "argv": found.argv,
            "server_args": json.loads(json.dumps(found.server_args(), default=str)),
        },
    }
