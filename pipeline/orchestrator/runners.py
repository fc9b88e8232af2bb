"""Where a stage's `lpx` command runs: a local process, or a container of the stage's image.

Both return the command's exit code, or None when it ran past its timeout (then it is
killed, its ranks included). Neither imports an engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline import warm_start
from pipeline.errors import BadInput, Interrupted
from pipeline.orchestrator.docker_mounts import HostView, lent, stage_mounts
from pipeline.orchestrator.outside import MODEL_CACHE
from pipeline.orchestrator.stages import Stage


class StageFailed(Exception):
    """The stage could not run, or was stopped from outside; the message says why and what
    to do (its exit code alone would not)."""


class ServerFailed(StageFailed):
    """The stage's server exited or never answered its health check."""


class DockerLost(Exception):
    """The Docker daemon stopped answering during a stage: every later stage would fail too."""


# Thread counts the caller set reach the stage's container as they reach a local stage's
# process: a container sees every core, and torch's default of a thread per core, next to
# other work on the same cores, spins at every barrier.
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _thread_settings() -> dict[str, str]:
    return {name: os.environ[name] for name in THREAD_SETTINGS if os.environ.get(name)}


def server_argv(stage: Stage, model: Path) -> list[str]:
    port = str(stage.server.port)
    return [a.replace("{model}", str(model)).replace("{port}", port) for a in stage.server.argv]


class LocalRunner:
    """Each stage as a process here: in lpx's own interpreter, or in ``python`` (an
    environment's, pipeline/environments.py) when one is given."""

    name = "local"

    def __init__(self, python: Path | None = None):
        self.python = str(python) if python else sys.executable

    def start_server(self, stage: Stage, run_dir: Path, model: Path, log: Path):
        """Start the stage's server as a process; return (its URL, a handle to stop it)."""
        argv = server_argv(stage, model)
        if argv[0] in ("python", "python3"):  # the interpreter lpx runs in (its venv)
            argv[0] = self.python
        out = open(log, "w", encoding="utf-8")
        process = subprocess.Popen(
            argv,
            cwd=run_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **stage.server.env},
        )
        url = f"http://127.0.0.1:{stage.server.port}"
        deadline = time.monotonic() + stage.server.start_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                out.close()
                raise ServerFailed(f"the server exited with {process.returncode} (see {log.name})")
            try:
                urllib.request.urlopen(url + stage.server.health, timeout=2)
                return url, (process, out)
            except OSError:
                time.sleep(1)
        self.stop_server((process, out))
        raise ServerFailed(
            f"the server did not answer {stage.server.health} in "
            f"{stage.server.start_timeout_s:g} s (see {log.name})"
        )

    def stop_server(self, handle) -> None:
        process, out = handle
        _kill_group(process, signal.SIGTERM)
        out.close()

    def image(self, stage: Stage) -> dict | None:
        return None

    def run(self, stage: Stage, run_dir: Path, log: Path, timeout_s: float) -> int | None:
        warm = warm_start.warm_interpreter(self.python)
        if warm is not None:
            try:
                ran, code = warm_start.run_stage(warm, stage.argv, run_dir, log, timeout_s)
            finally:
                warm.lock.release()
            if ran:
                return code
        with open(log, "w", encoding="utf-8") as out:
            process = subprocess.Popen(
                [self.python, "-m", "pipeline", *stage.argv],
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
    and every path the stage reads outside it (read-only) mounted at the same absolute path,
    so every path in the files means the same inside and out (docker_mounts.py). GPU plans
    get every GPU (a device request); logs go to the stage's log file."""

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
        # where lpx runs in a container itself, how the daemon's host sees its paths
        self.host = HostView.of(self.client)
        self._images: dict[str, dict] = {}
        self._network: str | None = None  # the stage's server network, while one runs

    def start_server(self, stage: Stage, run_dir: Path, model: Path, log: Path):
        """The server in its own container on a network of its own; the stage's container
        joins that network and reaches it by name. Health is polled inside the server's
        container, so it works whether lpx runs on the host or in a container itself."""
        with self.answering():
            return self._start_server(stage, run_dir, model, log)

    def _start_server(self, stage: Stage, run_dir: Path, model: Path, log: Path):
        import docker

        argv = server_argv(stage, model)
        tag = uuid.uuid4().hex[:10]
        network = self.client.networks.create(f"lpx-{tag}")
        common = self._common(run_dir, stage)
        common["environment"].update(stage.server.env)
        container = self.client.containers.run(
            stage.server.image or stage.image,
            argv[1:],
            entrypoint=[argv[0]],
            name=f"lpx-server-{tag}",
            network=network.name,
            **common,
        )
        handle = (container, network, log)
        probe = (
            "import urllib.request; urllib.request.urlopen("
            f"'http://127.0.0.1:{stage.server.port}{stage.server.health}', timeout=3)"
        )
        deadline = time.monotonic() + stage.server.start_timeout_s
        while time.monotonic() < deadline:
            container.reload()
            if container.status in ("exited", "dead"):
                self.stop_server(handle)
                raise ServerFailed(f"the server container exited (see {log.name})")
            try:
                if container.exec_run(["python3", "-c", probe]).exit_code == 0:
                    self._network = network.name
                    return f"http://lpx-server-{tag}:{stage.server.port}", handle
            except docker.errors.APIError:
                pass
            time.sleep(2)
        self.stop_server(handle)
        raise ServerFailed(
            f"the server did not answer {stage.server.health} in "
            f"{stage.server.start_timeout_s:g} s (see {log.name})"
        )

    def stop_server(self, handle) -> None:
        import docker

        container, network, log = handle
        self._network = None
        try:
            log.write_bytes(container.logs(stdout=True, stderr=True))
            container.remove(force=True)
            network.remove()
        except (docker.errors.APIError, *_connection_errors()):
            pass  # a daemon that went away has failed the stage already; nothing left to stop

    def _common(self, run_dir: Path, stage: Stage) -> dict:
        from docker.types import Mount

        specs = stage_mounts(run_dir, stage.reads, self.host)
        mounts = [Mount(m.target, m.source, type=m.kind, read_only=m.read_only) for m in specs]
        # the host's kept tiny builds, where the model stage was lent them
        kept = [r.path for r in stage.reads if r.key == MODEL_CACHE and lent(r.path, specs)]
        cache = {"LPX_MODEL_CACHE": kept[0]} if kept else {}
        return dict(
            detach=True,
            working_dir=str(run_dir),
            mounts=mounts,
            # files in the run dir stay the caller's (LPX_DOCKER_USER overrides, e.g. 1000:1000)
            user=os.environ.get("LPX_DOCKER_USER") or f"{os.getuid()}:{os.getgid()}",
            environment={
                "CI": "true",
                "LPX_CACHE": f"{run_dir}/.cache",
                "HOME": str(run_dir),
                **cache,
                **_thread_settings(),
            },
            shm_size="2g",  # torch.distributed's gloo/NCCL use /dev/shm
            device_requests=gpu_requests() if self.gpus else None,
        )

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
        import docker

        self.image(stage)
        labels = {"ai.lpx.stage": stage.name, "ai.lpx.run": str(run_dir)}
        with self.answering():
            self._remove_leftovers(labels)
            try:
                container = self.client.containers.run(
                    stage.image,
                    stage.argv,
                    labels=labels,
                    # the limit is the whole limit: no swap beyond it
                    mem_limit=stage.memory,
                    memswap_limit=stage.memory,
                    **({"network": self._network} if self._network else {}),
                    **self._common(run_dir, stage),
                )
            except docker.errors.APIError as error:
                raise StageFailed(
                    f"Docker did not start its container ({_explain(error)}); check the "
                    "stage's image and memory: in the plan"
                ) from None
            try:
                code = self._wait(container, timeout_s)
                log.write_bytes(container.logs(stdout=True, stderr=True))
                if code != 0:
                    _raise_if_killed(container, stage)
                return code
            finally:
                try:
                    container.remove(force=True)
                except (docker.errors.APIError, *_connection_errors()):
                    pass  # gone with the daemon; removed as a leftover on --resume

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Turn a daemon that stops answering (stopped, restarted, its socket gone) into
        DockerLost: the run stops there, and --resume finishes it once Docker is back."""
        try:
            yield
        except _connection_errors() as error:
            raise DockerLost(
                f"the Docker daemon stopped answering during the stage ({_why(error)})"
            ) from None

    def _wait(self, container, timeout_s: float) -> int | None:
        try:
            return int(container.wait(timeout=timeout_s)["StatusCode"])
        except Exception as error:  # requests' ReadTimeout: the stage ran past its time
            if (
                "timed out" not in str(error).lower()
                and "timeout" not in type(error).__name__.lower()
            ):
                raise
            container.kill()
            return None
        except Interrupted:
            container.stop(timeout=10)
            raise

    def _remove_leftovers(self, labels: dict) -> None:
        """A container of this stage and run left behind by a daemon that went away."""
        filters = {"label": [f"{key}={value}" for key, value in labels.items()]}
        for container in self.client.containers.list(all=True, filters=filters):
            container.remove(force=True)


def _raise_if_killed(container, stage: Stage) -> None:
    """A container the kernel killed for memory fails with that reason, not an exit code."""
    container.reload()
    if not container.attrs.get("State", {}).get("OOMKilled"):
        return
    if stage.memory:
        raise StageFailed(
            f"killed for memory: its container reached its limit of {stage.memory}; raise the "
            "stage's memory: in the plan (or give it fewer sequences)"
        )
    raise StageFailed(
        "killed for memory: the host ran out of memory; set a memory: limit on the stage, or "
        "run fewer stages on this host at once"
    )


def _why(error: BaseException) -> str:
    """requests' ('Connection aborted.', FileNotFoundError(...)) as words."""
    parts = [
        arg.rstrip(".") if isinstance(arg, str) else getattr(arg, "strerror", None) or str(arg)
        for arg in error.args
    ]
    text = ": ".join(part for part in parts if part) or type(error).__name__
    return text.splitlines()[0][:200]


def _explain(error) -> str:
    return str(getattr(error, "explanation", None) or error).splitlines()[0][:200]


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What the Docker SDK raises when the daemon does not answer (requests, underneath)."""
    import requests

    return (requests.exceptions.ConnectionError,)


def gpu_requests() -> list:
    """Docker device requests for a GPU stage: the GPUs CUDA_VISIBLE_DEVICES names on the
    host (so a runner shared by several jobs keeps each to its own), else every GPU."""
    from docker.types import DeviceRequest

    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if listed:
        return [DeviceRequest(device_ids=listed, capabilities=[["gpu"]])]
    return [DeviceRequest(count=-1, capabilities=[["gpu"]])]


def make_runner(name: str, gpus: bool = False):
    return DockerRunner(gpus) if name == "docker" else LocalRunner()


def _kill_group(process: subprocess.Popen, sig) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    process.wait()
