"""WarmupLinearDecay: the LR curve against its formula, resume, bad arguments."""
import pytest

from roberta_fast.schedule import WarmupLinearDecay


def test_warmup_then_linear_decay():
    s = WarmupLinearDecay(peak_lr=6e-4, warmup_steps=4, total_steps=12, min_lr=1e-5)
    lrs = []
    for _ in range(14):
        lrs.append(s.lr())
        s.step()
    # warmup: peak * (u + 1) / warmup, reaching the peak on the last warmup update
    assert lrs[:4] == pytest.approx([1.5e-4, 3e-4, 4.5e-4, 6e-4])
    # decay: from the peak at update `warmup` down to min_lr at `total`, linearly
    decay = [1e-5 + (6e-4 - 1e-5) * (12 - u) / 8 for u in range(4, 13)]
    assert lrs[4:13] == pytest.approx(decay)
    assert lrs[12] == pytest.approx(1e-5) and lrs[13] == pytest.approx(1e-5)  # flat after the end
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_no_warmup_and_all_warmup():
    assert WarmupLinearDecay(1.0, 0, 10).lr() == 1.0
    s = WarmupLinearDecay(1.0, 10, 10)
    assert [s.lr_at(u) for u in (0, 9, 10)] == pytest.approx([0.1, 1.0, 1.0])


def test_state_dict_resumes_the_curve():
    a = WarmupLinearDecay(1e-3, 5, 50)
    for _ in range(17):
        a.step()
    b = WarmupLinearDecay(1e-3, 5, 50)
    b.load_state_dict(a.state_dict())
    assert b.num_updates == 17 and b.lr() == a.lr()


@pytest.mark.parametrize("kwargs, match", [
    (dict(peak_lr=0.0, warmup_steps=1, total_steps=2), "peak_lr"),
    (dict(peak_lr=1.0, warmup_steps=3, total_steps=2), "warmup_steps"),
    (dict(peak_lr=1.0, warmup_steps=0, total_steps=2, min_lr=2.0), "min_lr"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupLinearDecay(**kwargs)
