from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import RANKS, device_option, knob_options, parse_knobs

ENGINES = ("hf", "fsdp", "megatron")


@click.command("serve", short_help="Serve selected-token logprobs over HTTP (/score).")
@click.option("--engine", type=click.Choice(ENGINES), default="hf", show_default=True,
              help="Engine that scores: hf in this process, fsdp or megatron on --nproc "
              "ranks. Its knobs (--set) are its replay knobs (`lpx engines`).")  # fmt: skip
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Model directory; a weight store (lpx weights publish): its latest, pulled and "
    "verified; or a publish directory holding `latest`.",
)
@click.option("--nproc", type=RANKS, default=1, show_default=True,
              help="Ranks of a distributed engine (fsdp, megatron), behind one endpoint; one "
              "per GPU on CUDA, auto = every visible GPU.")  # fmt: skip
@device_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 for every interface.")  # fmt: skip
@click.option("--port", type=click.IntRange(0, 65535), default=8400, show_default=True,
              help="TCP port, 1-65535; 0 takes a free one, named in the start-up line. "
              "Bound before the model loads: a port in use fails at once.")  # fmt: skip
@click.option("--weight-version", help="Name of the weights loaded first [default: the "
              "directory's WEIGHT_VERSION file, else the weights fingerprint].")  # fmt: skip
@click.option("--token-budget", type=click.IntRange(1), default=16384, show_default=True,
              help="Padded tokens per scored batch.")  # fmt: skip
@click.option("--max-batch", type=click.IntRange(1), default=64, show_default=True,
              help="Sequences per scored batch.")  # fmt: skip
@click.option("--max-wait-ms", type=click.FloatRange(0), default=5.0, show_default=True,
              help="How long a batch waits to fill.")  # fmt: skip
@click.option("--max-queue", type=click.IntRange(1), default=4096, show_default=True,
              help="Queued sequences before 429.")  # fmt: skip
@click.option("--max-body-bytes", type=click.IntRange(1), default=128 * 2**20,
              show_default=True, help="Largest request body; a larger one is answered 413.")  # fmt: skip
@click.option("--reject-when-paused", is_flag=True,
              help="Answer 503 + Retry-After while paused or updating, instead of holding requests.")  # fmt: skip
@click.option("--batch-invariant", is_flag=True,
              help="Score each sequence in its own forward, unpadded: its logprobs are "
              "bit-identical to the same request scored alone, whatever else is queued. "
              "Without it, a sequence that shares a batch can move by a few ulps (/health "
              "says how far).")  # fmt: skip
@knob_options
def serve(engine, model_dir, nproc, device, host, port, weight_version, token_budget, max_batch, max_wait_ms,
          max_queue, max_body_bytes, reject_when_paused, batch_invariant, knob_pairs):  # fmt: skip
    """Serve selected-token logprobs over HTTP: teacher-forced scoring of (prompt ids,
    completion ids) beside a rollout (the old_log_prob server of an async RL pipeline).

    Endpoints: POST /score, /pause, /resume, /update_weights; GET /health, /metrics. Every
    response carries the weight version and the held weights' fingerprint. Knobs (--set) are
    the engine's (dtype, attn_implementation, reduce_dtype for fsdp, ...). Schema and examples:
    docs/logprob-server.md.

    \b
    Example:
      lpx serve --model models/tiny --port 8400 --set dtype=float32
      lpx serve --engine fsdp --nproc 2 --model models/tiny --port 8401
      lpx serve --model models/policy --device cuda:0 --set dtype=bf16 --port 8402
      lpx serve --model models/tiny --port 8403 --batch-invariant
      curl -s localhost:8400/score -H 'Content-Type: application/json' \\
        -d '{"sequences": [{"prompt_ids": [1, 5], "completion_ids": [7, 9]}]}'
    """
    import uvicorn

    from pipeline.errors import BadInput
    from pipeline.serve.app import ServeSettings, create_app
    from pipeline.serve.bind import bind_listener, bound_port, url_host
    from pipeline.serve.model_slot import ModelSlot, resolve_model_dir

    if engine == "hf" and nproc != 1:
        raise BadInput(f"--nproc {nproc}: the hf engine serves from one process; use "
                       "--engine fsdp or megatron for ranks.")  # fmt: skip
    # before the model loads (seconds to minutes): a port in use fails at once
    listener = bind_listener(host, port)
    port = bound_port(listener)
    resolved = resolve_model_dir(model_dir)
    knobs = {"device": device, **parse_knobs(knob_pairs)}
    if batch_invariant:
        knobs["micro_batch_size"] = one_sequence_per_forward(knobs)
    knobs.setdefault("micro_batch_size", str(max_batch))
    settings = ServeSettings(
        token_budget=token_budget,
        max_batch=max_batch,
        max_wait_s=max_wait_ms / 1000,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        reject_when_paused=reject_when_paused,
        batch_invariant=batch_invariant,
    )
    if engine != "hf":
        from dataclasses import asdict

        from pipeline.serve.distributed import launch

        # rank 0 binds the port itself: release it (a free port taken by 0 stays this one)
        listener.close()
        options = {"model": str(resolved), "knobs": knobs, "version": weight_version,
                   "host": host, "port": port, "settings": asdict(settings)}  # fmt: skip
        raise SystemExit(launch(engine, nproc, options))
    slot = ModelSlot(resolved, knobs, weight_version)
    click.echo(
        f"lpx serve: {engine} {slot.settings.dtype} on {slot.settings.device}, {resolved} (version "
        f"{slot.version.weight_version}) on http://{url_host(host)}:{port}",
        err=True,
    )
    config = uvicorn.Config(create_app(slot, settings), host=host, port=port, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])


def one_sequence_per_forward(knobs: dict) -> str:
    """The micro-batch of --batch-invariant: 1, so that no sequence is padded to, or shares a
    matmul with, another; a contradicting --set micro_batch_size is refused."""
    from pipeline.errors import BadInput

    given = knobs.get("micro_batch_size")
    if given is not None and given.strip() != "1":
        raise BadInput(
            f"--batch-invariant scores one sequence per forward, so --set micro_batch_size="
            f"{given} contradicts it; drop one of the two."
        )
    return "1"
