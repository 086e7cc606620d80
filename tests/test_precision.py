"""DynamicLossScaler's policy and state; precision resolution and autocast."""
import pytest
import torch

from roberta_fast.precision import DynamicLossScaler, autocast, resolve_precision


def test_scale_halves_on_overflow_and_doubles_after_a_window():
    s = DynamicLossScaler(init_scale=1024.0, window=3)
    s.update(found_inf=True)
    assert (s.scale, s.skipped, s.bad_in_a_row) == (512.0, 1, 1)
    s.update(found_inf=True)
    assert (s.scale, s.bad_in_a_row) == (256.0, 2)
    s.update(False)
    s.update(False)
    assert s.scale == 256.0 and s.bad_in_a_row == 0
    s.update(False)  # third clean step in a row
    assert s.scale == 512.0 and s.good_steps == 0
    s.update(False)
    s.update(True)  # an overflow restarts the window
    s.update(False)
    s.update(False)
    assert s.scale == 256.0 and s.skipped == 3


def test_scale_never_falls_below_the_floor():
    s = DynamicLossScaler(init_scale=1.0, min_scale=0.25)
    for _ in range(10):
        s.update(True)
    assert s.scale == 0.25


def test_disabled_scaler_keeps_one_but_counts():
    s = DynamicLossScaler(init_scale=2 ** 16, window=1, enabled=False)
    s.update(True)
    s.update(False)
    assert s.scale == 1.0 and s.skipped == 1


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=2 ** 10, window=5)
    for found in (True, False, False):
        a.update(found)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ValueError):
        DynamicLossScaler(window=0)


def test_precision_resolution_and_autocast():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("fp16", cpu) == "fp16"
    with pytest.raises(ValueError, match="precision must be"):
        resolve_precision("fp8", cpu)
    x = torch.randn(4, 4)
    with autocast("bf16", cpu):
        assert (x @ x).dtype == torch.bfloat16
    with autocast("fp32", cpu):
        assert (x @ x).dtype == torch.float32


@pytest.mark.parametrize("capability, auto", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_picks_bf16_where_native_and_fp16_on_older_gpus(monkeypatch, capability, auto):
    """V100 (sm_70) and T4 (sm_75) get fp16 with loss scaling, never fp32 (no tensor cores) nor
    bf16 (emulated: torch.cuda.is_bf16_supported() says yes there, so it is not what decides)."""
    from roberta_fast import ops
    from roberta_fast.precision import describe_auto, explain

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(ops, "device_capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU sm_{capability[0]}{capability[1]}")
    gpu = torch.device("cuda", 0)
    assert resolve_precision("auto", gpu) == auto
    assert resolve_precision("fp16", gpu) == "fp16"
    assert resolve_precision("fp32", gpu) == "fp32"
    why = explain("auto", gpu)
    assert why == f"--precision auto -> {describe_auto(gpu)[1]}" and auto in why
    if auto == "fp16":
        assert "loss scaling" in why and f"sm_{capability[0]}{capability[1]}" in why
        with pytest.raises(ValueError, match=f"bf16 is not supported on GPU sm_{capability[0]}{capability[1]}.*use fp16"):
            resolve_precision("bf16", gpu)
    else:
        assert resolve_precision("bf16", gpu) == "bf16"
    assert explain("fp32", gpu) == "--precision fp32, as asked"
