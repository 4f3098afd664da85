"""Parameters streamed from the host by next use: :func:`offcore_torch.offload_parameters`.

- :mod:`.parameters`: ``offload_parameters``, ``ParameterOffloadHandle`` and ``ParameterOffloadStats``.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
