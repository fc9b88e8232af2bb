"""The mounts that give a stage's container its run directory and every path the plan names
outside it (the checkpoint, prompts, ...), each at the path the plan names.

The Docker daemon reads a mount's source on the host. Where lpx itself runs on the host, a
path is its own source. Where lpx runs in a container that starts the stage containers
through the host's Docker socket (the compose `smoke` and `nightly` services), a path lpx
sees is translated through lpx's own container's mounts: a bind mount's host folder, or the
named volume, mounted at the same place. A path that lives only in lpx's own container can
reach no stage: that is one line naming the plan key.

Symbolic links inside a named folder are followed to where they lead: a Hugging Face hub
cache snapshot (`models--org--name/snapshots/<rev>/config.json -> ../../blobs/<sha>`) brings
its `blobs/` along, at the place the links expect it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.orchestrator.outside import OutsidePath

CONTAINER_ID = re.compile(r"/containers/([0-9a-f]{64})/")


@dataclass(frozen=True)
class MountSpec:
    """One mount of a stage's container: ``source`` as the daemon reads it."""

    target: str
    source: str
    kind: str = "bind"  # or "volume": ``source`` is the volume's name
    read_only: bool = True


def views(path: str) -> dict[str, str]:
    """{target: source} for the stage's container to see ``path`` as this process sees it:
    the path itself (its real location mounted where the plan names it), and each folder a
    symbolic link inside it leads to outside it, where the link expects that folder."""
    pairs = {path: os.path.realpath(path)}
    if os.path.isdir(path):
        for folder, dirs, files in os.walk(path):  # links to folders are listed, not entered
            for name in dirs + files:
                link = os.path.join(folder, name)
                if not os.path.islink(link):
                    continue
                # the container resolves the link from where it sits under the mount
                expected = os.path.normpath(os.path.join(folder, os.readlink(link)))
                if _within(expected, path):
                    continue
                real = os.path.realpath(link)
                if os.path.isdir(real):
                    pairs[expected] = real
                else:
                    pairs[os.path.dirname(expected)] = os.path.dirname(real)
    return _collapsed(pairs)


def stage_mounts(run_dir: Path, reads: tuple[OutsidePath, ...], host: HostView) -> list[MountSpec]:
    """The run directory (written) and what the stage reads outside it (read-only; the SQLite
    history's folder written), translated to what the daemon can mount."""
    wanted: dict[str, tuple[str, bool, bool]] = {
        str(run_dir): (os.path.realpath(run_dir), False, False)
    }
    for outside in reads:
        if outside.writable:
            try:
                Path(outside.path).mkdir(parents=True, exist_ok=True)
            except OSError:
                if outside.optional:
                    continue
                raise
        for target, source in views(outside.path).items():
            wanted.setdefault(target, (source, not outside.writable, outside.optional))
    named = os.environ.get("LPX_DOCKER_VOLUME")
    mounts: dict[str, MountSpec] = {}
    for target, (source, read_only, optional) in wanted.items():
        if named and target == str(run_dir):
            spec = _named_volume(named, run_dir)
        else:
            try:
                spec = host.mount(target, source, read_only, _key_of(target, reads))
            except BadInput:
                if optional:  # a cache only lpx's own container holds: the stage goes without
                    continue
                raise
        mounts.setdefault(spec.target, spec)
    return list(mounts.values())


def lent(path: str, mounts: list[MountSpec]) -> bool:
    """Whether a stage's container with these mounts sees ``path`` where this process does
    (a mount's target is the path as lpx sees it, or the whole volume that holds it)."""
    return any(_within(path, m.target) for m in mounts)


class HostView:
    """How the daemon's host sees a path this process sees: itself on the host; through this
    process's container's mounts when lpx runs in a container of the same daemon."""

    def __init__(self, mounts: list[dict] | None):
        self.mounts = sorted(mounts or [], key=lambda m: -len(m["Destination"]))
        self.in_container = mounts is not None

    @classmethod
    def of(cls, client) -> HostView:
        """The view for this process, asking the daemon about its own container (if any)."""
        found = own_container_id()
        if found is None:
            return cls(None)
        import docker

        try:
            return cls(client.containers.get(found).attrs.get("Mounts") or [])
        except docker.errors.NotFound:  # a container of another daemon: its paths are not ours
            return cls(None)

    def mount(self, target: str, source: str, read_only: bool, key: str) -> MountSpec:
        if not self.in_container:
            return MountSpec(target, source, "bind", read_only)
        mount = next((m for m in self.mounts if _within(source, m["Destination"])), None)
        if mount is None:
            raise BadInput(
                f"{key}: {source} is inside the container lpx runs in, on no mount of it, so "
                "no stage container can see it; mount the host folder that holds it into lpx's "
                "container (compose.yaml's nightly service mounts LPX_MODELS at the same path)."
            )
        rest = os.path.relpath(source, mount["Destination"])
        if mount.get("Type") == "bind":
            host = os.path.normpath(os.path.join(mount["Source"], rest))
            return MountSpec(target, host, "bind", read_only)
        if target != source:
            raise BadInput(
                f"{key}: {target} leads to {source} on the volume {mount.get('Name')}, and a "
                "stage container can mount a volume only whole, where lpx's container has it; "
                "keep the checkpoint and what its links lead to on one bind-mounted host folder."
            )
        # a named volume is mounted whole, where lpx's container has it (the run directory
        # of the compose services lives on the volume lpx-runs)
        return MountSpec(mount["Destination"], mount["Name"], "volume", read_only)


def own_container_id() -> str | None:
    """This process's container id, from the files Docker bind-mounts into every container
    (/etc/hostname, /etc/hosts: /var/lib/docker/containers/<id>/...); None on a host."""
    try:
        found = CONTAINER_ID.search(Path("/proc/self/mountinfo").read_text())
    except OSError:
        found = None
    if found:
        return found.group(1)
    name = socket.gethostname()
    in_docker = os.path.exists("/.dockerenv")
    return name if in_docker and re.fullmatch(r"[0-9a-f]{12}", name) else None


def _named_volume(named: str, run_dir: Path) -> MountSpec:
    """LPX_DOCKER_VOLUME=NAME:/MOUNT: the volume that holds the run directory under /MOUNT,
    for a daemon that cannot be asked about lpx's own container."""
    volume, _, mount = named.partition(":")
    if not mount or not str(run_dir).startswith(mount.rstrip("/") + "/"):
        raise BadInput(
            f"LPX_DOCKER_VOLUME={named}: the run directory {run_dir} must lie under its "
            "mount point (NAME:/MOUNT)."
        )
    return MountSpec(mount, volume, "volume", read_only=False)


def _key_of(target: str, reads: tuple[OutsidePath, ...]) -> str:
    """The plan key a mount serves, for messages."""
    return next((o.key for o in reads if _within(target, o.path)), "the run directory")


def _collapsed(pairs: dict[str, str]) -> dict[str, str]:
    """Drop a target that a shorter one already covers with the same real folder beneath."""
    kept: dict[str, str] = {}
    for target in sorted(pairs, key=len):
        source = pairs[target]
        covered = any(
            _within(target, outer)
            and os.path.normpath(os.path.join(kept[outer], os.path.relpath(target, outer)))
            == source
            for outer in kept
        )
        if not covered:
            kept[target] = source
    return kept


def _within(path: str, folder: str) -> bool:
    path, folder = os.path.normpath(path), os.path.normpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")
