"""The weight-version store for real: the tiny model and small SGD-like steps of it published
full, as deltas and as xor-zlib deltas, pulled back byte for byte; publishers killed at each
step; pullers racing publishers; damaged stores refused with a message naming what broke;
retention; the `lpx weights` commands."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import BadInput
from pipeline.fingerprint import tensor_fingerprint
from pipeline.weights.store import (
    damaged_versions,
    is_store,
    latest_name,
    list_versions,
    materialize,
    publish,
    pull,
    read_manifest,
)
from support.helpers import run_lpx

ROOT = Path(__file__).resolve().parents[2]
ONE = "model.layers.0.self_attn.q_proj.weight"  # 128 x 128 float32: 64 KiB
THREE = ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", ONE)
OVERHEAD = 4096  # a safetensors header and WEIGHT_VERSION


def raw_tensors(model_dir: Path) -> dict[str, bytes]:
    """Every tensor's raw little-endian bytes, read with the safetensors library."""
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            tensors[name] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return tensors


def stepped(source: Path, out: Path, names, seed: int) -> Path:
    """A copy of ``source`` whose tensors ``names`` took a small step: t + 1e-4 * randn."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        tensors[name] = tensors[name] + 1e-4 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> list[Path]:
    """Three policy versions: the tiny model, one tensor stepped, then three more stepped."""
    root = tmp_path_factory.mktemp("policy")
    second = stepped(tiny_model, root / "v2", [ONE], seed=1)
    return [tiny_model, second, stepped(second, root / "v3", THREE, seed=2)]


def published(store: Path, models: list[Path], **options) -> Path:
    publish(models[0], store)
    for model in models[1:]:
        publish(model, store, **options)
    return store


def tensor_range(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes lie in a safetensors file, from its header."""
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    begin, end = json.loads(path.read_bytes()[8 : 8 + size])[name]["data_offsets"]
    return 8 + size + begin, 8 + size + end


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_full_version_pulls_back_byte_identical(tiny_model, tmp_path):
    store = tmp_path / "store"
    manifest = publish(tiny_model, store)
    source = raw_tensors(tiny_model)

    assert (manifest["name"], manifest["number"], manifest["kind"]) == ("1", 1, "full")
    assert manifest["parent"] is None and manifest["removed"] == []
    assert manifest["fingerprint"] == tensor_fingerprint(
        load_file(tiny_model / "model.safetensors").items()
    )
    assert {e["stored"] for e in manifest["tensors"].values()} == {"full"}
    assert len(manifest["tensors"]) == len(source) == 21
    version_dir = store / "versions" / "1"
    held = sum(p.stat().st_size for p in version_dir.iterdir() if p.name != "manifest.json")
    assert manifest["stored_bytes"] == held
    assert json.loads((store / "lpx-weights-store.json").read_text()) == {
        "format": "lpx-weights-store",
        "format_version": 1,
    }
    assert (store / "latest").read_text() == "1\n"
    assert list((store / ".staging").iterdir()) == []
    assert read_manifest(store, "1") == {k: v for k, v in manifest.items() if k != "removed"}
    assert is_store(store) and not is_store(tiny_model)

    (tmp_path / "pulled").mkdir()  # an empty directory is as good as a new one
    out = pull(store, into=tmp_path / "pulled")
    assert raw_tensors(out) == source
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in tiny_model.iterdir()] + ["WEIGHT_VERSION"]
    )
    for file in tiny_model.iterdir():
        assert (out / file.name).read_bytes() == file.read_bytes(), file.name
    assert (out / "WEIGHT_VERSION").read_text() == "1\n"


def test_delta_chains_pull_every_version_byte_identical(models, tmp_path):
    sources = [raw_tensors(m) for m in models]
    stores = {
        "delta": published(tmp_path / "delta", models, delta=True),
        "compress": published(tmp_path / "compress", models, compress=True),
    }
    for kind, store in stores.items():
        for name, source in zip(("1", "2", "3"), sources, strict=True):
            out = pull(store, name, into=tmp_path / f"{kind}-{name}")
            assert raw_tensors(out) == source, (kind, name)
            assert (out / "WEIGHT_VERSION").read_text() == f"{name}\n"
        assert [(v["name"], v["kind"], v["parent"]) for v in list_versions(store)] == [
            ("1", "full", None),
            ("2", "delta", "1"),
            ("3", "delta", "2"),
        ]

    one = len(sources[0][ONE])
    delta, compressed = read_manifest(stores["delta"], "2"), read_manifest(stores["compress"], "2")
    assert delta["tensors_changed"] == compressed["tensors_changed"] == 1
    assert [t for t, e in delta["tensors"].items() if e["stored"] != "parent"] == [ONE]
    assert delta["tensors"][ONE]["stored"] == "full"
    assert compressed["tensors"][ONE]["stored"] == "xor-zlib"
    assert one <= delta["stored_bytes"] < 2 * one + OVERHEAD
    assert compressed["stored_bytes"] < 0.9 * delta["stored_bytes"]
    third = read_manifest(stores["delta"], "3")
    assert third["tensors_changed"] == 3
    assert third["stored_bytes"] < 2 * sum(len(sources[0][t]) for t in THREE) + OVERHEAD
    full = read_manifest(stores["delta"], "1")["stored_bytes"]
    assert full > 20 * delta["stored_bytes"]  # 2 MB of weights against one 64 KiB tensor


def test_a_delta_is_published_full_when_there_is_nothing_to_take_it_from(tiny_model, tmp_path):
    store = tmp_path / "store"
    first = publish(tiny_model, store, delta=True)
    assert first["kind"] == "full" and "no earlier version" in first["full_reason"]

    grown = shutil.copytree(tiny_model, tmp_path / "grown")
    tensors = load_file(grown / "model.safetensors")
    tensors["extra.bias"] = torch.zeros(7)
    save_file(tensors, grown / "model.safetensors", metadata={"format": "pt"})
    second = publish(grown, store, compress=True)
    assert second["kind"] == "full" and "extra.bias is new" in second["full_reason"]
    assert {e["stored"] for e in second["tensors"].values()} == {"full"}
    assert raw_tensors(pull(store, into=tmp_path / "out")) == raw_tensors(grown)


def test_sharded_bfloat16_checkpoints_pull_as_one_loadable_file(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="300KB")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / file, sharded / file)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1e-2 * torch.randn_like(parameter))
    moved = tmp_path / "moved"
    model.save_pretrained(moved, max_shard_size="300KB")

    store = tmp_path / "store"
    publish(sharded, store)
    manifest = publish(moved, store, compress=True)
    assert manifest["kind"] == "delta"
    assert "model.safetensors.index.json" not in manifest["files"]
    merged = {}
    for shard in shards:
        merged.update(load_file(moved / shard))
    assert manifest["fingerprint"] == tensor_fingerprint(merged.items())
    assert {e["dtype"] for e in manifest["tensors"].values()} == {"BF16"}

    out = pull(store, "2", into=tmp_path / "out")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert raw_tensors(out) == raw_tensors(moved)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


KILLER = """
import os, signal, sys
from pathlib import Path
import numpy, torch  # loaded before the trap, so only the publish itself meets it
from pipeline.weights.store import publish

def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

setattr(os, sys.argv[3], killed)
publish(Path(sys.argv[1]), Path(sys.argv[2]), delta=True)
"""


@pytest.mark.parametrize(
    ("trap", "staged_manifests"),
    [
        ("fsync", [False]),  # the first durable write: tensors.safetensors staged, no manifest
        ("rename", [True]),  # the version is staged whole, not yet in versions/
        ("replace", []),  # in versions/, but `latest` has not moved
    ],
    ids=["mid-staging", "before-rename", "before-latest"],
)
def test_a_killed_publisher_leaves_the_previous_version_latest(
    models, tmp_path, trap, staged_manifests
):
    store = tmp_path / "store"
    publish(models[0], store)
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(models[1]), str(store), trap],
        cwd=ROOT,
        env={**os.environ, "LPX_PROGRESS": "0"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftovers = list((store / ".staging").iterdir()) + [
        p for p in (store / "versions").iterdir() if p.name != "1"
    ]
    assert leftovers  # the kill left something behind to clean up
    assert (store / "versions" / "2").is_dir() == (trap == "replace")
    staged = [p / "manifest.json" for p in (store / ".staging").iterdir()]
    assert [m.is_file() for m in staged] == staged_manifests

    assert latest_name(store) == "1"
    assert [v["name"] for v in list_versions(store)] == ["1"]
    assert raw_tensors(pull(store, into=tmp_path / "after-kill")) == raw_tensors(models[0])
    with pytest.raises(BadInput, match=r"no version '2'; it has 1 \(latest 1\)"):
        pull(store, "2", into=tmp_path / "unannounced")
    listed = run_lpx("weights", "ls", store)
    assert listed.exit_code == 0 and "1 versions" in listed.output

    manifest = publish(models[1], store, delta=True)
    assert (manifest["name"], manifest["number"], manifest["parent"]) == ("2", 2, "1")
    assert list((store / ".staging").iterdir()) == []
    assert sorted(p.name for p in (store / "versions").iterdir()) == ["1", "2"]
    assert raw_tensors(pull(store, into=tmp_path / "next")) == raw_tensors(models[1])


def test_pullers_racing_publishers_always_get_one_whole_version(models, tmp_path):
    store = tmp_path / "store"
    publish(models[0], store)
    order = [(models[1], {"delta": True}), (models[2], {"compress": True})]
    order += [(models[0], {"delta": True}), (models[1], {"compress": True})] * 6
    expected = {"1": raw_tensors(models[0])}
    for number, (model, _) in enumerate(order, start=2):
        expected[str(number)] = raw_tensors(model)
    seen, errors, done = [], [], threading.Event()

    def pull_latest(worker: int) -> None:
        count = 0
        while not done.is_set() or count < 2:
            out = tmp_path / f"pull-{worker}-{count}"
            try:
                pull(store, into=out)
                name = (out / "WEIGHT_VERSION").read_text().strip()
                seen.append((name, raw_tensors(out) == expected[name]))
            except Exception as error:  # collected: a failure in a thread must fail the test
                errors.append(repr(error))
            shutil.rmtree(out, ignore_errors=True)
            count += 1

    pullers = [threading.Thread(target=pull_latest, args=(w,)) for w in range(3)]
    for thread in pullers:
        thread.start()
    for model, options in order:
        publish(model, store, **options)
    done.set()
    for thread in pullers:
        thread.join()
    assert errors == []
    assert len(seen) >= 6 and all(matches for _, matches in seen), seen
    assert 2 <= len({name for name, _ in seen}) and {name for name, _ in seen} <= set(expected)
    assert latest_name(store) == str(len(order) + 1)


def test_concurrent_publishers_take_turns(models, tmp_path):
    store = tmp_path / "store"
    publish(models[0], store)
    results = []
    threads = [
        threading.Thread(target=lambda m=m: results.append(publish(m, store, delta=True)))
        for m in models[1:]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted((r["number"], r["parent"]) for r in results) == [(2, "1"), (3, "2")]
    by_source = {str(model.resolve()): model for model in models}
    for result in results:
        out = pull(store, result["name"], into=tmp_path / result["name"])
        assert raw_tensors(out) == raw_tensors(by_source[result["source"]])


def _tamper_changed_tensor(store):
    path = store / "versions" / "2" / "tensors.safetensors"
    flip_byte(path, tensor_range(path, ONE)[0] + 100)


def _tamper_inherited_tensor(store):
    path = store / "versions" / "1" / "tensors.safetensors"
    flip_byte(path, tensor_range(path, "lm_head.weight")[0] + 7)


def _tamper_file(store):
    path = store / "versions" / "2" / "config.json"
    path.write_text(path.read_text().replace("silu", "gelu"))


DAMAGE = {
    "changed tensor": (
        _tamper_changed_tensor,
        "2",
        r"versions/2/tensors.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight': "
        r"(its bytes do not match the manifest's sha256|the blob does not decompress)",
    ),
    "inherited tensor": (
        _tamper_inherited_tensor,
        "2",
        r"versions/1/tensors.safetensors: tensor 'lm_head.weight': its bytes do not match",
    ),
    "file": (_tamper_file, "2", r"versions/2/config.json: does not match the sha256"),
    "missing manifest": (
        lambda s: (s / "versions" / "1" / "manifest.json").unlink(),
        "1",
        r"versions/1/manifest.json: missing; version 1 is incomplete",
    ),
    "missing tensors file": (
        lambda s: (s / "versions" / "1" / "tensors.safetensors").unlink(),
        "2",
        r"versions/1/tensors.safetensors: missing; version 1 is incomplete",
    ),
    "missing file": (
        lambda s: (s / "versions" / "2" / "tokenizer.json").unlink(),
        "2",
        r"versions/2/tokenizer.json: missing; version 2 is incomplete",
    ),
    "broken chain": (
        lambda s: shutil.rmtree(s / "versions" / "1"),
        "2",
        r"version 2 takes tensor '.*' from its parent 1, which is not in the store",
    ),
    "unknown version": (lambda s: None, "7", r"no version '7'; it has 1, 2 \(latest 2\)"),
    "missing store": (
        lambda s: (s / "lpx-weights-store.json").unlink(),
        None,
        r"not a weight store \(no lpx-weights-store.json\)",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
@pytest.mark.parametrize("compress", [False, True], ids=["delta", "compressed"])
def test_pull_refuses_a_damaged_store_naming_what_broke(models, tmp_path, damage, compress):
    store = published(tmp_path / "store", models[:2], delta=True, compress=compress)
    tamper, version, message = DAMAGE[damage]
    tamper(store)
    with pytest.raises(BadInput, match=message):
        pull(store, version, into=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_publish_that_fails_leaves_the_store_as_it_was(models, tmp_path):
    store = published(tmp_path / "store", models[:2], delta=True)
    _tamper_changed_tensor(store)  # the compressed delta XORs against this damaged tensor
    with pytest.raises(BadInput, match=f"versions/2/tensors.safetensors: tensor '{ONE}'"):
        publish(models[2], store, compress=True)
    assert list((store / ".staging").iterdir()) == []
    assert sorted(p.name for p in (store / "versions").iterdir()) == ["1", "2"]
    assert latest_name(store) == "2"


def test_versions_without_a_manifest_are_reported_not_listed(models, tmp_path):
    store = published(tmp_path / "store", models, delta=True)
    (store / "versions" / "2" / "manifest.json").unlink()
    assert [v["name"] for v in list_versions(store)] == ["1", "3"]
    assert list(damaged_versions(store)) == ["2"]
    result = run_lpx("weights", "ls", store)
    assert result.exit_code == 0
    assert "warning: versions/2 is not listed: " in result.output
    with pytest.raises(BadInput, match="parent 2, which is not in the store"):
        pull(store, "3", into=tmp_path / "out")


def test_a_hand_rewound_latest_is_refused_not_cleaned_up(models, tmp_path):
    store = published(tmp_path / "store", models, delta=True)
    (store / "latest").write_text("1\n")
    with pytest.raises(BadInput, match="versions 2, 3 are all newer than latest"):
        publish(models[2], store)
    assert sorted(p.name for p in (store / "versions").iterdir()) == ["1", "2", "3"]


def test_retention_keeps_what_the_newest_deltas_need(models, tmp_path):
    store = published(tmp_path / "chain", [models[0], models[1], models[2], models[0]], delta=True)
    assert publish(models[1], store, delta=True, keep=2)["removed"] == []  # 5 needs 4..1

    store = tmp_path / "rebased"
    publish(models[0], store)
    publish(models[1], store, delta=True)
    publish(models[2], store)  # full: a new base
    publish(models[0], store, delta=True)
    manifest = publish(models[1], store, compress=True, keep=2)
    assert manifest["removed"] == ["1", "2"]
    assert [v["name"] for v in list_versions(store)] == ["3", "4", "5"]
    assert sorted(p.name for p in (store / "versions").iterdir()) == ["3", "4", "5"]
    for name, model in (("3", models[2]), ("4", models[0]), ("5", models[1])):
        assert raw_tensors(pull(store, name, into=tmp_path / name)) == raw_tensors(model)
    assert publish(models[2], store, delta=True, keep=1)["removed"] == []  # 6 needs 5, 4, 3
    assert latest_name(store) == "6"


def test_materialize_caches_each_version_once(models, tmp_path, monkeypatch):
    monkeypatch.setenv("LPX_CACHE", str(tmp_path / "cache"))
    store = published(tmp_path / "store", models[:2], compress=True)
    first = materialize(store)
    assert first.parent.parent == tmp_path / "cache" / "weights" and first.name == "2"
    assert raw_tensors(first) == raw_tensors(models[1])
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    import pipeline.weights.store as store_module

    def no_pull(*args, **kwargs):
        raise AssertionError("pulled again")

    with monkeypatch.context() as patched:
        patched.setattr(store_module, "write_model_dir", no_pull)
        assert materialize(store, "2") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    marker = first / ".lpx-weights.json"
    marker.write_text(json.dumps({"fingerprint": "sha256:stale"}))
    assert materialize(store, "2") == first  # a stale copy is pulled again
    assert json.loads(marker.read_text())["fingerprint"] == read_manifest(store, "2")["fingerprint"]

    foreign = materialize(store, "1")
    shutil.rmtree(foreign)
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="not written by lpx"):
        materialize(store, "1")
    assert (foreign / "notes.txt").read_text() == "mine"


def test_lpx_weights_publish_ls_pull(models, tmp_path):
    store = tmp_path / "store"
    first = run_lpx("weights", "publish", models[0], "--to", store, "--delta")
    assert first.exit_code == 0, first.output
    assert first.output.startswith("published version 1 (full): 21 tensors, stored 1.9 MiB")
    assert "published full, not as a delta: there is no earlier version" in first.output

    second = run_lpx("weights", "publish", models[1], "--to", store, "--delta", "--name", "step-2")
    assert second.exit_code == 0, second.output
    assert (
        "published version step-2 (delta on 1): 1/21 changed, stored 64.1 KiB (3.3 % of 1.9 MiB)"
        in second.output
    )
    third = run_lpx("weights", "publish", models[2], "--to", store, "--compress", "--keep", "1")
    assert third.exit_code == 0 and "(delta on step-2): 3/21 changed" in third.output

    listed = run_lpx("weights", "ls", store)
    lines = listed.output.splitlines()
    assert listed.exit_code == 0 and lines[0] == f"{store}: 3 versions"
    assert [line.split()[:2] for line in lines[2:]] == [
        ["1", "full"],
        ["step-2", "delta"],
        ["*", "3"],
    ]
    as_json = json.loads(run_lpx("weights", "ls", store, "--json").output)
    assert [(v["name"], v["is_latest"], v["tensors_stored"]) for v in as_json] == [
        ("1", False, 21),
        ("step-2", False, 1),
        ("3", True, 3),
    ]

    pulled = run_lpx("weights", "pull", store, "--version", "step-2", "--into", tmp_path / "out")
    assert pulled.exit_code == 0, pulled.output
    assert pulled.output.startswith(f"pulled version step-2 into {tmp_path / 'out'}: 21 tensors")
    assert raw_tensors(tmp_path / "out") == raw_tensors(models[1])

    refusals = [
        (("pull", store, "--version", "9", "--into", tmp_path / "x"), "no version '9'; it has 1"),
        (("pull", store, "--into", tmp_path / "out"), "is not an empty directory"),
        (("pull", tmp_path / "out", "--into", tmp_path / "y"), "not a weight store"),
        (("publish", models[0], "--to", tmp_path / "out"), "exists and is not a weight store"),
        (("publish", models[0], "--to", store, "--name", "1"), "version '1' already exists"),
        (("publish", models[0], "--to", store, "--name", "../up"), "version name '../up'"),
        (("publish", store, "--to", store), "not a model directory (no config.json)"),
        (("publish", models[0], "--to", store, "--keep", "0"), "0 is not in the range x>=1"),
    ]
    for args, message in refusals:
        result = run_lpx("weights", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert latest_name(store) == "3"
