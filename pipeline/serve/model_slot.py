"""The model a log-prob server scores with, its weight version and the fingerprint of the
weights it actually holds. A new version is loaded beside the old one and swapped in whole,
so no request ever meets a half-loaded model."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import devices
from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import ReplayKnobs, score_batches
from pipeline.errors import BadInput
from pipeline.fingerprint import tensor_fingerprint


@dataclass(frozen=True)
class Version:
    """What every response carries: the version name and the held weights' fingerprint."""

    weight_version: str
    weights_fingerprint: str
    model_dir: str


class ModelSlot:
    """An HF model in one process. ``score`` runs in the scheduler's worker thread; ``load``
    in another, while the scheduler is paused."""

    engine = "hf"

    def __init__(self, model_dir: Path, knobs: dict, version: str | None = None):
        settings = ReplayKnobs.from_dict(knobs)
        device = devices.resolve_device(settings.device, "--device")
        self.settings = dataclasses.replace(settings, device=device)
        self._lock = threading.Lock()
        self.model, self.version = self._load(Path(model_dir), version)
        self.tf32 = devices.set_tf32(device, self.settings.allow_tf32)

    def _load(self, model_dir: Path, version: str | None):
        settings = self.settings
        model = load_model(model_dir, settings.dtype, settings.attn_implementation, settings.device)
        fingerprint = tensor_fingerprint(model.state_dict().items())
        return model, Version(
            version_name(model_dir, version, fingerprint), fingerprint, str(model_dir)
        )

    def load(self, model_dir: Path, version: str | None = None) -> Version:
        """Load ``model_dir`` fully, then swap it in (call while no batch is scoring)."""
        model, loaded = self._load(Path(model_dir), version)
        with self._lock:
            self.model, self.version = model, loaded
        return loaded

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model was built for (None: the config does not say)."""
        return max_positions(self.model.config.to_dict())

    def score(self, pairs, want_prompt: bool):
        """Selected-token logprobs for each pair, and the version that scored them."""
        with self._lock:
            model, version = self.model, self.version
        settings = self.settings
        if want_prompt != settings.prompt_logprobs:
            settings = dataclasses.replace(settings, prompt_logprobs=want_prompt)
        size = settings.micro_batch_size
        batches = [pairs[start : start + size] for start in range(0, len(pairs), size)]
        scored = score_batches(
            model,
            batches,
            settings,
            where=lambda k: (
                f"a batch of {len(batches[k])} sequences x "
                f"{max(len(p) + len(c) for p, c in batches[k])} tokens"
            ),
            lower="--token-budget or --max-batch (or send shorter requests)",
            progress=False,
        )
        return [as_result(s) for s in scored], version


def as_result(scored) -> dict:
    """One sequence's part of a /score answer."""
    result = {"logprobs": scored.completion.astype(float).tolist()}
    if scored.prompt is not None:
        prompt = scored.prompt.astype(float)
        result["prompt_logprobs"] = [None if np.isnan(v) else v for v in prompt.tolist()]
    return result


def max_positions(config: dict) -> int | None:
    """A model config's position limit (max_position_embeddings; GPT-2's n_positions)."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_model_dir(path: Path, store_version: str | None = None) -> Path:
    """A model directory; a weight store's version (``store_version``, else `latest`), pulled
    and verified into the local cache; or the directory a publish directory's ``latest``
    names."""
    from pipeline.weights.store import is_store, latest_name, materialize

    if is_store(path):
        return materialize(path, store_version or latest_name(path))
    latest = path / "latest"
    if latest.is_symlink() or latest.is_dir():
        path = latest.resolve()
    elif latest.is_file():
        path = path / latest.read_text().strip()
    if not (path / "config.json").is_file():
        raise BadInput(
            f"{path}: not a model directory (no config.json), nor a weight store or publish "
            "directory whose `latest` names one"
        )
    return path


def version_name(model_dir: Path, given: str | None, fingerprint: str) -> str:
    """The name a version goes by: the one given, else the directory's WEIGHT_VERSION file
    (a publish directory writes one), else the start of the weights' fingerprint."""
    return given or _version_file(model_dir) or fingerprint[:19]


def _version_file(model_dir: Path) -> str | None:
    marker = model_dir / "WEIGHT_VERSION"
    if marker.is_file():
        text = marker.read_text().strip()
        if not text:
            raise BadInput(f"{marker} is empty; write the version name into it.")
        return text
    return None
