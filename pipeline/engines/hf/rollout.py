"""Sampling rollouts with Hugging Face transformers and a KV cache, from token-id prompts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline import devices
from pipeline.engines.base import SamplingParams, trajectories
from pipeline.engines.hf.model import (
    load_model,
    numerics_from_knobs,
    numerics_metadata,
    process_logits,
)
from pipeline.engines.hf.routing import router_tap
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.errors import BadInput
from pipeline.fixture.table import table_from_sequences
from pipeline.names import canonical_dtype
from pipeline.progress import progress_bar
from pipeline.routing import routing_metadata


@dataclass(frozen=True)
class RolloutKnobs:
    """Every setting of the HF rollout that can change a logprob, with its default."""

    dtype: str = "float32"
    batch_size: int = 8
    attn_implementation: str = "sdpa"
    device: str = "auto"
    allow_tf32: bool = False
    # reduced-precision numerics, emulated exactly (as hf replay's knobs of the same names)
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    kv_scales: str = ""


DEFAULT_KNOBS = asdict(RolloutKnobs())


class HFRolloutEngine:
    name = "hf"
    knobs = RolloutKnobs
    takes_device = True  # --device places it (pipeline.devices)

    def rollout(
        self, model_dir: Path, prompts: list[list[int]], sampling: SamplingParams, knobs: dict
    ):
        import torch

        unknown = set(knobs) - set(DEFAULT_KNOBS)
        if unknown:
            raise BadInput(
                f"unknown hf rollout knob(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULT_KNOBS)}."
            )
        settings = {**DEFAULT_KNOBS, **knobs}
        try:
            settings["dtype"] = canonical_dtype(settings["dtype"])
            settings["batch_size"] = int(settings["batch_size"])
            if settings["batch_size"] < 1:
                raise BadInput(f"hf knob batch_size={settings['batch_size']}: must be >= 1.")
            settings["allow_tf32"] = _flag(settings["allow_tf32"])
        except ValueError as error:
            raise BadInput(f"hf rollout knobs: {error}") from None
        if sampling.logprobs_mode not in ("raw", "processed"):
            raise BadInput("logprobs_mode must be 'raw' or 'processed'.")
        numerics = numerics_from_knobs(
            "hf rollout",
            settings["quantization"],
            settings["kv_cache_dtype"],
            settings["kv_scales"],
        )
        device = devices.resolve_device(str(settings["device"]), "--device")
        model = load_model(
            model_dir, settings["dtype"], settings["attn_implementation"], device, numerics
        )
        tf32 = devices.set_tf32(device, settings["allow_tf32"])
        # Sampling draws on the model's device: a GPU rollout samples on the GPU.
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
        work = [(sequence_id, prompt) for sequence_id, prompt, _ in trajectories(prompts, sampling)]
        results = []
        size = settings["batch_size"]
        for start in progress_bar(range(0, len(work), size), desc="hf rollout", unit="batch"):
            batch = work[start : start + size]
            try:
                with torch.no_grad():
                    results.extend(
                        _generate_batch(model, [p for _, p in batch], sampling, generator)
                    )
            except Exception as error:
                if not devices.is_out_of_memory(error):
                    raise
                devices.release_memory(device)
                where = (
                    f"rollout batch {start // size + 1} of {-(-len(work) // size)} "
                    f"({len(batch)} prompts, up to {sampling.max_tokens} new tokens)"
                )
                raise devices.out_of_memory(
                    device, where, f"--set batch_size (now {size}) or --max-tokens"
                ) from None
        main, other = (
            ("raw", "processed") if sampling.logprobs_mode == "raw" else ("processed", "raw")
        )
        applied = {
            **settings,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attn_implementation": model.config._attn_implementation,
            "kv_cache": True,
            "device": device,
            "allow_tf32": tf32["allow_tf32"],
        }
        table = table_from_sequences(
            "fixture",
            [sequence_id for sequence_id, _ in work],
            [prompt for _, prompt in work],
            [r["tokens"] for r in results],
            {
                "rollout": [r[main] for r in results],
                f"rollout_{other}": [r[other] for r in results],
            },
            finish_reasons=[r["finish_reason"] for r in results],
            metadata={
                "engine": {
                    "name": "hf",
                    "role": "rollout",
                    "versions": software_versions(device),
                },
                "dtype": applied["dtype"],
                "knobs": applied,
                "hardware": {**devices.hardware(device), **tf32},
                "sampling": sampling.as_dict(),
                "logprob_channels": {
                    "rollout": f"{main} logprob of the sampled token",
                    f"rollout_{other}": f"{other} logprob of the sampled token",
                },
                "model": model_metadata(model_dir, model.config),
                "position_id_rule": "arange",
                **numerics_metadata(model),
            },
        )
        # The most likely token of the raw distribution at each step (top-1 flip analysis).
        table.top_ids = np.array([t for r in results for t in r["top_id"]], dtype=np.int32)[:, None]
        table.top_logprobs = np.array(
            [lp for r in results for lp in r["top_logprob"]], dtype=np.float32
        )[:, None]
        if results and "routed" in results[0]:
            table.routed_experts = np.concatenate([r["routed"] for r in results])
            config = json.loads((Path(model_dir) / "config.json").read_text())
            table.metadata["routing"] = routing_metadata(config, "hf rollout (decode)")
        return table


def _generate_batch(model, prompts: list[list[int]], sampling: SamplingParams, generator):
    """Decode one left-padded batch with a KV cache; per row: tokens, raw and processed logprobs."""
    import torch

    device = generator.device
    width = max(len(p) for p in prompts)
    pad_id = model.config.pad_token_id or 0
    eos_id = None if sampling.ignore_eos else model.config.eos_token_id
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tap = router_tap(model)
    if tap is not None:  # MoE: the experts every forward of this decode chose
        tap.begin_decode()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
    )
    rows = [
        {
            "tokens": [],
            "raw": [],
            "processed": [],
            "top_id": [],
            "top_logprob": [],
            "finish_reason": "length",
        }
        for _ in prompts
    ]
    done = np.zeros(len(prompts), dtype=bool)
    next_position = position_ids[:, -1] + 1
    for _ in range(sampling.max_tokens):
        logits = out.logits[:, -1, :].float()
        raw = logits.log_softmax(-1)
        if sampling.temperature == 0:  # greedy: nothing is processed
            processed, token = raw, raw.argmax(-1)
        else:
            processed = process_logits(
                logits, sampling.temperature, sampling.top_k, sampling.top_p
            ).log_softmax(-1)
            token = torch.multinomial(processed.exp(), 1, generator=generator).squeeze(-1)
        top_id = raw.argmax(-1)
        # Everything a row records this step, copied off the device once.
        step = (
            torch.stack(
                [
                    token.double(),
                    top_id.double(),
                    raw.gather(-1, token[:, None])[:, 0].double(),
                    processed.gather(-1, token[:, None])[:, 0].double(),
                    raw.gather(-1, top_id[:, None])[:, 0].double(),
                ],
                dim=1,
            )
            .cpu()
            .numpy()
        )
        for i in np.flatnonzero(~done):
            t = int(step[i, 0])
            rows[i]["top_id"].append(int(step[i, 1]))
            rows[i]["top_logprob"].append(float(np.float32(step[i, 4])))
            rows[i]["tokens"].append(t)
            rows[i]["raw"].append(float(np.float32(step[i, 2])))
            rows[i]["processed"].append(float(np.float32(step[i, 3])))
            if eos_id is not None and t == eos_id:
                rows[i]["finish_reason"] = "stop"
                done[i] = True
        if bool(done.all()):
            break
        still = torch.from_numpy(~done).to(device)
        attention_mask = torch.cat([attention_mask, still.long()[:, None]], dim=1)
        out = model(
            input_ids=token.masked_fill(~still, pad_id)[:, None],
            attention_mask=attention_mask,
            position_ids=next_position[:, None],
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        next_position = next_position + 1
    if tap is not None:
        routed = tap.finish_decode([len(p) for p in prompts], [len(r["tokens"]) for r in rows])
        for row, routing in zip(rows, routed, strict=True):
            row["routed"] = routing
    return rows


def _flag(value) -> bool:
    text = str(value).strip().lower()
    if isinstance(value, bool) or text in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value if isinstance(value, bool) else text in ("1", "true", "yes", "on")
    raise ValueError(f"allow_tf32={value!r}: expected true or false")
