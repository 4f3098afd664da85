"""Saved activations: :func:`offcore_torch.offload_activations` and what it is made of.

- :mod:`.offload`: the region (``OffloadHandle``): pack/unpack hooks, copies, prefetch by next use;
- :mod:`.records`: what the region keeps per saved tensor (entries and their states);
- :mod:`.storage`: which saved tensors are storages worth moving, and how they are read;
- :mod:`.policy`: :class:`~offcore_torch.OffloadPolicy` and :func:`~offcore_torch.no_offload`;
- :mod:`.nvme`: the NVMe hop of a region (host copies spilled to the tier and read back);
- :mod:`.stats`: :class:`~offcore_torch.OffloadStats`.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
