"""Names that become paths, and outputs that must never replace inputs."""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import BadInput

LOCK = ".lpx-lock"  # held by the process writing an output directory
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
