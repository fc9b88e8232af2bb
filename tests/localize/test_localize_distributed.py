"""Capture from FSDP2, DeepSpeed and megatron-core on 2 gloo ranks (`lpx localize` sides).

Measured here (tiny Llama, 2 layers, against the hf adapter, the largest relative per-token
divergence over every boundary): FSDP2 and DeepSpeed ZeRO-3 8.2e-7 in fp32 (the HF model
itself, its matmuls on one thread per rank) and exactly 0.0 in fp64; Megatron TP=2 2.1e-6 in
fp32 and 5.2e-7 in fp64 (HF's RMSNorm computes in fp32 even in an fp64 model, Megatron's stays
fp64). A worker group starts in 10-20 s; the file runs in about 2.5 minutes.
"""

import os
import shutil
import signal
import time

import numpy as np
import pytest

from pipeline.errors import BadInput
from pipeline.fixture.io import read_table
from pipeline.localize.adapters import open_side
from pipeline.localize.measure import token_divergence
from pipeline.localize.run import localize
from pipeline.localize.verdict import MARGIN

pytestmark = pytest.mark.distributed

SEQUENCES = [list(range(3, 40)), [7, 1, 300, 12, 45, 9, 511, 2, 88, 64, 17]]
# (spec, largest relative divergence from hf per token, declared fp32 / reference fp64)
# The ranks run one thread each and this process two, so even the HF model under FSDP may
# round a matmul differently: fp32 agreement is to a few ulps, fp64 to a few fp64 ulps.
# On the CPU the ranks are forked warm (pipeline/engines/warm_ranks.py), as a GPU's are not:
# torchrun starts those, as it does the CPU's with LPX_WARM_START=0 (the last row).
SIDES = [
    ("fsdp:nproc=2", 5e-6, 1e-12, "1"),  # measured 8.2e-7 / 0.0
    ("deepspeed:nproc=2", 5e-6, 1e-12, "1"),  # measured 8.2e-7 / 0.0
    ("megatron:tp=2,dtype=fp32", 5e-6, 2e-6, "1"),  # measured 2.1e-6 / 5.2e-7
    ("fsdp:nproc=2", 5e-6, 1e-12, "0"),  # under torchrun
]


def captured(side, ids, precision, replace=None) -> dict:
    rows = {}
    side.capture(ids, precision, rows.__setitem__, replace)
    return rows


def worst_divergence(ours: dict, theirs: dict) -> float:
    return max(float(token_divergence(n, ours[n], theirs[n]).max()) for n in ours)


@pytest.fixture(scope="module")
def hf_side(tiny_model):
    side = open_side("hf", tiny_model)
    yield side
    side.close()


@pytest.mark.parametrize(
    "spec,fp32_limit,fp64_limit,warm", SIDES,
    ids=[s + ("" if warm == "1" else "-torchrun") for s, _, _, warm in SIDES],
)  # fmt: skip
def test_captures_agree_with_hf_boundary_by_boundary(
    spec, fp32_limit, fp64_limit, warm, tiny_model, hf_side, monkeypatch
):
    from pipeline.engines.warm_ranks import RankGroup

    monkeypatch.setenv("LPX_WARM_START", warm)
    side = open_side(spec, tiny_model)
    try:
        assert isinstance(side.group.process, RankGroup) == (warm == "1")
        assert side.boundaries == hf_side.boundaries
        assert side.reference_dtype == "float64"
        assert side.layout["world_size"] == 2 and side.layout["dtype"] == "float32"
        assert side.layout["tp"] == (2 if spec.startswith("megatron") else 1)
        worst = 0.0
        for ids in SEQUENCES:
            ours, theirs = captured(side, ids, "declared"), captured(hf_side, ids, "declared")
            assert set(ours) == set(hf_side.boundaries)
            assert ours["layers.0.q"].shape == (len(ids), 4 * 32)  # HF layout: heads * head_dim
            assert ours["layers.0.k"].shape == (len(ids), 2 * 32)
            assert ours["logits"].shape == (len(ids), 512)  # gathered over vocab shards
            worst = max(worst, worst_divergence(ours, theirs))
        # The floor's reference really runs in fp64 on the ranks.
        ours = captured(side, SEQUENCES[0], "reference")
        assert ours["logits"].dtype == np.float64
        worst64 = worst_divergence(ours, captured(hf_side, SEQUENCES[0], "reference"))
        print(f"{spec} vs hf: fp32 {worst:.2e}, fp64 {worst64:.2e}")
        assert worst <= fp32_limit and worst64 <= fp64_limit
        # A swap puts the given rows in, sliced per rank where the engine shards them.
        given = captured(hf_side, SEQUENCES[1], "declared")
        replace = {"layers.0.k": given["layers.0.k"] * 1.5, "logits": given["logits"] + 1.0}
        swapped = captured(side, SEQUENCES[1], "declared", replace)
        for name, rows in replace.items():
            np.testing.assert_allclose(swapped[name], rows, rtol=1e-6, atol=1e-6)
        assert worst_divergence({"layers.0.attn_out": swapped["layers.0.attn_out"]}, given) > 1e-3
    finally:
        side.close()


@pytest.mark.parametrize("spec", ["megatron:tp=2", "fsdp:nproc=2"])
def test_clean_across_layouts_localizes_nothing(spec, tiny_model, run_dir, tmp_path):
    table = read_table(run_dir / "fixture.parquet")
    result = localize(table, tiny_model, spec, "hf", [0, 3], tmp_path)
    worst = max(row["ratio"] for row in result["boundaries"])
    print(f"{spec} vs hf: max drift/floor {worst:.3f}")
    assert result["verdict"] == "clean" and result["first"] is None
    # Measured: megatron TP=2 0.76; FSDP2 0.0 (the HF model itself).
    assert worst < MARGIN
    assert result["sides"]["a"]["world_size"] == 2
    assert result["sides"]["a"]["reference_dtype"] == "float64"


@pytest.mark.parametrize("runner", ["fsdp:nproc=2", "megatron:tp=2"])
def test_seeded_fault_is_localized_and_verified_by_a_distributed_runner(
    runner, tiny_model, run_dir, tmp_path
):
    """The fault is on the hf side; the distributed side (A) takes hf's activations in its
    ranks to verify it."""
    table = read_table(run_dir / "fixture.parquet")
    fault = "hf:fault=stale_layer,fault_layer=1"
    result = localize(table, tiny_model, runner, fault, [0, 3], tmp_path)
    assert result["first"]["boundary"] == "layers.1.mlp_out"
    assert result["first"]["ratio"] > 100 * MARGIN  # measured ~18000-19000
    assert result["verdict"] == "verified"
    assert result["verification"]["runner"] == "a"
    assert result["verification"]["attempts"][0]["within_floor"] is True
    layer_0 = [r for r in result["boundaries"] if r["layer"] == 0]
    assert max(r["ratio"] for r in layer_0) < MARGIN


def ranks_gone(pids, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def zombie(pid: int) -> bool:
    try:
        return "\nState:\tZ" in open(f"/proc/{pid}/status").read()
    except OSError:
        return True


def test_a_rank_that_dies_or_hangs_is_a_clear_error_not_a_hang(tiny_model):
    side = open_side("fsdp:nproc=2", tiny_model)
    try:
        captured(side, SEQUENCES[1], "declared")
        pids = side.group.rank_pids()
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(BadInput, match=r"rank 1 was killed by SIGKILL \(log: .*rank1\.log\)"):
            captured(side, SEQUENCES[1], "declared")
        assert time.monotonic() - started < 30  # measured ~1 s
        with pytest.raises(BadInput, match="failed earlier in this session"):
            captured(side, SEQUENCES[1], "declared")
    finally:
        side.close()
    assert ranks_gone(pids.values())
    shutil.rmtree(side.group.folder)
    first = side.group.process.warm

    side = open_side("fsdp:nproc=2", tiny_model)
    # the next group's ranks fork from the same warm interpreter, whatever its session key
    assert side.group.process.warm is first
    try:
        captured(side, SEQUENCES[1], "declared")
        pids = side.group.rank_pids()
        side.group.timeout = 5  # models loaded: an answer takes well under a second now
        os.kill(pids[1], signal.SIGSTOP)  # rank 0 waits for it in a collective
        started = time.monotonic()
        with pytest.raises(BadInput, match=r"no answer within 5 s .*raise the timeout knob"):
            captured(side, SEQUENCES[1], "declared")
        assert time.monotonic() - started < 15
    finally:
        side.close()
    assert ranks_gone(pids.values())  # the stopped rank is killed too
    # A failed group's folder stays for its rank logs, which the error names.
    assert sorted(p.name for p in side.group.folder.glob("rank*.log")) == ["rank0.log", "rank1.log"]
    shutil.rmtree(side.group.folder)


def test_specs_are_checked_before_any_rank_starts(tiny_model, tmp_path):
    with pytest.raises(BadInput, match="unknown megatron capture knob"):
        open_side("megatron:nproc=2", tiny_model)
    with pytest.raises(BadInput, match="tp=3 must divide the key/value heads"):
        open_side("megatron:tp=3", tiny_model)
    with pytest.raises(BadInput, match="unknown fault 'nope'"):
        open_side("fsdp:fault=nope", tiny_model)
    with pytest.raises(BadInput):
        open_side("deepspeed:nproc=2", tmp_path / "missing-model")
