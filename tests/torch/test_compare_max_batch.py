"""``offcore compare``'s measured max batch is a measurement (Note [The max batch is probed by real steps]).

The search (:func:`offcore_torch.compare.max_batch.probe_max_batch`) on a known answer, and on a small
workload the figure compare reports against its training steps run again on fresh sanitized fake
devices: the measured max batch runs, one batch more runs out of memory.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from offcore_torch.compare.compare import run_compare  # noqa: E402
from offcore_torch.compare.max_batch import probe_max_batch  # noqa: E402
from offcore_torch.compare.settings import CompareSettings  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402
from offcore.sim import Plan  # noqa: E402


def _fits_up_to(answer: int) -> tuple[list[int], Any]:
    seen: list[int] = []

    def fits(batch: int) -> bool:
        seen.append(batch)
        return batch <= answer

    return seen, fits


@pytest.mark.parametrize(
    ("answer", "guess", "probes"),
    [
        (24, 24, 2),  # the simulator right: the guess and its neighbour
        (23, 24, 2),  # one too many: the guess fails, its neighbour fits
        (30, 24, 6),  # widening upwards: 25, 27, 31 bracket it, then bisection (29, 30)
        (17, 24, 6),  # widening downwards: 23, 21, 17, then 19, 18
    ],
)
def test_the_search_finds_the_largest_fitting_batch_with_few_probes(answer: int, guess: int, probes: int) -> None:
    seen, fits = _fits_up_to(answer)
    found, record = probe_max_batch(fits, guess=guess, limit=1000)
    assert found == answer
    assert [b for b, _ in record] == seen and len(seen) == probes, seen
    assert all(ok == (b <= answer) for b, ok in record)


def test_the_search_respects_multiples_and_known_batches() -> None:
    seen, fits = _fits_up_to(13)
    found, _ = probe_max_batch(fits, guess=16, multiple=4, fits_at=8, limit=64)
    assert found == 12 and all(b % 4 == 0 for b in seen) and 8 not in seen
    seen, fits = _fits_up_to(5)
    found, _ = probe_max_batch(fits, guess=7, fails_at=8, limit=64)  # a strategy that ran out of memory at 8
    assert found == 5 and 8 not in seen
    seen, fits = _fits_up_to(0)
    assert probe_max_batch(fits, guess=3, fails_at=8, limit=64)[0] == 0, "not even batch 1 fits"
    seen, fits = _fits_up_to(8)
    assert probe_max_batch(fits, guess=8, fits_at=8, fails_at=9, limit=64) == (8, []), "already bracketed"


def test_the_search_gives_up_above_the_limit_or_after_too_many_probes() -> None:
    seen, fits = _fits_up_to(10_000)
    found, record = probe_max_batch(fits, guess=8, limit=64)
    assert found is None and max(seen) <= 64 and record
    seen, fits = _fits_up_to(500)
    assert probe_max_batch(fits, guess=1, limit=10_000, max_probes=4)[0] is None
    assert len(seen) == 4
    with pytest.raises(ConfigurationError):
        probe_max_batch(fits, guess=1, multiple=0, limit=10)


SMALL = {"batch": 4, "seq_len": 32, "layers": 3, "d_model": 64, "heads": 2, "vocab": 32, "warmup": 0, "iters": 2}


def _runs(report: Any, name: str, batch: int, make_fake_device: Any) -> bool:
    """Whether compare's two full training steps (``_steps_run``) of ``name``'s plan run at ``batch`` on a
    fresh sanitized fake device with the compared capacity and link (compare probes on unsanitized ones)."""
    from offcore_torch.compare.max_batch import _steps_run

    link = report.device
    device = make_fake_device(
        capacity=link["capacity_bytes"],
        d2h_bandwidth=link["d2h_bandwidth"],
        h2d_bandwidth=link["h2d_bandwidth"],
        latency=link["latency_s"],
    )
    plan = Plan.from_dict(report.result(name).plan_dict)
    return _steps_run(device, CompareSettings(**{**SMALL, "batch": batch}), plan, batch)


@pytest.fixture(scope="module")
def small_compare() -> Any:
    """Batch 2 on 3 MiB: the max batches lie above it (offload's ~3x), so the search widens and bisects."""
    settings = CompareSettings(
        **{**SMALL, "batch": 2}, strategies=("baseline", "checkpoint", "offload"), observe=False, capacity=3 << 20
    )
    return run_compare(settings)


@pytest.mark.parametrize("name", ["baseline", "checkpoint", "offload"])
def test_the_measured_max_batch_runs_and_one_more_does_not(
    small_compare: Any, name: str, make_fake_device: Any
) -> None:
    row = small_compare.result(name)
    assert row.max_batch_source == "measured", (name, row.max_batch_source, small_compare.notes)
    # the bracket: probed, or the timed run at --batch (it ran, or it ran out of memory)
    timed = [small_compare.workload["batch"], row.status == "ok"]
    assert [row.max_batch, True] in [*row.max_batch_probes, timed], row.max_batch_probes
    assert [row.max_batch + 1, False] in [*row.max_batch_probes, timed], row.max_batch_probes
    assert row.max_batch >= 1
    assert _runs(small_compare, name, row.max_batch, make_fake_device), (name, row.max_batch)
    assert not _runs(small_compare, name, row.max_batch + 1, make_fake_device), (name, row.max_batch)


def test_without_probing_the_extrapolation_is_shown_and_labelled() -> None:
    comparison = run_compare(
        CompareSettings(**SMALL, strategies=("baseline", "checkpoint"), observe=False, probe_max_batch=False)
    )
    row = comparison.result("checkpoint")
    assert row.max_batch_source == "extrapolated" and not row.max_batch_probes
    assert row.max_batch == row.extrapolated_max_batch and row.max_batch
    headers, rows = comparison.table()
    cells = {r[0]: r[headers.index("max batch")] for r in rows}
    assert cells["checkpoint"] == f"~{row.max_batch}"
    assert "~extrapolated" in "\n".join(comparison.scale_lines())


def test_probes_on_the_compared_device_itself_find_the_same_batch(small_compare: Any, make_fake_device: Any) -> None:
    """Another backend's probes run on the compared device (its capacity cap is process-wide): same answer,
    and nothing left allocated after its out-of-memory probe."""
    from offcore_torch.compare.max_batch import _measure_max_batch

    row = small_compare.result("checkpoint")
    link = small_compare.device
    options = {
        "capacity": link["capacity_bytes"],
        "d2h_bandwidth": link["d2h_bandwidth"],
        "h2d_bandwidth": link["h2d_bandwidth"],
        "latency": link["latency_s"],
    }
    device = make_fake_device(**options)
    settings = CompareSettings(**{**SMALL, "batch": small_compare.workload["batch"]}, capacity=options["capacity"])
    reported: list[int] = []
    found, probes, why = _measure_max_batch(
        settings,
        Plan.from_dict(row.plan_dict),
        device,
        options,
        guess=row.predicted_max_batch,
        ran=True,
        report=lambda steps, label: reported.append(steps),
        label="checkpoint",
        fresh=False,
    )
    assert (found, why) == (row.max_batch, ""), probes
    assert device.memory_stats().get("allocated_bytes", 0) == 0
    assert sum(reported) == 4, "the progress bar gets the estimated probes' steps (CompareSettings.total_steps)"


def test_the_progress_bar_ends_at_its_total() -> None:
    settings = CompareSettings(**SMALL, strategies=("baseline", "offload", "optimizer-offload-nvme"), observe=False)
    reported: list[int] = []
    run_compare(settings, progress=lambda steps, label: reported.append(steps))
    assert sum(reported) == settings.total_steps and min(reported) >= 0
