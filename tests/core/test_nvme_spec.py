"""The NVMe tier specification: a path and a byte budget."""

from __future__ import annotations

import os

import pytest

from offcore.errors import ConfigurationError
from offcore.nvme import NvmeSpec, as_spec


def test_a_path_becomes_a_spec_with_the_free_space_as_budget(tmp_path):
    spec = as_spec(tmp_path)
    assert spec == NvmeSpec(os.fspath(tmp_path))
    tier = spec.open()
    try:
        assert tier.budget > 0
        assert os.path.dirname(tier.directory) == os.fspath(tmp_path)
    finally:
        tier.close()
    assert as_spec(None) is None and as_spec(spec) is spec


def test_a_bad_budget_or_value_is_refused_when_given():
    with pytest.raises(ConfigurationError, match="budget"):
        NvmeSpec("/tmp", budget="lots")
    with pytest.raises(ConfigurationError, match="nvme= takes"):
        as_spec(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="directory path"):
        NvmeSpec("")
