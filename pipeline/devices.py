"""Where a model runs: ``--device auto|cpu|cuda|cuda:N`` resolved against what this process
sees, and the hardware a result was computed on.

The one module that names CUDA. Engines ask it for their torch device, the collective
backend of their ranks, the TF32 setting and a hardware report for their metadata (GPU,
compute capability, CUDA, cuDNN, NCCL, driver), so the history sees a GPU or driver change.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from functools import lru_cache

from pipeline.errors import BadInput, DeviceOutOfMemory

CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_device(spec: str, option: str = "--device") -> str:
    """The spec, checked for syntax only (no torch import): auto, cpu, cuda or cuda:N."""
    text = str(spec).strip().lower()
    match = _SPEC.match(text)
    if not match or (match.group(2) is not None and match.group(1) != "cuda"):
        raise BadInput(f"{option} {spec!r}: expected {CHOICES}.")
    return text


def resolve_device(spec: str = "auto", option: str = "--device") -> str:
    """``cpu`` or ``cuda:N`` for a spec: auto is CUDA when a CUDA device is visible.

    Under torchrun a bare ``cuda`` is this rank's GPU (LOCAL_RANK); CUDA_VISIBLE_DEVICES
    is respected because torch numbers only the devices it leaves visible.
    """
    text = parse_device(spec, option)
    if text == "cpu":
        return "cpu"
    visible = visible_gpus()
    if text == "auto":
        return f"cuda:{_local_rank()}" if visible else "cpu"
    if not visible:
        raise BadInput(
            f"{option} {spec}: no CUDA device is visible here ({_why_no_cuda()}); "
            "use --device cpu, or run on a GPU host."
        )
    index = int(text.split(":")[1]) if ":" in text else _local_rank()
    if index >= visible:
        raise BadInput(
            f"{option} {spec}: only {visible} CUDA device(s) are visible"
            f"{_visible_note()}; use cuda:0 to cuda:{visible - 1}."
        )
    return f"cuda:{index}"


def device_kind(device: str) -> str:
    """cpu or cuda: what a layout records (which GPU index is not part of a case)."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def is_cuda(device) -> bool:
    return device_kind(str(device)) == "cuda"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_ranks(nproc: int, device: str, option: str = "--nproc") -> None:
    """One rank per GPU: NCCL refuses two ranks on one device, so say so before launching."""
    if not is_cuda(device):
        return
    visible = visible_gpus()
    if nproc > visible:
        raise BadInput(
            f"{option} {nproc}: only {visible} CUDA device(s) are visible{_visible_note()}, "
            f"and each rank needs its own; lower {option} to {visible}, or score on the CPU "
            "with --device cpu."
        )


def physical_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry for torch's device ``index`` (pins one GPU for a child)."""
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[index] if index < len(listed) else str(index)


def rank_device(kind: str) -> str:
    """This torchrun rank's device: its own GPU (LOCAL_RANK, made current) or the CPU."""
    if device_kind(kind) != "cuda":
        return "cpu"
    import torch

    index = _local_rank()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def cpu_streams_do_nothing():
    """On a CPU-only process: CUDA streams and their events as no-ops (code that overlaps a
    device-to-host copy on a side stream, megatron's alltoall dispatcher, runs as is); the
    stream object, for code that holds one of its own."""
    import contextlib

    import torch

    class HostStream:
        def wait_stream(self, other) -> None:
            pass

        def record_event(self):
            return self

        def synchronize(self) -> None:
            pass

    stream = HostStream()
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.stream = lambda chosen=None: contextlib.nullcontext()
    return stream


def cpu_stands_in_for_cuda() -> None:
    """megatron-core hard-wires CUDA in a few places that scoring on a CPU reaches (RoPE
    moves its frequencies to `torch.cuda.current_device()`): point those at the CPU. For a
    process that scores on the CPU only."""
    import torch

    torch.cuda.current_device = lambda: "cpu"


def collective_backend(device: str) -> str:
    return "nccl" if is_cuda(device) else "gloo"


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block on ``count`` intra-op torch threads, then restore the count.

    A float32 result's bits depend on the thread count, so what must be bit-exact (the tiny
    model's training, a reference scored as one thread) runs under this. It calls
    ``torch._C.set_num_threads``: vLLM's CPU worker replaces ``torch.set_num_threads`` with a
    no-op in any process it ran in, and a plain call there would leave the count unchanged.
    """
    import torch

    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def set_tf32(device: str, allowed: bool) -> dict:
    """TF32 matmuls and convolutions on (``allowed``) or off, read back for the metadata.

    Off by default: an fp32 replay must be IEEE fp32, and a library imported earlier may
    have turned TF32 on. On the CPU there is nothing to set.
    """
    if not is_cuda(device):
        return {"allow_tf32": False, "matmul_precision": "highest"}
    import torch

    torch.set_float32_matmul_precision("high" if allowed else "highest")
    torch.backends.cudnn.allow_tf32 = allowed
    return {
        "allow_tf32": torch.get_float32_matmul_precision() != "highest",
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


def fp16_emulated(device: str) -> str | None:
    """Why fp16 is emulated on this device, or None where it runs natively (CUDA, Arm, x86
    with AVX512-FP16 or AMX-FP16). Without those, torch's CPU kernels compute fp16 through
    fp32 conversions: on an AMD EPYC a calibration at 16 x 1024 spent 823 s on fp16 and 122 s
    on fp32 (issue 42); on a Xeon with AVX512-FP16 an fp16 matmul (256 x 1024 x 4096) took
    0.6x fp32's time."""
    if is_cuda(device) or platform.machine().lower() in ("arm64", "aarch64"):
        return None
    if {"avx512_fp16", "amx_fp16"} & cpu_flags():
        return None
    return (
        "this CPU has no fp16 arithmetic (neither AVX512-FP16 nor AMX-FP16): torch computes "
        "fp16 through fp32 conversions there, several times slower than fp32"
    )


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags /proc/cpuinfo lists (empty where it lists none): torch's CPU
    kernels, and vLLM-CPU's, pick their code by them."""
    try:
        with open("/proc/cpuinfo") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.split(":", 1)[-1].split())


def hardware(device: str) -> dict:
    """What scored: the device, and for a GPU its name, compute capability, memory, the CUDA,
    cuDNN and NCCL versions torch runs with, and the driver."""
    if not is_cuda(device):
        from pipeline.testbed import cpu_model

        return {"device": "cpu", "name": cpu_model(), "cpu_count": os.cpu_count()}
    import torch

    index = torch.device(device).index or 0
    properties = torch.cuda.get_device_properties(index)
    return {
        "device": f"cuda:{index}",
        "name": properties.name,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **cuda_stack(),
    }


def cuda_stack() -> dict:
    """CUDA, cuDNN and NCCL as torch runs them, and the driver: the versions the history's
    attribution lists when they change between nights."""
    import torch

    from pipeline.testbed import nvidia_gpus

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        nccl = None
    gpus = nvidia_gpus()
    return {
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        "nccl": nccl,
        "driver": gpus[0]["driver"] if gpus else None,
    }


def stack_versions(device: str) -> dict:
    """The CUDA stack for an engine's ``versions`` (empty on the CPU)."""
    return cuda_stack() if is_cuda(device) else {}


def to_host_later(tensor):
    """(a host copy of ``tensor``, a function to call before reading it). On a GPU the copy
    is queued behind the work that makes the tensor, so the host can go on launching."""
    if not is_cuda(tensor.device):
        return tensor.cpu(), lambda: None
    import torch

    host = tensor.to("cpu", non_blocking=True)  # into pinned memory, in stream order
    copied = torch.cuda.Event()
    copied.record()
    return host, copied.synchronize


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in str(error)


def release_memory(device: str) -> None:
    """Hand cached blocks back after an out-of-memory error, so the process can go on."""
    if is_cuda(device):
        import torch

        torch.cuda.empty_cache()


def out_of_memory(device: str, where: str, lower: str) -> DeviceOutOfMemory:
    """The exit-2 error for a CUDA out-of-memory: where it happened and what to lower."""
    free = ""
    if is_cuda(device):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory
        free = f" ({total / 2**30:.0f} GiB device)"
    return DeviceOutOfMemory(f"CUDA out of memory on {device}{free} at {where}; lower {lower}.")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def _visible_note() -> str:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={listed})" if listed is not None else ""


def _why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and not listed.strip():
        return "CUDA_VISIBLE_DEVICES is empty"
    return "no GPU or driver found"
