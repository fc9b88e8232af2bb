"""Small helpers for tests: run the real CLI in-process and read its report."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import cli


def run_lpx(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def count(url: str, model, *where) -> int:
    """Rows of ``model`` (a pipeline.db.models class) in the history at ``url``."""
    from sqlalchemy import func, select

    from pipeline.history.database import open_history

    history = open_history(url)
    try:
        with history.read() as session:
            return session.scalar(select(func.count()).select_from(model).where(*where))
    finally:
        history.dispose()


def read_report(out_dir: Path) -> dict:
    """report.json, with the per-sequence rows and each finding's whole list read back from
    the sequences.parquet beside it (pipeline/contracts/sequences.py's loader)."""
    from pipeline.contracts.report import Report
    from pipeline.contracts.sequences import finding_sequences, sequence_rows

    path = Path(out_dir) / "report.json"
    data = json.loads(path.read_text())
    if isinstance(data.get("sequence_table"), dict):
        report = Report.model_construct(**data)
        data["sequences"] = sequence_rows(report, path)
        for finding, named in zip(data["diagnosis"], finding_sequences(report, path), strict=True):
            finding["sequences"] = named
    return data


def inline_report(out_dir: Path) -> dict:
    """report.json as lpx wrote it before sequences.parquet: every row and list inline."""
    data = read_report(out_dir)
    data.pop("sequence_table", None)
    for finding in data.get("diagnosis") or []:
        finding.pop("sequence_count", None)
        finding.pop("sequences_column", None)
    return data


def publish_one_step(tiny_model: Path, fixture_path: Path, root: Path) -> tuple[Path, Path]:
    """(store, stepped model dir): the tiny model published as version 1 and one AdamW step
    (lr 1e-3) on the fixture's first 8 sequences as version 2 (a delta)."""
    import shutil

    from pipeline.engines.hf.model import load_model
    from pipeline.faults import optimiser_step
    from pipeline.fixture.io import read_table
    from pipeline.weights.store import publish

    fixture = read_table(fixture_path)
    pairs = [(fixture.prompt_of(i), fixture.completion_of(i)) for i in range(8)]
    stepped = root / "v2"
    shutil.copytree(tiny_model, stepped)
    for weights in stepped.glob("*.safetensors"):
        weights.unlink()
    optimiser_step(load_model(tiny_model), pairs, 1e-3).save_pretrained(stepped)
    store = root / "store"
    publish(tiny_model, store)
    publish(stepped, store, delta=True)
    return store, stepped


@contextlib.contextmanager
def sglang_serving(python, model_dir, log, moe=False, env=None, **knobs):
    """A real SGLang server on ``model_dir`` for a module's tests, started as lpx starts one
    (engines/sglang/knobs.server_arguments); yields its URL. ~20 s on two cores."""
    from pipeline.engines.sglang.knobs import SGLangKnobs, server_arguments
    from pipeline.engines.sglang.server import running_server

    argv = server_arguments(SGLangKnobs.from_dict(knobs), model_dir, "cpu", 1024, moe)
    with running_server(python, argv, log, env) as server:
        yield server.url
