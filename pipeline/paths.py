"""Names that become paths, outputs that must never replace inputs, and outputs that replace
only what lpx wrote."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import BadInput

LOCK = ".lpx-lock"  # held by the process writing an output directory
# Written into a directory lpx fills and later removes whole (localize's captures/), so that
# removing it never takes a user's directory of the same name.
OUTPUT_MARKER = ".lpx-output"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def safe_name(name: str, what: str) -> str:
    """A name from the command line or a file that becomes part of a file name: letters,
    digits, '_', '.', '-', starting with a letter or digit, no '..' (so never a path)."""
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise BadInput(
            f"{what} {name!r}: use letters, digits, '_', '.' and '-' (it names files under "
            "--out), starting with a letter or digit."
        )
    return name


def check_output(out: Path, inputs, option: str = "--out") -> None:
    """Refuse an output that is one of the inputs: lpx never overwrites what it reads."""
    target = Path(out).resolve()
    for given in inputs:
        if given is not None and Path(given).resolve() == target:
            raise BadInput(
                f"{option} {out} is also an input ({given}); write the output to another path. "
                "lpx never replaces its inputs."
            )


def check_replaceable(path: Path, what: str) -> None:
    """Refuse to replace ``path`` (named by ``what``, e.g. "--out") unless lpx wrote it: a
    user's file of the same name is never lost to an output. Absent is fine."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        raise BadInput(f"{what} {path}: is a directory; give a file path for this output.")
    if not written_by_lpx(path):
        raise BadInput(
            f"{what} {path}: exists and lpx did not write it; lpx replaces only its own "
            "outputs. Choose another path, or move that file away first."
        )


def check_replaceable_in(out_dir: Path, names, what: str = "--out") -> None:
    """Refuse an output directory holding, under a name lpx would write there (report.json,
    localize.json, captures/ ...), something lpx did not write."""
    out_dir = Path(out_dir)
    for name in names:
        path = out_dir / name
        if not os.path.lexists(path) or written_by_lpx(path):
            continue
        raise BadInput(
            f"{what} {out_dir}: {name} there exists and lpx did not write it; lpx replaces only "
            "its own outputs. Choose another directory, or move that one away first."
        )


def written_by_lpx(path: Path) -> bool:
    """Whether ``path`` is an output an earlier lpx wrote, by its content (names are
    anyone's): a fixture, replay or token table (Parquet with lpx's header), a calibration,
    report or localize result (JSON with their markers), a summary.md, localize's chart, or
    a directory lpx marked as its own."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        return _lpx_directory(path)
    if not stat.S_ISREG(mode):  # a FIFO or device: opening it could block or consume it
        return False
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError:
        return False
    if head.startswith(b"PAR1"):
        return _lpx_parquet(path)
    if head.lstrip().startswith(b"{"):
        return _lpx_json(path)
    if head.startswith(b"# lpx compare"):
        return True  # summary.md of a pair or a matrix
    return head.startswith(b"<svg") and b'class="localize-chart"' in head


def mark_lpx_directory(directory: Path) -> None:
    """Mark a directory lpx created as lpx's, so that a later run may remove it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / OUTPUT_MARKER).touch()


# compare's token table (tokens.parquet), which carries no lpx header: told by its columns.
TOKEN_TABLE_COLUMNS = frozenset(
    ("sequence_id", "position", "region", "token_id", "logprob_rollout", "logprob_train",
     "diff", "over_tau")
)  # fmt: skip


def _lpx_parquet(path: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception:  # a truncated or foreign Parquet file
        return False
    return b"lpx" in (schema.metadata or {}) or set(schema.names) == TOKEN_TABLE_COLUMNS


# Top-level keys that only lpx's JSON outputs carry together.
_JSON_SIGNATURES = (
    {"lpx_calibration"},  # calibration.json
    {"lpx_localize"},  # localize.json
    {"schema_version", "verdict", "boundaries", "sides"},  # localize.json before its marker
    {"verdict", "metrics", "policy", "metadata"},  # a pair's report.json
    {"verdict", "pairs", "metadata"},  # a matrix's report.json
    {"lpx_run"},  # lpx-run.json, a run's manifest
)


def _lpx_json(path: Path) -> bool:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    if any(keys <= data.keys() for keys in _JSON_SIGNATURES):
        return True
    # smoke.json: each replay dtype's verdict and report path
    return bool(data) and all(
        isinstance(v, dict) and {"verdict", "report"} <= v.keys() for v in data.values()
    )


def _lpx_directory(path: Path) -> bool:
    """A directory lpx marked, or localize's captures from before the marker: only
    SIDE/SEQUENCE/BOUNDARY.npy files."""
    if (path / OUTPUT_MARKER).is_file():
        return True
    for entry in path.rglob("*"):
        relative = entry.relative_to(path).parts
        if entry.is_dir() and not entry.is_symlink():
            if len(relative) > 2 or (len(relative) == 2 and not relative[1].isdigit()):
                return False
        elif not (len(relative) == 3 and relative[1].isdigit() and entry.suffix == ".npy"):
            return False
    return True


@contextmanager
def replacing(path: Path):
    """Yield a temp path beside ``path``; on success it replaces ``path`` in one rename. A
    crash, error or Ctrl-C leaves the previous file (or none) and never a temp file."""
    path = Path(path)
    if path.exists() and not path.is_file():
        # A rename over /dev/null or a FIFO would replace the device node itself (as root).
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise BadInput(f"{path}: is {kind}; give a file path for this output.")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as error:
        if error.filename is None:  # a failed write() (a full disk) names no file: name ours
            raise OSError(_errno_of(error), error.strerror or str(error), str(path)) from error
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _errno_of(error: OSError) -> int:
    """The error's errno; Arrow's IO errors carry theirs only in the message."""
    if error.errno is not None:
        return error.errno
    return errno.ENOSPC if "No space left" in str(error) else errno.EIO


def is_disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def output_lock(out_dir: Path):
    """An exclusive lock on an output directory, refused at once when another lpx holds it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(out_dir / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise BadInput(
            f"{out_dir}: another lpx process is writing here right now; wait for it or choose "
            "another --out."
        ) from None
    try:
        yield
    finally:
        lock.release()


RESERVE = ".lpx-reserve"
RESERVE_BYTES = 1 << 20


class SpaceReserve:
    """Real blocks held in a directory and freed when its volume fills, so that a run on a
    full volume can still write down how it ended (its manifest) before it stops."""

    def __init__(self, directory: Path, size: int = RESERVE_BYTES):
        self.path = Path(directory) / RESERVE
        try:
            with open(self.path, "wb") as reserve:
                try:
                    os.posix_fallocate(reserve.fileno(), 0, size)
                except OSError as error:
                    if is_disk_full(error):
                        raise
                    reserve.write(b"\0" * size)  # a file system without fallocate
                    reserve.flush()
                    os.fsync(reserve.fileno())
        except OSError as error:
            self.path.unlink(missing_ok=True)
            if is_disk_full(error):
                raise BadInput(
                    f"{directory}: less than {size >> 10} KiB free on its volume; free space "
                    "or choose another --out."
                ) from None
            raise

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
