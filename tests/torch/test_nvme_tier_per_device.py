"""``offcore_torch.nvme_tier``: one tier per device, shared; a per-call spec opens its own."""

from __future__ import annotations

import os

import offcore_torch
from offcore_torch.nvme import open_nvme

import offcore


def test_one_tier_per_device_and_closing_removes_its_files(tmp_path):
    dev = offcore.device("cpu", capacity="16MiB")
    tier = offcore_torch.nvme_tier(dev, tmp_path, budget="4MiB")
    assert tier is not None and tier.budget == 4 * 1024**2
    assert offcore_torch.nvme_tier_for(dev) is tier
    assert open_nvme(dev, None) == (tier, False)
    own, owned = open_nvme(dev, tmp_path)
    assert owned and own is not tier
    own.close()
    directory = tier.directory
    assert os.path.isdir(directory)
    assert offcore_torch.nvme_tier(dev, None) is None
    assert not os.path.exists(directory) and tier.closed
    assert offcore_torch.nvme_tier_for(dev) is None
