"""reliability.spike_factor: which steps run again, and how their two results are compared."""
from __future__ import annotations

import pytest
import torch

from megatier.faults import ActivationFlip, gradient_nan, parameter_flip
from megatier.training.sdc import MIN_HISTORY, SpikeCheck, ranks_that_differ
from tests.unit.training.runs import train_records


def test_nonfinite_steps_are_suspicious_outside_fp16_and_spikes_once_there_is_a_history():
    check = SpikeCheck(10.0, loss_scaled=False)
    assert check.suspicious(float("nan"), 4.0) == "loss nan, gradient norm 2.0"
    assert check.suspicious(3.0, float("nan")) == "loss 3.0, gradient norm nan"
    assert check.suspicious(3.0, float("inf")) is not None
    assert check.suspicious(300.0, 1e6) is None  # no history yet: the first steps are never spikes
    for _ in range(MIN_HISTORY):
        check.applied(3.0, 2.0)
    assert check.suspicious(29.0, 4.0) is None and check.suspicious(3.0, 399.0) is None
    assert check.suspicious(31.0, 4.0) == "loss 31 is more than 10 x the median 3"
    assert check.suspicious(3.0, 441.0) == "gradient norm 21 is more than 10 x the median 2"
    assert SpikeCheck(0.0, False).suspicious(1e9, 1.0) is None  # spikes off
    assert SpikeCheck(10.0, loss_scaled=True).suspicious(float("nan"), float("inf")) is None  # the scaler's


def test_results_are_compared_bit_for_bit():
    a, b = torch.tensor([1.0, float("nan")]), torch.tensor(2.5)
    assert ranks_that_differ((a, b), (a.clone(), b.clone()), None, torch.device("cpu")) == []  # NaN == NaN here
    assert ranks_that_differ((a, b), (a, torch.tensor(2.5000002)), None, torch.device("cpu")) == [0]
    assert ranks_that_differ((torch.tensor(0.0),), (torch.tensor(-0.0),), None, torch.device("cpu")) == [0]


def test_the_flip_is_armed_by_step_and_rank():
    assert ActivationFlip.from_env(0, {}).step is None
    assert ActivationFlip.from_env(3, {"MEGATIER_FLIP_AT": "7"}).step == 7
    assert ActivationFlip.from_env(3, {"MEGATIER_FLIP_AT": "7:2"}).step is None
    assert ActivationFlip.from_env(2, {"MEGATIER_FLIP_AT": "7:2"}).step == 7
    with pytest.raises(ValueError, match="is not <step>\\[:<rank>\\]"):
        ActivationFlip.from_env(0, {"MEGATIER_FLIP_AT": "soon"})
    assert gradient_nan(1, {"MEGATIER_GRAD_NAN_AT": "4:1"}).step == 4
    grad = torch.ones(3)
    planted = gradient_nan(0, {"MEGATIER_GRAD_NAN_AT": "4"})
    planted.plant(3, grad)
    assert torch.isfinite(grad).all()
    planted.plant(4, grad)
    assert grad.isnan().tolist() == [True, False, False]
    planted.plant(4, grad.fill_(1.0))  # once only: the step's second run is clean
    assert torch.isfinite(grad).all() and planted.fired
    params = torch.full((2,), 0.5)
    parameter_flip(0, {"MEGATIER_PARAM_FLIP_AT": "2"}).plant(2, params)
    assert params[0].item() == 0.5 * 2.0 ** 128 and params[1].item() == 0.5  # bit 30: the exponent's highest


@pytest.mark.parametrize("fault", ["MEGATIER_FLIP_AT", "MEGATIER_GRAD_NAN_AT"])
def test_a_transient_fault_is_caught_and_the_run_ends_bit_identical(tiny_config, tmp_path, monkeypatch, fault):
    """A bit flipped in an activation, or a NaN planted in the local gradient, once at step 12: the step runs
    again, the second result is used, and the run ends with the state of a run without the fault."""
    clean = train_records(tiny_config("train.iters=14", f"logging.run_dir={tmp_path / 'clean'}"))
    monkeypatch.setenv(fault, "12")
    flipped = train_records(tiny_config("train.iters=14", f"logging.run_dir={tmp_path / 'flipped'}"))
    (event,) = [r for r in flipped if r.get("event") == "rerun"]
    assert event["step"] == 12 and event["transient"] and event["ranks"] == [0]
    assert [r for r in clean if r.get("event") == "rerun"] == []
    assert flipped[-1]["state_digest"] == clean[-1]["state_digest"]
    assert [r["loss"] for r in flipped if "loss" in r] == [r["loss"] for r in clean if "loss" in r]
