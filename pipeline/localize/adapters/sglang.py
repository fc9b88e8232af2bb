"""Capture from SGLang's own model modules, through forward hooks inside its scheduler.

SGLang's model lives in its scheduler subprocess, not in lpx's process, so the hooks cannot be
put there from here as vllm.py puts its own. SGLang 0.5.23 registers them itself: its server
argument ``--forward-hooks`` names hook factories that its scheduler imports after the model
loads and hangs on the modules whose names match (hook_manager.py, called on every device
path, the CPU one included, from finalize_cuda_graph_capture). lpx starts one server per
dtype it needs, with factories from ``sglang_hooks.py`` (importable there: SGLang's
environment is layered over lpx's venv), each writing one file per boundary per forward into
a folder of this session, with the forward's token positions. A sequence is scored as
SGLang scores it (POST /generate, ``max_new_tokens`` 0, ``logprob_start_len`` 0, the radix
cache off so no prefix is skipped); after the answer the files are read back, reassembled by
position (a chunked prefill runs a sequence over several forwards) and handed to the sink in
the HF layout (pipeline/localize/boundaries.py).

Where each boundary is read (SGLang's module names, Llama/Qwen2/Qwen3/Qwen3-MoE alike):
- embed: ``model.embed_tokens``; input_norm / mlp_in: ``input_layernorm`` /
  ``post_attention_layernorm``, which fuse the residual add and return (normed, residual)
  from layer 1 on: the normed part;
- q, k, v: the arguments of ``self_attn.attn`` (RadixAttention), q and k after the rotary
  embedding (and Qwen3's q/k norms);
- attn_out: ``self_attn`` (o_proj's output); mlp_out: ``mlp``;
- router_logits (MoE layers): ``mlp.gate``; experts: ``mlp.topk``'s topk_ids, the ids SGLang's
  own router chose, sorted;
- final_norm: ``model.norm``; logits: SGLang's own lm-head path (its LogitsProcessor's
  ``_get_logits``) run once more on every position's final-norm output from inside the
  logits processor's hook, since SGLang keeps only the selected tokens' logprobs. Each
  capture checks them against the logprobs the same request returned (`logprob_gap`).

A hook only reads: SGLang's forward is not changed, and this adapter cannot swap in the other
side's activations (``can_replace = False``); verification swaps into the other side. SGLang
has no float64, so a float32 side's floor is measured against the HF model in float64
(`layout["floor_source"]`); a bf16/fp16 side's against a second SGLang server in float32:
the same kernels, attention backend and fused norms, differing only in the declared
precision (``reference=hf`` takes HF float32 instead and saves that server's start).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.engines.base import knobs_from_dict
from pipeline.errors import BadInput
from pipeline.localize.boundaries import model_boundaries, moe_layers

REFERENCE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}
HOOKS = "pipeline.localize.adapters.sglang_hooks:tap"
# kind -> the SGLang modules it is read from (fnmatch patterns over model.named_modules())
MODULES = {
    "embed": "model.embed_tokens",
    "input_norm": "model.layers.*.input_layernorm",
    "qkv": "model.layers.*.self_attn.attn",
    "attn_out": "model.layers.*.self_attn",
    "mlp_in": "model.layers.*.post_attention_layernorm",
    "router_logits": "model.layers.*.mlp.gate",
    "experts": "model.layers.*.mlp.topk",
    "mlp_out": "model.layers.*.mlp",
    "final_norm": "model.norm",
    "logits": "logits_processor",
}
FILE = re.compile(r"^(\d+)\.(.+)\.npy$")


@dataclass(frozen=True)
class SGLangCaptureKnobs:
    dtype: str = "float32"
    # the interpreter with SGLang; empty: LPX_SGLANG_PYTHON, this one, or setup's environment
    python: str = ""
    attention_backend: str | None = None  # on a CPU: torch_native (SGLang's only one there)
    # a prefill longer than this runs over several forwards (rows are reassembled)
    chunked_prefill_size: int | None = None
    max_total_tokens: int = 0  # KV cache in tokens; 0: SGLang's CPU default here (8192)
    # the floor's side: auto (fp32: hf float64; bf16/fp16: sglang float32), sglang or hf
    reference: str = "auto"
    server_args: str = ""  # more SGLang server flags
    log_dir: str = ""  # keep the servers' logs here (default: the session's folder, removed)
    # where the hooks write each forward's rows (default: the session's temporary folder; a
    # tmpfs such as /dev/shm keeps them in memory)
    rows_dir: str = ""
    startup_timeout_s: float = field(default=600.0, metadata={"min": 1})
    timeout_s: float = field(default=600.0, metadata={"min": 1})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "sglang"):
    if "url" in knobs:
        raise BadInput(
            f"{spec}: the sglang capture adapter starts its own server, with lpx's forward "
            "hooks (--forward-hooks); a server lpx did not start has none and returns logprobs, "
            "not activations. Leave out url=."
        )
    settings = knobs_from_dict(SGLangCaptureKnobs, knobs, "sglang capture")
    if settings.reference not in ("auto", "sglang", "hf"):
        raise BadInput(f"{spec}: reference={settings.reference!r}; use auto, sglang or hf.")
    if settings.reference == "sglang" and settings.dtype == "float32":
        raise BadInput(
            f"{spec}: reference=sglang needs a precision above float32, and SGLang has no "
            "float64; leave reference=auto (hf float64)."
        )
    try:
        shlex.split(settings.server_args)
    except ValueError as error:
        raise BadInput(f"{spec}: server_args {settings.server_args!r}: {error}.") from None
    return SGLangCapture(Path(model_dir), settings, device, name=spec)


class SGLangCapture:
    can_replace = False  # the hooks read; they never change SGLang's forward

    def __init__(self, model_dir: Path, settings: SGLangCaptureKnobs, device: str, name: str):
        from pipeline.engines.model_dir import check_model_dir
        from pipeline.engines.sglang.server import sglang_python

        config = check_model_dir(model_dir)
        self.model_dir = model_dir
        self.settings = settings
        self.device = device
        self.name = name
        self.dtype = settings.dtype
        self.reference_dtype = REFERENCE[settings.dtype]
        self.num_layers = int(config["num_hidden_layers"])
        self.moe_layers = moe_layers(config)
        self.top_k = int(config.get("num_experts_per_tok") or 0)
        self.reference_engine = (
            "hf" if settings.reference == "hf" or self.reference_dtype == "float64" else "sglang"
        )
        self.python = sglang_python(settings.python)  # EngineNotInstalled where there is none
        self._folder = Path(tempfile.mkdtemp(prefix="lpx-sglang-capture-"))
        self._servers: dict[str, tuple] = {}  # dtype -> (ExitStack, Session, capture folder)
        self._hf = None
        self._keep_logs = False
        self.server_start_s: dict[str, float] = {}
        self.logprob_gap = 0.0  # of the last capture: |captured logits' logprob - SGLang's|
        self.forwards = 0  # of the last capture: more than one when SGLang chunked it
        self.layout = {
            "engine": "sglang",
            "sglang": _release(self.python),
            "tp": 1,
            "world_size": 1,
            "dtype": self.dtype,
            "attention_backend": settings.attention_backend
            or ("torch_native" if device == "cpu" else "sglang default"),
            "chunked_prefill_size": settings.chunked_prefill_size,
            "radix_cache": False,
            "floor_source": (
                "hf float64 (SGLang has no float64)"
                if self.reference_dtype == "float64"
                else f"{self.reference_engine} {self.reference_dtype}"
            ),
            "capture": "forward hooks in SGLang's scheduler (--forward-hooks)",
        }

    @property
    def boundaries(self) -> list[str]:
        return model_boundaries(self.num_layers, self.moe_layers)

    def capture(self, token_ids, precision: str, sink, replace: dict | None = None) -> None:
        if replace:
            raise BadInput(
                f"{self.name} cannot take another side's activations (its hooks only read); "
                "swap into the other side."
            )
        if precision == "reference" and self.reference_engine == "hf":
            self._reference_side().capture(
                token_ids, "reference" if self.reference_dtype == "float64" else "declared", sink
            )
            return
        dtype = self.dtype if precision == "declared" else self.reference_dtype
        ids = [int(t) for t in token_ids]
        session, folder = self._server(dtype)
        for path in folder.iterdir():  # the warm-up's forwards, the last sequence's
            path.unlink()
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer = session.connection.request("POST", "/generate", body)
        rows, self.forwards = assemble(folder, len(ids), self.boundaries)
        self.logprob_gap = _logprob_gap(rows["logits"], ids, answer)
        for name in self.boundaries:
            sink(name, rows.pop(name))

    def close(self) -> None:
        for stack, _, folder in self._servers.values():
            stack.close()
            shutil.rmtree(folder, ignore_errors=True)
        self._servers.clear()
        if self._hf is not None:
            self._hf.close()
            self._hf = None
        if not self._keep_logs:
            shutil.rmtree(self._folder, ignore_errors=True)

    def hook_specs(self, folder: Path) -> list[dict]:
        """SGLang's --forward-hooks for this model: one spec per kind of boundary."""
        every = list(range(self.num_layers))
        routed = sorted(self.moe_layers)
        specs = []
        for kind, pattern in MODULES.items():
            if kind in ("router_logits", "experts") and not routed:
                continue
            config = {"dir": str(folder), "kind": kind}
            if pattern.startswith("model.layers."):
                config["layers"] = routed if kind in ("router_logits", "experts") else every
            if kind == "experts":
                config["top_k"] = self.top_k
            specs.append(
                {
                    "name": f"lpx-{kind}",
                    "target_modules": [pattern],
                    "hook_factory": HOOKS,
                    "config": config,
                }
            )
        return specs

    def _server(self, dtype: str):
        if dtype not in self._servers:
            self._servers[dtype] = self._start(dtype)
        _, session, folder = self._servers[dtype]
        return session, folder

    def _start(self, dtype: str):
        from pipeline.engines.sglang.knobs import SGLangKnobs, session

        s = self.settings
        base = Path(s.rows_dir) if s.rows_dir else self._folder
        try:
            folder = Path(tempfile.mkdtemp(prefix=f"lpx-sglang-rows-{dtype}-", dir=base))
        except OSError as error:
            raise BadInput(f"{self.name}: rows_dir {base}: {error.strerror}.") from None
        flags = ["--forward-hooks", json.dumps(self.hook_specs(folder))]
        if self.device != "cpu":
            # SGLang hangs the hooks on after its CUDA graphs are captured, and a graph replay
            # runs no Python hook: every forward must run eagerly (not measured on a GPU here)
            flags.append("--disable-cuda-graph")
        hooks = shlex.join(flags)
        knobs = SGLangKnobs(
            python=str(self.python),
            dtype=dtype,
            device=self.device,
            attention_backend=s.attention_backend,
            chunked_prefill_size=s.chunked_prefill_size,
            radix_cache=False,  # a cached prefix is not recomputed: its rows would never be seen
            max_total_tokens=s.max_total_tokens,
            server_args=f"{hooks} {s.server_args}".strip(),
            startup_timeout_s=s.startup_timeout_s,
            timeout_s=s.timeout_s,
            retries=0,
        )
        logs = Path(s.log_dir) if s.log_dir else self._folder
        stack = contextlib.ExitStack()
        started = time.monotonic()
        try:
            found = stack.enter_context(
                session(
                    knobs,
                    self.model_dir,
                    longest=0,
                    moe=False,
                    log_dir=logs,
                    role=f"capture-{dtype}",
                )
            )
        except BaseException:
            stack.close()
            shutil.rmtree(folder, ignore_errors=True)
            self._keep_logs = not s.log_dir  # the error names the log: keep it
            raise
        self.server_start_s[dtype] = round(time.monotonic() - started, 2)
        if self.layout["sglang"] == "unknown":
            self.layout["sglang"] = found.version
        return stack, found, folder

    def _reference_side(self):
        from pipeline.localize.adapters.hf import CaptureKnobs, HFCapture

        if self._hf is None:
            dtype = "float32" if self.reference_dtype == "float64" else self.reference_dtype
            self._hf = HFCapture(self.model_dir, CaptureKnobs(dtype=dtype), self.device, "hf")
        return self._hf


def assemble(folder: Path, length: int, names: list[str]) -> tuple[dict, int]:
    """({boundary: [length, F] rows}, forwards) from the hooks' files in `folder`: each
    position's rows from the first forward that computed it (a chunked prefill runs one
    sequence over several forwards; a position past the sequence is not its own)."""
    errors = sorted(folder.glob("*.error.txt"))
    if errors:
        text = errors[0].read_text(encoding="utf-8", errors="replace").strip().splitlines()
        raise BadInput(
            f"SGLang's capture hooks failed in its scheduler: {' | '.join(text[-3:])[-600:]}"
        )
    forwards: dict[int, dict[str, Path]] = {}
    for path in folder.iterdir():
        match = FILE.match(path.name)
        if match:
            forwards.setdefault(int(match.group(1)), {})[match.group(2)] = path
    complete = {k: files for k, files in sorted(forwards.items()) if "positions" in files}
    if not complete:
        raise BadInput(
            "SGLang answered, but no capture hook completed a forward (is the model's logits "
            "processor named logits_processor?)."
        )
    wanted = set(names)
    out: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    for files in complete.values():
        positions = np.load(files["positions"]).reshape(-1)
        for name, path in files.items():
            if name not in wanted:
                continue
            values = np.load(path)
            if values.shape[0] != positions.shape[0]:
                raise BadInput(
                    f"SGLang's hook wrote {values.shape[0]} rows of {name} for a forward of "
                    f"{positions.shape[0]} positions."
                )
            if name not in out:
                out[name] = np.zeros((length, values.shape[1]), dtype=values.dtype)
                seen[name] = np.zeros(length, dtype=bool)
            for row, position in enumerate(positions):
                if 0 <= position < length and not seen[name][position]:
                    out[name][position], seen[name][position] = values[row], True
    for name in names:
        if name not in out:
            raise BadInput(
                f"SGLang ran no module for boundary {name} (no module matched its hook "
                f"pattern {MODULES[_kind(name)]!r}, or the module did not run)."
            )
        if not seen[name].all():
            missing = int(np.flatnonzero(~seen[name])[0])
            raise BadInput(f"SGLang never ran position {missing} of boundary {name}.")
    return out, len(complete)


def _kind(name: str) -> str:
    from pipeline.localize.boundaries import kind_of

    kind = kind_of(name)
    return "qkv" if kind in ("q", "k", "v") else kind


def _logprob_gap(logits: np.ndarray, ids: list[int], answer) -> float:
    """The largest |log_softmax(captured logits)[t-1, id_t] - SGLang's input logprob of t|:
    whether the logits captured are the ones SGLang scored the sequence with."""
    answer = answer[0] if isinstance(answer, list) else answer
    try:
        pieces = answer["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise BadInput("SGLang's answer has no input_token_logprobs.") from None
    values = logits.astype(np.float64)
    values = values - values.max(axis=1, keepdims=True)
    logprobs = values - np.log(np.exp(values).sum(axis=1, keepdims=True))
    gaps = [
        abs(float(logprobs[t - 1, ids[t]]) - float(pieces[t][0]))
        for t in range(1, len(ids))
        if pieces[t][0] is not None
    ]
    return max(gaps, default=0.0)


def _release(python: Path) -> str:
    """SGLang's version in its environment, read without importing it (a floor measured on
    one release is not another's: floor_cache keys on the layout)."""
    code = "from importlib.metadata import version; print(version('sglang'))"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"
