from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import COUNT, OUTPUT_FILE, db_option, device_option


@click.command(short_help="Measure the model's precision noise floor on a fixture.")
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model directory [default: the one recorded in the fixture]; it must hold the weights "
    "the fixture was rolled out with.",
)
@click.option(
    "--allow-model-mismatch",
    is_flag=True,
    help="Calibrate with --model although its weights are not the fixture's (a stale "
    "checkpoint, on purpose); calibration.json records the mismatch.",
)
@click.option(
    "--engine",
    default="hf",
    show_default=True,
    help="Reference engine that re-scores the tokens (hf).",
)
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    help="A precision the comparisons will meet, repeatable: a dtype, or a dtype with "
    "reduced-precision numerics (bf16+fp8, bf16+fp8-block+kv=fp8_e4m3; "
    "docs/reduced-precision.md) [default: the fixture's precision and bf16]; fp32 is always "
    "measured, TF32 on CUDA, and the fixture's own reduced-precision numerics where it "
    "declares any. An fp16 from the fixture is left out "
    "on a CPU without fp16 arithmetic; name it here to measure it anyway.",
)
@click.option("--sequences", type=COUNT, default=32, show_default=True,
              help="Fixture sequences re-scored (spread evenly over it).")  # fmt: skip
@click.option(
    "--out",
    "out_path",
    type=OUTPUT_FILE,
    help="Where to write it [default: calibration.json beside the fixture]; an existing file "
    "there is replaced only when lpx wrote it.",
)
@db_option("calibrate")
@click.option(
    "--reuse/--no-reuse",
    default=True,
    show_default=True,
    help="With a history (--db): take a stored calibration of the same weights, engine, "
    "layout, hardware and libraries instead of re-scoring; a new one is stored there.",
)
@device_option
def calibrate(
    fixture_path,
    model_dir,
    allow_model_mismatch,
    engine,
    dtypes,
    sequences,
    out_path,
    db,
    reuse,
    device,
) -> None:
    """Measure the model's own precision noise floor on the fixture's tokens.

    The reference engine re-scores a sample of the fixture's sequences in fp32 and in each
    given precision (TF32 too on CUDA; a reduced-precision rollout's FP8/INT8 weights and KV
    cache emulated exactly) three ways: prefill with SDPA attention, prefill with eager
    attention in other micro-batches, and teacher-forced decoding with a KV cache of up to 16
    of those sequences. How far those correct scorings differ, per bucket of token
    surprisal and position, is the floor `lpx compare` judges drift against (it finds
    calibration.json beside the replay or the fixture, or take --calibration).

    \b
    Example:
      lpx calibrate run/fixture.parquet --dtype bf16 --sequences 32
      lpx calibrate run/fp8-fixture.parquet   # the rollout's FP8 numerics against bf16
      lpx compare run/fixture.parquet run/replay-bf16.parquet --out run/cmp   # uses it
    """
    from pipeline.belonging import check_model
    from pipeline.calibrate.run import CALIBRATION_FILE
    from pipeline.calibrate.run import calibrate as run_calibration
    from pipeline.compare.calibrated import side_precision
    from pipeline.contracts.calibration import Calibration, calibration_text
    from pipeline.contracts.numerics import canonical_precision, without_tf32
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table, validate_table
    from pipeline.paths import check_output, check_replaceable, write_text_atomic

    out_path = out_path or Path(fixture_path).parent / CALIBRATION_FILE
    check_output(out_path, [fixture_path])
    check_replaceable(out_path, "--out")  # the default beside the fixture too
    if engine != "hf":
        raise BadInput(
            f"--engine {engine}: calibration re-scores with the reference engine, hf; the noise "
            "floor it measures is the model's, and compare applies it to any engine pair."
        )
    fixture = read_table(fixture_path, expect_kind="fixture")
    option = "--model" if model_dir else "the fixture's model"
    model_dir = model_dir or (fixture.metadata.get("model") or {}).get("path")
    if not model_dir:
        raise BadInput(f"{fixture_path}: records no model path; pass --model DIR.")
    check_model_dir(model_dir)
    # A floor measured on other weights would judge this fixture's replays by another
    # model's noise: refused unless asked for, and then written down.
    mismatch = check_model(
        fixture.metadata, fixture_path, Path(model_dir), allow_model_mismatch, option
    )
    validate_table(fixture, fixture_path, (fixture.metadata.get("model") or {}).get("vocab_size"))
    own = without_tf32(side_precision(fixture.metadata))
    try:
        wanted = [canonical_precision(d) for d in dtypes] or [own, "bfloat16"]
    except ValueError as error:
        raise BadInput(f"--dtype: {error}") from None
    if "+" in own:  # the rollout's own numerics: the pair every comparison of it meets
        wanted.append(own)
    wanted = list(dict.fromkeys(wanted))
    wanted = _without_emulated_fp16(wanted, asked=bool(dtypes), device=device)
    history = _history(db)
    result = None
    if history is not None and reuse:
        from pipeline.calibrate.run import calibration_key, precisions_for
        from pipeline.devices import resolve_device
        from pipeline.engines.metadata import model_metadata
        from pipeline.history.calibrations import find_calibration

        resolved = resolve_device(device)
        key = calibration_key(model_metadata(Path(model_dir)), resolved)
        result = find_calibration(history, key, precisions_for(wanted, resolved))
        if result is not None:
            click.echo(
                f"calibration: reused the one made {result['created_at']} (history)", err=True
            )
    if result is None:
        result = run_calibration(
            fixture,
            Path(model_dir),
            wanted,
            sequences,
            device,
            say=lambda m: click.echo(m, err=True),
        )
        if history is not None:
            from pipeline.history.calibrations import store_calibration

            with history.write() as session:
                store_calibration(session, result)
    if mismatch is not None:
        result = {**result, "allowed_mismatches": {"model": mismatch}}
    calibration = Calibration.model_validate(result)  # as compare reads it: a writer's bug fails
    write_text_atomic(out_path, calibration_text(calibration))
    means = ", ".join(
        f"{pair} mean |d| {floor.all.mean:.3g} (q999 {floor.all.q999:.3g})"
        for pair, floor in calibration.pairs.items()
    )
    click.echo(
        f"calibration: {calibration.sequences} sequences, {calibration.tokens} tokens; {means} "
        f"-> {out_path}"
    )


def _history(db: str | None):
    """The history when one is named (--db or LPX_DB); calibrating needs none."""
    if not db:
        return None
    from pipeline.history.database import open_history

    return open_history(db)


def _without_emulated_fp16(wanted: list[str], asked: bool, device: str) -> list[str]:
    """fp16 taken from the fixture is not measured where the CPU emulates it (823 s against
    fp32's 122 s at 16 x 1024 on an AMD EPYC); named with --dtype, it is,
    with a warning."""
    from pipeline.contracts.numerics import base_dtype
    from pipeline.devices import fp16_emulated, resolve_device

    why = any(base_dtype(d) == "float16" for d in wanted) and fp16_emulated(resolve_device(device))
    if not why:
        return wanted
    if asked:
        click.echo(f"calibrate: measuring float16 as asked, though {why}.", err=True)
        return wanted
    click.echo(
        f"calibrate: float16 left out: {why}. Comparisons of an fp16 side are judged on fixed "
        "limits until it is measured; pass --dtype fp16 to measure it anyway.",
        err=True,
    )
    return [d for d in wanted if base_dtype(d) != "float16"]
