"""Parameters streamed from the host by next use: :func:`offcore_torch.offload_parameters`.

- :mod:`.parameters`: ``offload_parameters`` and ``ParameterOffloadHandle`` (setup, the public methods), with
  its methods in mixins: :mod:`.nvme` (``_NvmeTier``), :mod:`.device` (``_DeviceMemory``), :mod:`.steps`
  (``_Steps``), :mod:`.hooks` (``_Hooks``);
- :mod:`.state`: what the handle keeps per parameter and per step, and ``ParameterOffloadStats``;
- :mod:`.tensors`: ``OffloadedParameter``, ``OffloadedBuffer`` and their ``__torch_function__``.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
