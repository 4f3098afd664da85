"""Saved activations: :func:`offcore_torch.offload_activations` and what it is made of.

- :mod:`.offload`: the region (``OffloadHandle``): setup, context manager, figures; its methods in mixins:
  :mod:`.pack` (``_Pack``), :mod:`.unpack` (``_Unpack``), :mod:`.landings` (``_Residency``: landings,
  prefetch by next use, releases);
- :mod:`.copies`: module-level helpers of the region and the dispatch of landed copies (``poll``, ``synchronize``);
- :mod:`.records`: what the region keeps per saved tensor (entries and their states);
- :mod:`.storage`: which saved tensors are storages worth moving, and how they are read;
- :mod:`.policy`: :class:`~offcore_torch.OffloadPolicy` and :func:`~offcore_torch.no_offload`;
- :mod:`.nvme`: the NVMe hop of a region (host copies spilled to the tier and read back);
- :mod:`.stats`: :class:`~offcore_torch.OffloadStats`.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
