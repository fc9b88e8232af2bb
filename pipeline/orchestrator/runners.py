"""Where a stage's `lpx` command runs: a local process, or a container of the stage's image.

Both return the command's exit code, or None when it ran past its timeout (then it is
killed, its ranks included). Neither imports an engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.errors import BadInput, Interrupted
from pipeline.orchestrator.stages import Stage


class LocalRunner:
    name = "local"

    def image(self, stage: Stage) -> dict | None:
        return None

    def run(self, stage: Stage, run_dir: Path, log: Path, timeout_s: float) -> int | None:
        with open(log, "w", encoding="utf-8") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline", *stage.argv],
                cwd=run_dir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killing it reaches torchrun's ranks
            )
            try:
                return process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process, signal.SIGKILL)
                return None
            except Interrupted:
                _kill_group(process, signal.SIGTERM)
                raise


class DockerRunner:
    """Each stage in a container of its image (Docker SDK for Python), the run directory
    bind-mounted at the same absolute path so every path in the files means the same inside
    and out. GPU plans get every GPU (a device request); logs go to the stage's log file."""

    name = "docker"

    def __init__(self, gpus: bool = False):
        try:
            import docker
        except ImportError:
            raise BadInput(
                "the docker runner needs the Docker SDK: pip install -e '.[docker]'."
            ) from None
        try:
            self.client = docker.from_env()
            self.client.ping()
        except Exception as error:  # the SDK raises several types when no daemon answers
            raise BadInput(
                f"Docker is not reachable ({str(error).splitlines()[0][:200]}); start dockerd, "
                "or set DOCKER_HOST, or use --runner local."
            ) from None
        self.gpus = gpus
        self._images: dict[str, dict] = {}

    def image(self, stage: Stage) -> dict | None:
        """The stage's image with its resolved digest: what the history records as the build."""
        if stage.image is None:
            raise BadInput(f"stage {stage.name}: the plan names no image; add `image:` to it.")
        if stage.image not in self._images:
            import docker

            try:
                found = self.client.images.get(stage.image)
            except docker.errors.ImageNotFound:
                raise BadInput(
                    f"stage {stage.name}: image {stage.image!r} is not on this Docker host; "
                    "build or pull it first (README: Containers)."
                ) from None
            digests = found.attrs.get("RepoDigests") or []
            self._images[stage.image] = {
                "ref": stage.image,
                "digest": digests[0].split("@", 1)[1] if digests else found.id,
                "labels": found.labels,
            }
        return self._images[stage.image]

    def run(self, stage: Stage, run_dir: Path, log: Path, timeout_s: float) -> int | None:
        from docker.types import DeviceRequest

        import docker

        self.image(stage)
        container = self.client.containers.run(
            stage.image,
            stage.argv,
            detach=True,
            working_dir=str(run_dir),
            volumes=_volumes(run_dir),
            # files in the run dir stay the caller's (LPX_DOCKER_USER overrides, e.g. 1000:1000)
            user=os.environ.get("LPX_DOCKER_USER") or f"{os.getuid()}:{os.getgid()}",
            environment={"CI": "true", "LPX_CACHE": f"{run_dir}/.cache", "HOME": str(run_dir)},
            shm_size="2g",  # torch.distributed's gloo/NCCL use /dev/shm
            device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])]
            if self.gpus
            else None,
            labels={"ai.lpx.stage": stage.name},
        )
        try:
            try:
                code = int(container.wait(timeout=timeout_s)["StatusCode"])
            except Exception as error:  # requests' ReadTimeout: the stage ran past its time
                if (
                    "timed out" not in str(error).lower()
                    and "timeout" not in type(error).__name__.lower()
                ):
                    raise
                container.kill()
                code = None
            except Interrupted:
                container.stop(timeout=10)
                raise
            log.write_bytes(container.logs(stdout=True, stderr=True))
            return code
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass


def _volumes(run_dir: Path) -> dict:
    """The run directory for a stage's container. Started from the host: a bind mount at the
    same path. Started from a container (compose): LPX_DOCKER_VOLUME=NAME:/MOUNT names the
    volume that holds the run directory under /MOUNT, mounted at the same place."""
    named = os.environ.get("LPX_DOCKER_VOLUME")
    if named:
        volume, _, mount = named.partition(":")
        if not mount or not str(run_dir).startswith(mount.rstrip("/") + "/"):
            raise BadInput(
                f"LPX_DOCKER_VOLUME={named}: the run directory {run_dir} must lie under its "
                "mount point (NAME:/MOUNT)."
            )
        return {volume: {"bind": mount, "mode": "rw"}}
    return {str(run_dir): {"bind": str(run_dir), "mode": "rw"}}


def make_runner(name: str, gpus: bool = False):
    return DockerRunner(gpus) if name == "docker" else LocalRunner()


def _kill_group(process: subprocess.Popen, sig) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    process.wait()
