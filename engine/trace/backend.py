"""Fake accelerator device types for a trace on a machine with none.

``cuda``: fake CUDA tensors need a torch built with CUDA (no GPU needed): in a CPU-only build autograd aborts the
process (``c10::Error: PyTorch is not linked with support for cuda devices`` from ``AccumulateGrad``), so that is
refused up front with a clear error. ``npu``: torch's private-use backend renamed ``npu`` with a Python device guard
and a stream/event module of no-ops (``torch.utils.backend_registration``), which any torch build has; FSDP2's
streams and events do nothing on it, as the collectives do nothing on the fake process group.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from engine.trace import npu_kernels

TRACE_DEVICE_TYPES = ("cuda", "npu")
_RNG_STATE = torch.zeros(8, dtype=torch.uint8)


class _Event:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """FSDP2 asks the device module for streams it orders its copies and collectives on: nothing runs here."""

    def __init__(self, device: object = None, priority: int = 0, **kwargs: object) -> None:
        self.device, self.priority = torch.device("npu", 0), priority

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> object:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeNpuModule:
    """What torch and FSDP2 look up on ``torch.npu``: one device, streams and events that do nothing."""

    Stream = _Stream
    Event = _Event

    def is_available(self) -> bool:
        # False keeps FakeTensorMode from running ``torch.tensor(..., device="npu")`` for real (its constant
        # propagation through device moves is skipped only where no device is available)
        return False

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: object) -> None:
        pass

    def current_stream(self, device: object = None) -> _Stream:
        return _Stream()

    def default_stream(self, device: object = None) -> _Stream:
        return _Stream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def synchronize(self, device: object = None) -> None:
        pass

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device: object = None) -> torch.Tensor:
        # the pipeline schedule forks the RNG around its shape inference: one host state made before any trace,
        # so that the stand-in creates no host tensor inside the step
        return _RNG_STATE

    def set_rng_state(self, state: torch.Tensor, device: object = None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


@functools.cache
def _register_npu() -> None:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    name = torch._C._get_privateuse1_backend_name()
    if name == "npu":  # already renamed (by this process's first trace)
        return
    if name != "privateuseone":
        raise RuntimeError(f"device_type npu: torch's private-use backend is already {name!r} in this process")
    _setup_privateuseone_for_python_backend("npu", backend_module=FakeNpuModule())
    # what ``engine.parallel.device.import_torch_npu`` imports, with the fused kernels the engine calls (fake ops)
    module = sys.modules.setdefault(
        "torch_npu", types.ModuleType("torch_npu", "fake torch_npu of a trace (engine.trace)")
    )
    npu_kernels.install(module)


def prepare(device_type: str) -> None:
    """Make ``device_type`` usable by fake tensors in this process; ValueError naming the field when it cannot be."""
    if device_type == "cuda":
        if not torch.cuda._is_compiled():
            raise ValueError(
                "device_type: tracing on cuda needs a CUDA build of torch (no GPU needed); this torch "
                f"({torch.__version__}) is CPU-only, where autograd on fake CUDA tensors aborts the process. "
                "Trace on npu here, or run the trace from an environment with torch's CUDA wheel"
            )
        if not torch.cuda.is_available():
            # measured with torch 2.13+cu130 and no driver: the forward runs on fake CUDA tensors (once the runtime
            # calls FSDP2 makes are answered), the first backward fails in C++ (``hasPrimaryContext expects a valid
            # device index``): autograd records CUDA streams, which needs a context (pytorch#92627)
            raise ValueError(
                "device_type: tracing on cuda needs a visible CUDA device (autograd on fake CUDA tensors needs a CUDA "
                "context; nothing is allocated on it). Trace on npu here, or run the trace on a GPU host"
            )
        return
    if device_type == "npu":
        _register_npu()
        return
    raise ValueError(f"device_type: the trace runs on {' or '.join(TRACE_DEVICE_TYPES)}, not {device_type!r}")
