from __future__ import annotations

import json
import time
from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR, FiniteFloat

STORE_PATH = click.Path(file_okay=False, path_type=Path)


@click.group(short_help="Publish, pull and list policy weight versions.")
def weights() -> None:
    """Publish policy weight versions to a store, pull them, list them.

    A trainer publishes each version (whole, or a delta on the one before) and advances
    the store's `latest`; rollout fleets, lpx replay --weights-store and lpx serve pull
    versions from it. Layout and guarantees: docs/weight-sync.md.

    \b
    Example:
      lpx weights publish checkpoints/step-100 --to store --delta --keep 8
      lpx weights ls store
      lpx weights pull store --into models/latest
      lpx weights hot-load store --url http://127.0.0.1:8000
    """


@weights.command("publish", short_help="Publish MODEL_DIR's weights as the store's next version.")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--to", "store", type=STORE_PATH, required=True, help="The weight store.")
@click.option("--delta", is_flag=True, help="Store only the tensors that changed since latest.")
@click.option(
    "--compress",
    is_flag=True,
    help="A delta whose changed tensors are stored as zlib(new XOR old) where smaller.",
)
@click.option("--name", help="The version's name [default: its number, 1, 2, ...].")
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    help="Keep the newest K versions (and the ones their deltas need); delete the rest.",
)
def publish(
    model_dir: Path, store: Path, delta: bool, compress: bool, name: str | None, keep: int | None
) -> None:
    """Publish MODEL_DIR's weights as the store's next version and make it latest.

    MODEL_DIR is what save_pretrained wrote (sharded or not). The version appears whole
    and `latest` moves only once it is complete, so a publisher killed at any point leaves
    the previous version as latest; the next publish cleans up after it.

    \b
    Example:
      lpx weights publish checkpoints/step-100 --to /shared/policy-weights --delta
      lpx weights publish checkpoints/step-200 --to /shared/policy-weights --compress --keep 8
    """
    from pipeline.weights.store import publish as publish_version

    started = time.perf_counter()
    manifest = publish_version(
        model_dir, store, delta=delta, compress=compress, name=name, keep=keep
    )
    seconds = time.perf_counter() - started
    entries = manifest["tensors"].values()
    full_bytes = sum(_nbytes(entry) for entry in entries)
    kind = f"delta on {manifest['parent']}" if manifest["kind"] == "delta" else "full"
    changed = manifest["tensors_changed"]
    tensors = f"{len(entries)} tensors" if changed is None else f"{changed}/{len(entries)} changed"
    share = (
        f" ({100 * manifest['stored_bytes'] / max(full_bytes, 1):.1f} % of {_size(full_bytes)})"
        if manifest["kind"] == "delta"
        else ""
    )
    click.echo(
        f"published version {manifest['name']} ({kind}): {tensors}, stored "
        f"{_size(manifest['stored_bytes'])}{share}, {seconds:.2f} s"
    )
    if manifest["full_reason"]:
        click.echo(f"published full, not as a delta: {manifest['full_reason']}")
    if manifest["removed"]:
        click.echo(f"removed versions {', '.join(manifest['removed'])} (--keep {keep})")


@weights.command("pull", short_help="Write a version of STORE as a Hugging Face model directory.")
@click.argument("store", type=STORE_PATH)
@click.option("--version", help="The version to pull [default: latest].")
@click.option("--into", type=OUTPUT_DIR, required=True, help="A new or empty directory.")
def pull(store: Path, version: str | None, into: Path) -> None:
    """Write a version of STORE into a new directory as a Hugging Face model directory.

    The directory holds the version's files, one model.safetensors and WEIGHT_VERSION;
    every tensor and file is checked against the version's manifest before it appears.

    \b
    Example:
      lpx weights pull /shared/policy-weights --into models/policy
      lpx weights pull /shared/policy-weights --version 12 --into models/policy-12
    """
    from pipeline.weights.store import pull as pull_version
    from pipeline.weights.store import read_manifest

    started = time.perf_counter()
    out = pull_version(store, version, into=into)
    name = (out / "WEIGHT_VERSION").read_text().strip()
    manifest = read_manifest(store, name)
    click.echo(
        f"pulled version {name} into {out}: {len(manifest['tensors'])} tensors, "
        f"{_size(sum(_nbytes(e) for e in manifest['tensors'].values()))}, verified, "
        f"{time.perf_counter() - started:.2f} s"
    )


@weights.command("ls", short_help="List the store's versions, oldest first; * marks latest.")
@click.argument("store", type=STORE_PATH)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls(store: Path, as_json: bool) -> None:
    """List the store's published versions, oldest first; * marks latest.

    \b
    Example:
      lpx weights ls /shared/policy-weights
      lpx weights ls /shared/policy-weights --json
    """
    from pipeline.text import for_terminal
    from pipeline.weights.store import damaged_versions, list_versions

    versions = list_versions(store)
    # A damaged version is never left out in silence, in either format: stdout stays the
    # listing (valid JSON with --json), stderr names what is missing from it.
    for name, problem in damaged_versions(store).items():
        click.echo(for_terminal(f"warning: versions/{name} is not listed: {problem}"), err=True)
    if as_json:
        click.echo(json.dumps(versions, indent=1))
        return
    click.echo(for_terminal(f"{store}: {len(versions)} versions"))
    if versions:
        click.echo(
            f"  {'name':<12} {'kind':<5} {'parent':<12} {'stored':>10} {'weights':>10} "
            f"{'tensors':>9}  {'created':<25} fingerprint"
        )
    for row in versions:
        line = (
            f"{'*' if row['is_latest'] else ' '} {row['name']:<12} {row['kind']:<5} "
            f"{row['parent'] or '-':<12} {_size(row['stored_bytes']):>10} "
            f"{_size(row['tensor_bytes']):>10} "
            f"{row['tensors_stored']:>4}/{row['tensors_total']:<4}  {row['created']:<25} "
            f"{row['fingerprint'][:19]}"
        )
        click.echo(for_terminal(line))


@weights.command("hot-load", short_help="Load a version into a running server without a restart.")
@click.argument("store", type=STORE_PATH)
@click.option(
    "--url", required=True, help="The server: SGLang, vLLM with its RL endpoints, or lpx serve."
)
@click.option("--version", help="The version to load [default: latest].")
@click.option(
    "--via",
    type=click.Choice(["disk", "tensor"]),
    default="disk",
    show_default=True,
    help="SGLang: load the pulled directory, or send its tensors by shared memory.",
)
@click.option(
    "--abort-running",
    is_flag=True,
    help="SGLang: end the requests in flight (finish reason abort) so they resume under the "
    "new version.",
)
@click.option(
    "--timeout", "timeout_s", type=FiniteFloat(min=0.0, min_open=True), default=600.0,
    show_default=True, help="Seconds to wait for each server call.",
)  # fmt: skip
def hot_load(
    store: Path, url: str, version: str | None, via: str, abort_running: bool, timeout_s: float
) -> None:
    """Load a version of STORE into a running server without restarting it.

    For SGLang: /update_weights_from_disk (or, --via tensor, /update_weights_from_tensor)
    with the version's name, which SGLang then tags each new token with; its radix cache is
    flushed.
    For vLLM started with VLLM_SERVER_DEV_MODE=1: pause (in-flight requests finish),
    reload_weights from the pulled version, reset the prefix cache, name the version
    (GET /weight_info then reports it), resume. For lpx serve: POST /update_weights. The
    version is pulled and verified locally first; the server must see the same path.

    \b
    Example:
      lpx weights hot-load /shared/policy-weights --url http://127.0.0.1:8000
      lpx weights hot-load /shared/policy-weights --version 12 --url http://127.0.0.1:8400
      lpx weights hot-load /shared/policy-weights --url http://127.0.0.1:30000 \\
          --via tensor --abort-running
    """
    from pipeline.weights.hot_load import hot_load as load_version

    if not url.startswith(("http://", "https://")):
        raise click.BadParameter("give the server's base URL, http://HOST:PORT", param_hint="--url")
    done = load_version(url, store, version, timeout_s, via, abort_running)
    click.echo(
        f"{url} ({done['server']}) now serves version {done['version']}: pulled and verified "
        f"in {done['pull_s']:.2f} s, swapped in {done['swap_s']:.2f} s"
    )


def _nbytes(entry: dict) -> int:
    from pipeline.weights.tensors import TensorSpec

    return TensorSpec("", entry["dtype"], tuple(entry["shape"])).nbytes


def _size(count: int) -> str:
    power = 0
    while power < 3 and count >= 1024 ** (power + 1):
        power += 1
    return f"{count} B" if power == 0 else f"{count / 1024**power:.1f} {'BKMG'[power]}iB"
