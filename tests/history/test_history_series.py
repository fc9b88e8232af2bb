"""Series that hold across nights and engine upgrades (issue 43): what never splits a series,
baseline segments per engine build from the first night, engine builds named with their
stacks, and the migration that re-keys a history recorded under the older rules."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

import pytest
from pipeline.db.models import Alert, Case, Comparison, EngineBuild, MetricValue, Series
from sqlalchemy import func, select, text

from pipeline.history import keys
from pipeline.history.attribution import summary
from pipeline.history.database import _create_engine, open_history, schema_revision
from pipeline.history.rekey import rekey
from support.synthetic_runs import BASE_METRICS, pair_report, write_run
from tests.history.test_history import alerts, record, statuses_of

START = datetime(2026, 3, 1, 3, 0)


def night_report(night: int, run_dir, *, version="0.32.0", scale=1.0, eager=False) -> dict:
    """A vLLM nightly as vLLM records it: the seed among the applied knobs and in sampling,
    plus an id, an output path, a timestamp and a request uuid that differ every night."""
    report = pair_report(
        rollout_version=version,
        metrics={m: BASE_METRICS[m] * scale for m in ("max_abs_diff", "mean_abs_diff", "k3")},
    )
    rollout = report["metadata"]["fixture"]
    rollout["sampling"]["seed"] = 1000 + night
    rollout["knobs"] |= {
        "seed": 1000 + night,
        "enforce_eager": eager,
        "run_id": f"nightly-{night}",
        "output_dir": f"{run_dir}/rollout",
        "scheduler": {"sampling_seed": night, "started": f"2026-03-0{night + 1}T03:00:00"},
        "request": f"{night:08x}-0000-4000-8000-000000000000",
        # reached on whichever runner was free that night
        "url": f"http://gpu-{night}.cluster:{30000 + night}",
        "server": {"host": f"gpu-{night}", "master_port": 29500 + night, "pid": 4000 + night},
        "device": f"cuda:{night % 8}",  # whichever GPU of the node was free
        "chat_template": f"/tmp/tmp{night}abc/template.jinja",
    }
    report["metadata"]["replay"]["knobs"]["generator_seed"] = night
    return report


def nights(tmp_path, count: int, first: int = 0, **kwargs) -> list:
    out = []
    for night in range(first, first + count):
        run_dir = tmp_path / f"night-{night}"
        out.append(
            write_run(
                run_dir,
                {"vllm-hf-bf16": night_report(night, run_dir, **kwargs)},
                started_at=START + timedelta(days=night),
            )
        )
    return out


def series_count(url) -> int:
    history = open_history(url)
    try:
        with history.read() as session:
            return session.scalar(select(func.count()).select_from(Series))
    finally:
        history.dispose()


def test_seeds_ids_outputs_timestamps_and_addresses_never_split_a_series(history_url, tmp_path):
    record(history_url, *nights(tmp_path, 4))
    assert series_count(history_url) == 1
    # a knob that changes what is compared still starts a new series
    record(history_url, *nights(tmp_path / "eager", 1, first=4, eager=True))
    assert series_count(history_url) == 2


def test_an_alert_names_the_knob_that_changed_not_the_seeds_and_addresses(history_url, tmp_path):
    """A named comparison (its knobs off the key) whose sixth night turned enforce_eager on
    and drifts 3x: the attribution is that knob alone. The seed, run id, output directory,
    timestamps, server URL, host, port and GPU index also changed that night, as every night."""
    runs = []
    for night in range(6):
        run_dir = tmp_path / f"night-{night}"
        report = night_report(night, run_dir, scale=3.0 if night == 5 else 1.0, eager=night == 5)
        runs.append(write_run(run_dir, {"vllm-hf-bf16": report}, cases={"vllm-hf-bf16": "nightly"},
                              started_at=START + timedelta(days=night)))  # fmt: skip
    record(history_url, *runs)
    assert series_count(history_url) == 1
    (alert,) = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert summary(alert["attribution"]) == "knobs: rollout.enforce_eager False -> True"


@pytest.mark.parametrize(
    ("name", "value", "run_specific"),
    [
        ("seed", 3, True),
        ("sampling_seed", 3, True),
        ("rollout.scheduler.seed_offset", 1, True),
        ("run_id", "a", True),
        ("output_dir", "/x", True),
        ("log_path", "/x", True),
        ("created_at", "x", True),
        ("note", "2026-03-01T03:00:00+00:00", True),  # a timestamp whatever its name
        ("tag", "123e4567-e89b-42d3-a456-426614174000", True),  # a uuid whatever its name
        ("chat_template", "/runs/n1/template.jinja", True),  # inside the run: an output
        ("chat_template", "/models/template.jinja", False),
        ("url", "http://10.0.0.7:30000", True),
        ("base_url", "x", True),
        ("server.master_port", 29500, True),
        ("dist_init_addr", "10.0.0.7:5000", True),
        ("hostname", "gpu-17", True),
        ("pid", 4242, True),
        ("router", "grpc://10.0.0.7:9000", True),  # an address whatever its name
        ("chat_template", "/tmp/tmpab12/template.jinja", True),  # a temporary directory
        ("enforce_eager", True, False),
        ("tensor_parallel_size", 2, False),
        ("served_model", "Qwen/Qwen3-8B", False),
        ("max_model_len", 4096, False),
        ("attention_backend", "FLASH_ATTN", False),
        ("kv_cache_dtype", "fp8", False),
    ],
)
def test_what_is_run_specific(name, value, run_specific):
    assert keys.run_specific(name, value, "/runs/n1") is run_specific


def test_a_device_index_is_not_part_of_a_case():
    knobs = {"device": "cuda:3", "server": {"device": "CUDA:0"}, "dtype": "cuda:x"}
    assert keys.case_knobs(knobs) == {"device": "cuda", "server": {"device": "cuda"},
                                      "dtype": "cuda:x"}  # fmt: skip


def test_an_engine_build_names_its_stack():
    versions = {"torch": "2.13.0", "transformers": "5.19.0", "deepspeed": "0.18.1",
                "megatron": "0.15.0", "vllm": "0.32.0", "sglang": "0.5.23",
                "fsdp": "FSDP2 (torch 2.13.0)", "numpy": "2.3.0", "lpx": "0.1.0"}  # fmt: skip
    side = lambda name: {"engine": {"name": name, "versions": versions}}  # noqa: E731
    assert keys.engine_version(side("fsdp")) == "FSDP2 (torch 2.13.0), transformers 5.19.0"
    assert keys.engine_version(side("deepspeed")) == ("0.18.1, torch 2.13.0, transformers 5.19.0")
    assert keys.engine_version(side("megatron")) == "0.15.0, torch 2.13.0, transformers 5.19.0"
    assert keys.engine_version(side("vllm")) == "0.32.0, torch 2.13.0"
    assert keys.engine_version(side("sglang")) == "0.5.23, torch 2.13.0"
    assert keys.engine_version(side("hf")) == "5.19.0, torch 2.13.0"
    # as a dump from another tool spells a release
    for spelled in ("megatron-core", "megatron_core", "Megatron.Core"):
        other = {"engine": {"name": "megatron", "versions": {spelled: "0.15.0", "torch": "2.9"}}}
        assert keys.engine_version(other) == "0.15.0, torch 2.9"
    other = {"engine": {"name": "sglang", "versions": {"SGLang": "0.5.23"}}}
    assert keys.engine_version(other) == "0.5.23"
    assert keys.engine_version({"engine": {"name": "vllm", "versions": {}}}) == "unknown"


def test_a_transformers_upgrade_under_fsdp_is_an_upgrade(history_url, tmp_path):
    runs = []
    for night in range(7):
        report = pair_report(
            replay="fsdp",
            metrics={"mean_abs_diff": BASE_METRICS["mean_abs_diff"] * (3 if night >= 5 else 1)},
        )
        versions = report["metadata"]["replay"]["engine"]["versions"]
        versions |= {"fsdp": "FSDP2 (torch 2.13.0+cpu)"}
        versions["transformers"] = "5.21.0" if night >= 5 else "5.19.0"
        runs.append(
            write_run(tmp_path / f"n{night}", {"p": report}, started_at=START + timedelta(night))
        )
    record(history_url, *runs)
    (alert,) = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert summary(alert["attribution"]) == (
        "replay fsdp: fsdp transformers 5.19.0 -> transformers 5.21.0 (FSDP2 (torch 2.13.0+cpu))"
    )


def upgrade_history(tmp_path, before: int, after: int, factor: float) -> list:
    """``before`` nights of vLLM 0.31.0, then ``after`` of 0.32.0 whose drift is ``factor``
    times the old (3 % night-to-night noise on every night)."""
    import numpy as np

    rng = np.random.default_rng(before * 10 + after)
    runs = []
    for night in range(before + after):
        upgraded = night >= before
        noise = float(np.exp(rng.normal(0, 0.03)))
        report = pair_report(
            rollout_version="0.32.0" if upgraded else "0.31.0",
            metrics={
                m: BASE_METRICS[m] * noise * (factor if upgraded else 1.0)
                for m in ("max_abs_diff", "mean_abs_diff", "k3", "p99_abs_diff")
            },
        )
        runs.append(
            write_run(
                tmp_path / f"night-{night}", {"p": report}, started_at=START + timedelta(night)
            )
        )
    return runs


@pytest.mark.parametrize(("before", "after"), [(3, 3), (1, 5), (5, 1)])
def test_an_upgrade_in_the_first_nights_is_judged_and_named(history_url, tmp_path, before, after):
    """A 3x step at the upgrade: an alert from the upgrade night on, attributed to it, even
    with fewer than the 5 points a baseline needs before it (the old build's nights are the
    reference the new build's first nights are judged against)."""
    record(history_url, *upgrade_history(tmp_path, before, after, 3.0))
    (alert,) = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert alert["first_bad"]["run"] == before + 1
    assert alert["last_good"]["run"] == before
    assert alert["kind"] == ("regression" if after >= 2 else "suspicious")
    assert summary(alert["attribution"]).startswith("rollout vllm: vllm 0.31.0 -> 0.32.0")
    statuses = statuses_of(history_url, "mean_abs_diff")
    assert statuses[:before] == ["insufficient_data"] * before
    assert statuses[before:] == ["suspicious"] + ["regression"] * (after - 1)


@pytest.mark.parametrize(("before", "after"), [(3, 3), (1, 5)])
def test_an_upgrade_without_drift_in_the_first_nights_raises_nothing(
    history_url, tmp_path, before, after
):
    record(history_url, *upgrade_history(tmp_path, before, after, 1.0))
    assert alerts(history_url) == []
    statuses = statuses_of(history_url, "mean_abs_diff")
    # judged against the old build's nights from the upgrade on, then its own baseline
    assert statuses[:before] == ["insufficient_data"] * before
    assert set(statuses[before:]) == {"ok"}


def judged(session, series) -> list[str]:
    """The series' mean_abs_diff statuses, night by night."""
    return session.scalars(
        select(MetricValue.status)
        .where(MetricValue.series_id == series.id, MetricValue.name == "mean_abs_diff")
        .order_by(MetricValue.started_at)
    ).all()


def test_a_history_keyed_by_the_older_rules_is_re_keyed_and_merged(
    history_url, tmp_path, monkeypatch
):
    """Recorded with the rules before issue 43 (every knob in the key, a build's version
    its release alone): four nights with a new seed each made four series and builds named
    "0.32.0". Opening it with this lpx migrates it: one series with every point and metric
    value, builds named with their stacks, judged again; re-keying again changes nothing."""
    with monkeypatch.context() as old_rules:
        old_rules.setattr(keys, "case_knobs", lambda knobs, run_dir=None: knobs)
        old_rules.setattr(keys, "ENGINE_STACKS", {})
        record(history_url, *nights(tmp_path, 6))
    assert series_count(history_url) == 6
    engine = _create_engine(history_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0006'"))
        connection.execute(text("ALTER TABLE comparisons DROP COLUMN workload"))  # 0006's
        versions = connection.execute(text("SELECT version FROM engine_builds")).scalars().all()
    engine.dispose()
    assert sorted(versions) == ["0.32.0", "5.19.0"]

    history = open_history(history_url)  # migrates to head
    assert schema_revision(history) == "0010"
    with history.read() as session:
        (series,) = session.scalars(select(Series)).all()
        assert session.scalar(select(func.count()).select_from(Case)) == 1
        assert (
            session.scalar(
                select(func.count())
                .select_from(Comparison)
                .where(Comparison.series_id == series.id)
            )
            == 6
        )
        assert judged(session, series) == ["insufficient_data"] * 5 + ["ok"]  # as one series
        assert sorted(session.scalars(select(EngineBuild.version)).all()) == [
            "0.32.0, torch 2.13.0+cpu",
            "5.19.0, torch 2.13.0+cpu",
        ]
        assert session.scalar(select(func.count()).select_from(Alert)) == 0
    with history.write() as session:
        again = rekey(session)
    assert again == {"builds": 0, "cases": 0, "series": 0, "merged_series": []}
    history.dispose()
    # a new night after the migration joins the merged series
    record(history_url, *nights(tmp_path / "later", 1, first=6))
    assert series_count(history_url) == 1


def test_a_history_keyed_before_the_address_rule_is_merged(history_url, tmp_path, monkeypatch):
    """Recorded under 0007's rules (a server's URL, host and port in the key): a series per
    night. Migration 0008 merges them into one, judged as one; a later night joins it."""
    addresses = keys.RUN_SPECIFIC_SUFFIXES.index("_url")
    with monkeypatch.context() as old_rules:
        old_rules.setattr(keys, "RUN_SPECIFIC_NAMES",
                          keys.RUN_SPECIFIC_NAMES - {"url", "host", "master_port", "pid"})  # fmt: skip
        old_rules.setattr(keys, "RUN_SPECIFIC_SUFFIXES", keys.RUN_SPECIFIC_SUFFIXES[:addresses])
        old_rules.setattr(keys, "_RUN_SPECIFIC_VALUE", re.compile(r"^\d{4}-\d{2}-\d{2}T"))
        record(history_url, *nights(tmp_path, 6))
    assert series_count(history_url) == 6
    engine = _create_engine(history_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0007'"))
    engine.dispose()

    history = open_history(history_url)  # migrates to head
    assert schema_revision(history) == "0010"
    with history.read() as session:
        (series,) = session.scalars(select(Series)).all()
        assert judged(session, series) == ["insufficient_data"] * 5 + ["ok"]  # as one series
    history.dispose()
    record(history_url, *nights(tmp_path / "later", 1, first=6))
    assert series_count(history_url) == 1


def tokens_night(run_dir, night, ids, rollout, train, version):
    """A run whose pair's report and tokens.parquet hold exactly these tokens: the report's
    metrics are compare's own over them, and its workload digest is theirs."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.compare.metrics import batch_metrics

    sequences, length = ids.shape
    names = [f"{i}-0" for i in range(sequences)]
    measured = batch_metrics(train.ravel(), rollout.ravel(), 0.1)
    report = pair_report(
        rollout_version=version,
        sequence_ids=names,
        metrics={k: v for k, v in measured.items() if k in BASE_METRICS},
    )
    report["workload"] = {
        "prompt_set": "sha256:" + "ef" * 32,
        "tokens_digest": hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest(),
        "sequences": sequences,
        "completion_tokens": ids.size,
    }
    write_run(run_dir, {"p": report}, started_at=START + timedelta(days=night))
    pq.write_table(
        pa.table(
            {
                "sequence_id": pa.array(np.repeat(names, length)).dictionary_encode(),
                "position": np.tile(np.arange(length, dtype=np.int32), sequences),
                "region": pa.array(["completion"] * ids.size).dictionary_encode(),
                "token_id": ids.ravel().astype(np.int32),
                "logprob_rollout": rollout.ravel().astype(np.float32),
                "logprob_train": train.ravel().astype(np.float32),
                "diff": (train - rollout).ravel(),
            }
        ),
        run_dir / "p" / "tokens.parquet",
    )
    return run_dir


def upgrade_with_new_tokens(tmp_path, numerics_moved: bool) -> list:
    """Five nights of vLLM 0.31.0 on the same tokens (a fixed seed), then two of 0.32.0 that
    sample other tokens on half the sequences after position 5. The new tokens drift more
    (rarer tokens); where ``numerics_moved`` the shared tokens' drift doubles too."""
    import numpy as np

    rng = np.random.default_rng(7)
    sequences, length = 8, 64
    ids = rng.integers(3, 500, (sequences, length))
    rollout = -rng.exponential(2.0, (sequences, length))
    drift = rng.normal(0, 0.004, (sequences, length))
    new_ids = ids.copy()
    new_ids[4:, 5:] = rng.integers(3, 500, (4, length - 5))
    new_rollout = rollout.copy()
    new_rollout[4:, 5:] = -rng.exponential(4.0, (4, length - 5))
    new_drift = drift * (2.0 if numerics_moved else 1.0)
    new_drift[4:, 5:] = rng.normal(0, 0.02, (4, length - 5))
    runs = []
    for night in range(7):
        upgraded = night >= 5
        chosen = (new_ids, new_rollout, new_drift) if upgraded else (ids, rollout, drift)
        runs.append(
            tokens_night(
                tmp_path / f"night-{night}",
                night,
                chosen[0],
                chosen[1],
                chosen[1] + chosen[2],
                "0.32.0" if upgraded else "0.31.0",
            )
        )
    return runs


def workloads(url) -> list:
    history = open_history(url)
    try:
        with history.read() as session:
            return session.scalars(select(Comparison.workload).order_by(Comparison.id)).all()
    finally:
        history.dispose()


def test_an_upgrade_that_only_changed_the_tokens_says_workload_changed(history_url, tmp_path):
    record(history_url, *upgrade_with_new_tokens(tmp_path, numerics_moved=False))
    statuses = statuses_of(history_url, "mean_abs_diff")
    assert statuses == ["insufficient_data"] * 5 + ["workload_changed", "ok"]
    assert alerts(history_url) == []
    found = workloads(history_url)
    assert found[4]["agreement"] == {"same_tokens": True, "fraction_in_common": 1.0}
    upgrade = found[5]["agreement"]
    assert upgrade["same_tokens"] is False
    assert upgrade["sequences_identical"] == 4 and upgrade["sequences_in_both"] == 8
    assert upgrade["tokens_in_common"] == 4 * 64 + 4 * 5
    assert upgrade["first_divergence"] == {"sequence_id": "4-0", "position": 5}
    shared = upgrade["shared"]
    assert shared["current"]["mean_abs_diff"] == shared["previous"]["mean_abs_diff"]
    assert upgrade["new_tokens"]["mean_abs_diff"] > 3 * shared["current"]["mean_abs_diff"]
    assert found[6]["agreement"]["same_tokens"] is True


def test_a_numeric_change_riding_with_new_tokens_is_still_a_regression(history_url, tmp_path):
    record(history_url, *upgrade_with_new_tokens(tmp_path, numerics_moved=True))
    assert statuses_of(history_url, "mean_abs_diff")[5:] == ["suspicious", "regression"]
    (alert,) = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert summary(alert["attribution"]).startswith("rollout vllm: vllm 0.31.0 -> 0.32.0")
    shared = workloads(history_url)[5]["agreement"]["shared"]
    assert shared["current"]["mean_abs_diff"] == pytest.approx(
        2 * shared["previous"]["mean_abs_diff"], rel=1e-3
    )


def test_the_series_page_shows_the_tokens_at_the_upgrade(tmp_path):
    from support.helpers import run_lpx

    url = f"sqlite:///{tmp_path / 'history.db'}"
    record(url, *upgrade_with_new_tokens(tmp_path / "runs", numerics_moved=False))
    assert run_lpx("report", "--db", url, "--out", tmp_path / "site").exit_code == 0
    (page,) = (tmp_path / "site" / "series").glob("*.html")
    html = page.read_text()
    assert (
        "54% of tokens in common, 4/8 sequences identical, first divergence 4-0 @ 5; "
        "shared tokens mean |d|"
    ) in html
    assert html.count("same tokens") >= 5


def test_new_tokens_after_a_bad_night_do_not_clear_a_regression():
    """Tonight's shared tokens agree with last night's, but last night was already outside
    the band: that says nothing about the numerics coming back. Only a healthy night before
    makes a point workload_changed."""
    from pipeline.history.detection import DetectionConfig, metric_spec, new_state, step

    config, spec = DetectionConfig(), metric_spec("mean_abs_diff")
    state = new_state()
    for night in range(5):
        state, _ = step(state, night, 0.004, spec, 0.1, config, build="a")
    state, first = step(state, 5, 0.012, spec, 0.1, config, build="b")
    assert first.status == "suspicious"
    state, second = step(state, 6, 0.013, spec, 0.1, config, build="b",
                         same_tokens=(0.012, 0.012))  # fmt: skip
    assert second.status == "regression"
    healthy = new_state()
    for night in range(5):
        healthy, _ = step(healthy, night, 0.004, spec, 0.1, config, build="a")
    _, moved = step(healthy, 5, 0.012, spec, 0.1, config, build="b", same_tokens=(0.004, 0.004))
    assert moved.status == "workload_changed"
