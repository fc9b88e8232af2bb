"""A capture session whose engine runs on torchrun ranks: one worker group per session.

The parent (`lpx localize`) launches the ranks once when the side is opened (on the CPU
forked from a warm interpreter, pipeline/engines/warm_ranks.py; on a GPU under
`torch.distributed.run`);
rank 0 listens on a Unix socket in the group's folder, takes one request per forward (a
sequence, a precision, rows to swap in), shares it with the other ranks over the process
group, and sends each boundary's rows back as they are computed. Models load on the ranks
once per precision, on first use. The parent owns every timeout: the ranks wait as long as
it does, and a rank that dies or a group that stops answering becomes one BadInput line
naming the rank and its log, never a hang.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from pipeline.engines import warm_ranks
from pipeline.errors import BadInput

RANK_MODULE = "pipeline.localize.adapters._rank"
SOCKET = "rank0.sock"
AUTHKEY_VARIABLE = "LPX_CAPTURE_AUTHKEY"
PARENT_VARIABLE = "LPX_CAPTURE_PARENT"  # the ranks stop when this process is gone
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 20


class WorkerGroup:
    """The torchrun launch of one capture engine, and the connection to its rank 0."""

    def __init__(
        self, engine: str, model_dir: Path, knobs: dict, nproc: int, device: str, timeout: float
    ):
        from pipeline.engines.distributed import rank_environment

        self.engine = engine
        self.nproc = nproc
        self.timeout = timeout
        self.folder = Path(tempfile.mkdtemp(prefix=f"lpx-capture-{engine}-"))
        self._authkey = secrets.token_bytes(32)
        self._connection = None
        self._next_id = 0
        self._failed = False
        worker = ["--engine", engine, "--model", str(model_dir), "--knobs", json.dumps(knobs),
                  "--device", device, "--folder", str(self.folder)]  # fmt: skip
        # The ranks import the same lpx as this process, wherever they are started from.
        package_root = str(Path(__file__).resolve().parents[3])
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        environment = rank_environment(
            {
                AUTHKEY_VARIABLE: self._authkey.hex(),
                PARENT_VARIABLE: str(os.getpid()),
                "PYTHONPATH": path,
            }
        )
        # On the CPU the ranks are forked from a warm interpreter (engines/warm_ranks.py).
        self._log = None
        self.process = None
        if device == "cpu":
            self.process = warm_ranks.start_ranks(
                RANK_MODULE, worker, nproc, environment, self.folder, engine,
                per_launch=(AUTHKEY_VARIABLE, PARENT_VARIABLE),
            )  # fmt: skip
        if self.process is None:
            self._log = open(self.folder / "torchrun.log", "wb")  # noqa: SIM115 - closed in close()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", "-m", RANK_MODULE, *worker],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # one process group: a stop reaches torchrun and every rank
            )  # fmt: skip
        self._finalizer = weakref.finalize(self, _kill, self.process, self.folder)

    def request(self, message: dict, on_rows) -> None:
        """Send one capture request; call on_rows(name, rows) for each boundary until done."""
        if self._failed:
            raise BadInput(
                f"the {self.engine} capture workers failed earlier in this session; "
                f"see the rank logs in {self.folder}."
            )
        connection = self._connect()
        request_id = self._next_id
        self._next_id += 1
        try:
            connection.send({**message, "id": request_id})
        except OSError:
            self._fail("the connection to rank 0 broke while sending a request")
        pending_error = None
        while True:
            reply = self._receive(connection)
            kind, reply_id = reply[0], reply[1]
            if reply_id != request_id:
                continue  # the tail of an earlier request whose sink raised
            if kind == "done":
                break
            if pending_error is None:
                try:
                    on_rows(reply[2], reply[3])
                except Exception as error:  # noqa: BLE001 - re-raised once the ranks are done
                    pending_error = error
        if pending_error is not None:
            raise pending_error

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.send({"op": "stop"})
                self._connection.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        _kill(self.process, self.folder)
        self._finalizer.detach()
        if self._log is not None:
            self._log.close()
        if not self._failed:
            shutil.rmtree(self.folder, ignore_errors=True)

    def rank_pids(self) -> dict[int, int]:
        """The ranks' process ids (each rank writes its own when it starts)."""
        return rank_pids(self.folder)

    def _connect(self):
        from multiprocessing.connection import Client

        if self._connection is not None:
            return self._connection
        address = self.folder / SOCKET
        deadline = time.monotonic() + self.timeout
        while not address.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(f"the ranks did not start within {self.timeout:g} s")
            time.sleep(POLL_SECONDS)
        try:
            self._connection = Client(str(address), family="AF_UNIX", authkey=self._authkey)
        except (OSError, EOFError):
            self._check_alive()
            self._fail("rank 0 refused the connection")
        return self._connection

    def _receive(self, connection):
        """The next reply, waiting at most `timeout` seconds for it."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if connection.poll(POLL_SECONDS):
                    return connection.recv()
            except (EOFError, OSError):
                self._wait_for_exit()
                self._fail("rank 0 closed its connection mid-capture")
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(
                    f"no answer within {self.timeout:g} s (a hung collective, or a forward "
                    "slower than that: raise the timeout knob, e.g. timeout=1800)"
                )

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            self._fail("the worker group exited")

    def _wait_for_exit(self) -> None:
        """Let torchrun finish tearing the ranks down, so their own errors are on disk."""
        try:
            self.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass

    def _fail(self, what: str):
        from pipeline.engines.distributed import failure, torchrun_reported

        self._failed = True
        running = self.process.poll() is None
        _kill(self.process, self.folder)
        if isinstance(self.process, warm_ranks.RankGroup):
            (self.folder / "launch.log").write_text("\n".join(self.process.lines) + "\n")
            output, reported = "", sorted(self.process.codes.items())
        else:
            self._log.flush()
            output = (self.folder / "torchrun.log").read_text(errors="replace")
            reported = torchrun_reported(output)
        # A group that stopped answering was killed here: the ranks have no error of their own.
        cause = "" if running else failure(self.folder, reported, output)
        detail = f": {cause}" if cause else f" (rank logs: {self.folder})"
        raise BadInput(
            f"{self.engine} capture on {self.nproc} rank(s) failed, {what}{detail}."
        ) from None


def rank_pids(folder: Path) -> dict[int, int]:
    pids = {}
    for path in folder.glob("rank*.pid"):
        try:
            pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return pids


def _kill(process, folder: Path) -> None:
    """Kill torchrun and every rank. torchrun starts each rank in a session of its own, so
    the ranks are killed by their own ids: a stopped or hung rank ignores torchrun's SIGTERM.
    Ranks forked warm are killed by the group that knows their ids."""
    if isinstance(process, warm_ranks.RankGroup):
        process.kill()
        return
    for pid in rank_pids(folder).values():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"pipeline.localize.adapters._rank" in command:  # not a recycled id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait()


class WorkerSession:
    """The capture session interface (`pipeline.localize.adapters`) over a WorkerGroup."""

    can_replace = True

    def __init__(
        self,
        name: str,
        group: WorkerGroup,
        dtype: str,
        reference_dtype: str,
        layout: dict,
        boundaries: list[str],
        scores_own: bool = False,
    ):
        # whether its ranks can report a replaced op's own output first (the HF hooks can)
        self.scores_own = scores_own
        self.name = name
        self.group = group
        self.dtype = dtype
        self.reference_dtype = reference_dtype
        self.layout = layout
        self.boundaries = boundaries

    def capture(
        self, token_ids, precision: str, sink, replace: dict | None = None, own_first=False
    ) -> None:
        if replace and not self.can_replace:
            raise BadInput(f"{self.name} cannot take another side's activations.")
        message = {
            "op": "capture",
            "precision": precision,
            "tokens": [int(t) for t in token_ids],
            "replace": dict(replace or {}),
            "own_first": bool(own_first),
        }
        self.group.request(message, sink)

    def close(self) -> None:
        self.group.close()
