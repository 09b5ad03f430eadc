"""MFU's denominator: the CPU matmul rate is measured alongside the run, so MFU cannot ride on a low start-up sample."""
from __future__ import annotations

import pytest
import torch

from aligner.training import metrics
from aligner.training.metrics import PeakRate


@pytest.fixture
def fake_rates(monkeypatch):
    """cpu_matmul_flops returns the queued rates in turn; the clock is ours."""
    rates: list[float] = []
    clock = [0.0]
    monkeypatch.setattr(metrics, "cpu_matmul_flops", lambda *args, **kwargs: rates.pop(0))
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return rates, clock


def test_a_step_faster_than_the_startup_sample_triggers_a_new_sample(fake_rates):
    rates, _ = fake_rates
    rates += [50e9, 180e9]  # start-up under load, then the quiet machine
    peak = PeakRate(None)
    assert peak.flops == 50e9
    achieved = 120e9
    assert achieved / peak.refresh(achieved) == pytest.approx(120 / 180)  # not 2.4
    assert not rates


def test_the_best_rate_is_kept_and_resampled_only_when_due(fake_rates):
    rates, clock = fake_rates
    rates += [150e9, 90e9]
    peak = PeakRate(None, resample_s=30.0)
    clock[0] = 10.0
    assert peak.refresh(60e9) == 150e9 and len(rates) == 1  # not due, not exceeded: no sample
    clock[0] = 40.0
    assert peak.refresh(60e9) == 150e9 and not rates  # sampled (a loaded 90), the best stays


def test_a_configured_peak_is_never_measured(fake_rates):
    rates, clock = fake_rates
    peak = PeakRate(2.0)
    clock[0] = 1e6
    assert peak.refresh(5e12) == 2e12  # a configured peak is the user's statement; MFU may exceed 1 against it


def test_the_real_measurement_is_a_plausible_rate():
    flops = metrics.cpu_matmul_flops(size=256, repeats=2)
    assert 1e8 < flops < 1e14
