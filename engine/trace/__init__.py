"""``python -m engine trace``: a job's training step run at real size on fake tensors of an accelerator device type.

The model is built by the training job's own code (``engine.load.rank_model.build_rank_model``: PP split, TP/SP,
EP, CP, recompute, FSDP2) under ``torch._subclasses.FakeTensorMode`` (shapes, dtypes and a device, no storage) with
torch's fake process group (collectives that do nothing) of the job's world size, one rank at a time; one optimizer
step runs through the trainer's step runner and optimizer, and ``torch.distributed._tools.mem_tracker.MemTracker``
measures the rank's peak by kind. Nothing is allocated: minutes of CPU and little host memory at any model size.

- ``backend``: the fake device types (``cuda`` needs a CUDA build of torch; ``npu`` is torch's private-use backend
  renamed, with meta functions standing in for ``torch_npu``'s fused kernels).
- ``step``: one rank's trace (``trace_rank``).
- ``cli``: the command, beside ``python -m engine plan`` and with its flags.
"""
