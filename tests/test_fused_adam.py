"""roberta_fast.FusedAdam against torch.optim.AdamW, its plain-PyTorch reference.

Covers: 120-step parity on a small model with decay / no-decay groups and a
multi-chunk tensor (fp32, 1e-6 relative), multi-chunk tensors, the fp16/bf16 master-weight paths
against an fp32 reference, loss-scale unscaling, skip-on-overflow (inf and NaN),
fused gradient clipping, exact state_dict round-trips (also CPU <-> GPU on a GPU),
parameters without gradients, and clear errors on bad input.
"""
import copy
import io

import pytest
import torch

import roberta_fast as rf
from roberta_fast.optim import param_groups_for_weight_decay

HYPER = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-6)


def model(device):
    """Linear layers of odd sizes and a LayerNorm."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(7, 30), torch.nn.LayerNorm(30), torch.nn.GELU()]
    layers += [torch.nn.Linear(30, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3)]
    return torch.nn.Sequential(*layers).to(device)


def rel_err(a, b):
    """Largest difference relative to the reference tensor's largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def fused_and_reference(device, **kw):
    m = model(device)
    r = copy.deepcopy(m)
    opt = rf.FusedAdam(param_groups_for_weight_decay(m, 0.01), **HYPER, **kw)
    ref = torch.optim.AdamW(param_groups_for_weight_decay(r, 0.01), **HYPER)
    return m, opt, r, ref


def backward(m, x, scale=1.0):
    (m(x).pow(2).mean() * scale).backward()


def test_param_groups_for_weight_decay():
    m = model("cpu")
    decay, no_decay = param_groups_for_weight_decay(m, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and len(decay["params"]) == 3
    ln = m[1]
    assert any(p is ln.weight for p in no_decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 5


def test_parity_with_adamw(device):
    m, opt, r, ref = fused_and_reference(device)
    g = torch.Generator().manual_seed(1)
    for step in range(120):
        x = torch.randn(5, 7, generator=g).to(device)
        for mod, o in ((m, opt), (r, ref)):
            o.zero_grad()
            backward(mod, x)
            o.step()
        if step % 20 == 0 or step == 119:
            for p, q in zip(m.parameters(), r.parameters()):
                assert rel_err(p, q) < 1e-6, step
    for p, q in zip(m.parameters(), r.parameters()):
        s, t = opt.state[p], ref.state[q]
        assert s["step"].item() == t["step"].item() == 120
        assert rel_err(s["exp_avg"], t["exp_avg"]) < 1e-5
        assert rel_err(s["exp_avg_sq"], t["exp_avg_sq"]) < 1e-5


def test_multi_chunk_tensors(device):
    """Tensors of several chunks (65536 elements) and enough elements for the CPU's
    OpenMP path, with awkward sizes, against AdamW."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (300007, 65537, 1)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = rf.FusedAdam(params, **HYPER)
    ref = torch.optim.AdamW(refs, **HYPER, weight_decay=0.01)
    for _ in range(3):
        for p, q in zip(params, refs):
            p.grad = torch.randn(p.shape, device=device)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, refs):
        assert rel_err(p, q) < 1e-6


@pytest.mark.parametrize("dtype, grad_dtype", [(torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32)])
def test_master_weights(device, dtype, grad_dtype):
    """Low-precision parameters with fp32 master weights follow the fp32 reference
    fed with the same gradients; the parameters are the masters, rounded."""
    torch.manual_seed(0)
    shapes = [(33, 17), (17,), (5, 3)]
    ref_params = [torch.randn(s, device=device) for s in shapes]
    params = [torch.nn.Parameter(p.to(dtype)) for p in ref_params]
    ref_params = [torch.nn.Parameter(p.to(dtype).float()) for p in ref_params]
    if grad_dtype != dtype:
        try:  # torch >= 2.10 lets a parameter hold a gradient of another dtype (older ones take the
            for p in params:  # attribute as a plain Python one and refuse the gradient)
                p.grad_dtype = grad_dtype
                p.grad = torch.zeros(p.shape, dtype=grad_dtype, device=device)
        except (AttributeError, TypeError, RuntimeError):
            pytest.skip("this torch cannot hold gradients of another dtype than the parameter (torch >= 2.10)")
    opt = rf.FusedAdam(params, **HYPER)
    ref = torch.optim.AdamW(ref_params, **HYPER, weight_decay=0.01)
    for _ in range(30):
        for p, q in zip(params, ref_params):
            g = torch.randn(p.shape, device=device).to(grad_dtype)
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
    for p, q in zip(params, ref_params):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and rel_err(master, q) < 1e-6
        assert torch.equal(p, master.to(dtype))
    # Without master weights the update happens in place, rounded each step.
    opt2 = rf.FusedAdam([torch.nn.Parameter(torch.ones(8, dtype=dtype, device=device))],
                        master_weights=False, **HYPER)
    p = opt2.param_groups[0]["params"][0]
    p.grad = torch.full_like(p, 0.5)
    opt2.step()
    assert "master_param" not in opt2.state[p] and p.dtype == dtype
    expected = 1.0 * (1 - 3e-3 * 0.01) - 3e-3 * 0.5 / (0.5 + 1e-6)   # first step: m/sqrt(v) = 1
    assert torch.allclose(p.float(), torch.full_like(p.float(), expected), rtol=1e-2)


def test_grad_scale_and_overflow_skip(device):
    m, opt, r, ref = fused_and_reference(device)
    x = torch.randn(4, 7, device=device)
    # Step 1: scaled gradients, unscaled by the optimizer.
    opt.zero_grad(), ref.zero_grad()
    backward(m, x, scale=1024.0)
    backward(r, x)
    scale = torch.tensor(1024.0, device=device)
    opt.step(grad_scale=scale)
    ref.step()
    assert not opt.last_step_skipped and not opt.found_inf.item()
    for p, q in zip(m.parameters(), r.parameters()):
        assert rel_err(p, q) < 1e-6
    # Step 2: an overflow (inf, then NaN) leaves everything untouched.
    for bad in (float("inf"), float("nan")):
        before = copy.deepcopy(opt.state_dict())
        params = [p.detach().clone() for p in m.parameters()]
        opt.zero_grad()
        backward(m, x, scale=1024.0)
        m[0].bias.grad[3] = bad
        opt.step(grad_scale=scale)
        assert opt.found_inf.device.type == device.type and opt.last_step_skipped
        for p, q in zip(m.parameters(), params):
            assert torch.equal(p, q)
        after = opt.state_dict()
        for k, state in before["state"].items():
            for name, t in state.items():
                assert torch.equal(t, after["state"][k][name]), name
    # Step 3: finite again; it is the second step taken.
    opt.zero_grad(), ref.zero_grad()
    backward(m, x, scale=1024.0)
    backward(r, x)
    opt.step(grad_scale=1024.0)   # a plain number is accepted too
    ref.step()
    assert not opt.last_step_skipped
    for p, q in zip(m.parameters(), r.parameters()):
        assert opt.state[p]["step"].item() == 2 and rel_err(p, q) < 1e-6


@pytest.mark.parametrize("max_norm", [0.05, 1e3])   # clipping, and a norm below the limit
def test_fused_clipping(device, max_norm):
    m, opt, r, ref = fused_and_reference(device)
    for _ in range(3):
        x = torch.randn(6, 7, device=device)
        opt.zero_grad(), ref.zero_grad()
        backward(m, x, scale=256.0)
        backward(r, x)
        norm = opt.clip_grad_norm_(max_norm, grad_scale=torch.tensor(256.0, device=device))
        ref_norm = torch.nn.utils.clip_grad_norm_(r.parameters(), max_norm)
        assert norm.device.type == device.type
        assert torch.allclose(norm, ref_norm, rtol=1e-5)
        opt.step(grad_scale=torch.tensor(256.0, device=device))
        ref.step()
        for p, q in zip(m.parameters(), r.parameters()):
            assert rel_err(p, q) < 1e-6


def test_clipping_skips_on_nan(device):
    m, opt, _, _ = fused_and_reference(device)
    backward(m, torch.randn(2, 7, device=device))
    m[-1].weight.grad[0, 0] = float("nan")
    params = [p.detach().clone() for p in m.parameters()]
    assert not torch.isfinite(opt.clip_grad_norm_(1.0))
    opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))


def test_params_without_grad_are_left_alone(device):
    m, opt, _, _ = fused_and_reference(device)
    backward(m, torch.randn(2, 7, device=device))
    m[0].weight.grad = None
    before = m[0].weight.detach().clone()
    opt.step()
    assert torch.equal(m[0].weight, before) and m[0].weight not in opt.state
    assert not opt.last_step_skipped and opt.found_inf is None


def run_steps(m, opt, n, seed, device):
    g = torch.Generator().manual_seed(seed)
    dtype = next(m.parameters()).dtype
    for _ in range(n):
        opt.zero_grad()
        backward(m, torch.randn(3, 7, generator=g).to(device=device, dtype=dtype), scale=8.0)
        opt.step(grad_scale=torch.tensor(8.0, device=device))


def roundtrip(src_device, dst_device, dtype):
    m = model(src_device).to(dtype)
    opt = rf.FusedAdam(param_groups_for_weight_decay(m, 0.01), **HYPER)
    run_steps(m, opt, 4, 0, src_device)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, map_location="cpu")
    m2 = model(dst_device).to(dtype)
    m2.load_state_dict(ckpt["model"])
    opt2 = rf.FusedAdam(param_groups_for_weight_decay(m2, 0.01), lr=1.0)  # lr comes from the ckpt
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    for p in m2.parameters():
        for name, t in opt2.state[p].items():
            assert t.device.type == torch.device(dst_device).type and t.dtype == torch.float32
    run_steps(m, opt, 3, 1, src_device)
    run_steps(m2, opt2, 3, 1, dst_device)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p.cpu(), q.cpu())
        for name, t in opt.state[p].items():
            assert torch.equal(t.cpu(), opt2.state[q][name].cpu()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_roundtrip(device, dtype):
    roundtrip(device, device, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_state_dict_moves_between_cpu_and_gpu():
    """CPU and GPU compute the same math in fp32 but may round differently: the
    moved optimizer must continue from the exact loaded state, checked on one side."""
    m = model("cpu")
    opt = rf.FusedAdam(param_groups_for_weight_decay(m, 0.01), **HYPER)
    run_steps(m, opt, 2, 0, "cpu")
    m2 = copy.deepcopy(m).cuda()
    opt2 = rf.FusedAdam(param_groups_for_weight_decay(m2, 0.01), **HYPER)
    opt2.load_state_dict(opt.state_dict())
    for p, q in zip(m.parameters(), m2.parameters()):
        for name, t in opt.state[p].items():
            assert opt2.state[q][name].is_cuda and torch.equal(t, opt2.state[q][name].cpu())
    run_steps(m, opt, 2, 1, "cpu")
    run_steps(m2, opt2, 2, 1, "cuda")
    for p, q in zip(m.parameters(), m2.parameters()):
        assert rel_err(q.cpu(), p) < 1e-5
    opt3 = rf.FusedAdam(param_groups_for_weight_decay(m, 0.01), **HYPER)
    opt3.load_state_dict(opt2.state_dict())
    assert all(t.is_cpu for s in opt3.state.values() for t in s.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_many_tensors_and_chunks_on_gpu():
    """More tensors and chunks than one multi-tensor launch holds, mixed dtypes."""
    torch.manual_seed(0)
    sizes = [1, 7, 1023, 65536, 65537, 3 * 2**20 + 5] + [257] * 60 + [24 * 2**20 + 3]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    params += [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
               for n in (5, 70001)]
    # Views at an odd offset: not 16-byte aligned, so the scalar (unvectorised) path.
    params += [torch.nn.Parameter(torch.randn(n + 1, device="cuda", dtype=dt)[1:])
               for n, dt in ((70001, torch.float32), (1027, torch.float16))]
    refs = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = rf.FusedAdam(params, **HYPER)
    ref = torch.optim.AdamW(refs, **HYPER, weight_decay=0.01)
    for _ in range(3):
        for p, q in zip(params, refs):
            g = torch.randn(p.shape, device="cuda")
            p.grad, q.grad = g.to(p.dtype), g.to(p.dtype).float()
        opt.step(grad_scale=torch.tensor(1.0, device="cuda"))
        ref.step()
    for p, q in zip(params, refs):
        w = opt.state[p].get("master_param", p)
        assert rel_err(w, q) < 1e-5


def test_bad_input(device):
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        rf.FusedAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64, device=device))])
    with pytest.raises(ValueError, match="lr"):
        rf.FusedAdam([torch.nn.Parameter(torch.zeros(3, device=device))], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        rf.FusedAdam([torch.nn.Parameter(torch.zeros(3, device=device))], betas=(0.9, 1.0))
    p = torch.nn.Parameter(torch.zeros(4, 3, device=device).t())
    p.grad = torch.zeros_like(p)
    opt = rf.FusedAdam([p])
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    q = torch.nn.Parameter(torch.zeros(3, device=device))
    q.grad = torch.zeros_like(q)
    opt = rf.FusedAdam([q])
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(0.0)
    with pytest.raises(ValueError, match="one element"):
        opt.step(grad_scale=torch.ones(2, device=device))
    if torch.cuda.is_available():
        other = "cpu" if device.type == "cuda" else "cuda"
        with pytest.raises(ValueError, match="grad_scale is on"):
            opt.step(grad_scale=torch.ones((), device=other))
        r = torch.nn.Parameter(torch.zeros(3, device=other))
        r.grad = torch.zeros_like(r)
        with pytest.raises(ValueError, match="one device"):
            rf.FusedAdam([q, r]).step()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_get_masters_when_the_loaded_state_has_none(device, dtype):
    """An fp32 run's state resumed into fp16/bf16 parameters: without fp32 master weights
    updates of 1e-5 round away in the parameter and nothing ever changes."""
    q = torch.nn.Parameter(torch.ones(4, device=device))
    fp32 = rf.FusedAdam([q], lr=1e-5, weight_decay=0.0)
    q.grad = torch.ones_like(q)
    fp32.step()
    p = torch.nn.Parameter(torch.ones(4, device=device, dtype=dtype))
    opt = rf.FusedAdam([p], lr=1e-5, weight_decay=0.0)
    opt.load_state_dict(fp32.state_dict())
    for _ in range(100):
        p.grad = torch.ones_like(p)
        opt.step()
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32 and (master < 1 - 5e-4).all()
    assert torch.equal(p, master.to(dtype))


@pytest.mark.parametrize("step", [1, 1.0, torch.tensor(1.0, dtype=torch.float64), torch.tensor([1])])
def test_a_loaded_step_of_another_type_becomes_an_fp32_scalar(device, step):
    """Older torch and converters store "step" as a number or a float64 tensor."""
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = rf.FusedAdam([p])
    p.grad = torch.ones_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = step
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = rf.FusedAdam([q])
    opt2.load_state_dict(sd)
    got = opt2.state[q]["step"]
    assert got.dtype == torch.float32 and got.shape == () and got.device == p.device
    for o, param in ((opt, p), (opt2, q)):
        param.grad = torch.ones_like(param)
        o.step()
    assert torch.equal(q, p)


def test_torch_adamws_fp16_moments_load_as_fp32(device):
    """torch.optim.AdamW on fp16 parameters saves fp16 moments; the update keeps them in fp32, so they
    are widened on loading (the step once refused them with 'exp_avg must be float32'). torch's
    updates FusedAdam does not compute are refused by name."""
    p = torch.nn.Parameter(torch.randn(6, device=device).half())
    torch_adam = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    p.grad = torch.randn_like(p)
    torch_adam.step()
    saved = torch_adam.state_dict()
    for name in ("exp_avg", "exp_avg_sq"):  # fp16, as torch >= 2.7 saves them on fp16 parameters (2.6: fp32)
        saved["state"][0][name] = saved["state"][0][name].half()
    widened = copy.deepcopy(saved)
    for name in ("exp_avg", "exp_avg_sq"):
        widened["state"][0][name] = widened["state"][0][name].float()
    results = []
    for state in (saved, widened):
        q = torch.nn.Parameter(p.detach().clone())
        opt = rf.FusedAdam([q], lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
        opt.load_state_dict(state)
        assert opt.state[q]["exp_avg"].dtype == opt.state[q]["exp_avg_sq"].dtype == torch.float32
        q.grad = torch.ones_like(q)
        opt.step()
        results.append(q.detach().clone())
    assert torch.equal(*results)
    others = [(torch.optim.AdamW([p], amsgrad=True), "amsgrad")]
    adam = torch.optim.Adam([p], weight_decay=0.01)
    if "decoupled_weight_decay" in adam.state_dict()["param_groups"][0]:  # (torch 2.6's Adam saves as AdamW)
        others.append((adam, "L2 weight decay"))
    for other, refused in others:
        with pytest.raises(ValueError, match=refused):
            rf.FusedAdam([p]).load_state_dict(other.state_dict())


def test_clip_and_step_must_share_the_loss_scale(device):
    """clip_grad_norm_ measures the norm of the gradients divided by its grad_scale; a step() given
    another scale clipped and unscaled by mismatched factors without a word (moments 1024x off)."""
    p = torch.nn.Parameter(torch.ones(5, device=device))
    opt = rf.FusedAdam([p])
    p.grad = torch.full_like(p, 1024.0)
    scale = torch.tensor(1024.0, device=device)
    def steps():
        return int(opt.state[p]["step"]) if p in opt.state else 0

    for done, (clip_scale, step_scale) in enumerate(
            ((None, 1024.0), (1024.0, None), (scale, torch.tensor(512.0, device=device)))):
        opt.clip_grad_norm_(1.0, grad_scale=clip_scale)
        with pytest.raises(ValueError, match="pass the same loss scale to both"):
            opt.step(grad_scale=step_scale)
        assert steps() == done  # nothing was updated
        opt.step(grad_scale=clip_scale)  # the pending clip is kept for the right call
    assert steps() == 3
    for clip_scale, step_scale in ((None, 1.0), (1024.0, 1024.0), (scale, scale), (scale, scale.clone())):
        opt.clip_grad_norm_(1.0, grad_scale=clip_scale)
        opt.step(grad_scale=step_scale)


def test_a_non_contiguous_gradient_is_named(device):
    p = torch.nn.Parameter(torch.zeros(3, 4, device=device))
    p.grad = torch.zeros(4, 3, device=device).t()
    with pytest.raises(ValueError, match=r"gradients must be contiguous.*p\.grad\.contiguous"):
        rf.FusedAdam([p]).step()


def test_load_state_dict_keeps_the_saved_group_keys(device):
    """An LR scheduler writes initial_lr into the groups and needs it to resume (last_epoch >= 0);
    load_state_dict kept only the keys a fresh FusedAdam has, so the scheduler's rebuild raised a
    KeyError, where torch's optimizers keep every saved key (their own switches, foreach etc., are dropped)."""
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = rf.FusedAdam([p], lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    opt.param_groups[0]["my_tag"] = "encoder"
    fresh = rf.FusedAdam([torch.nn.Parameter(torch.ones(3, device=device))], lr=1e-3)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["initial_lr"] == 1e-3 and fresh.param_groups[0]["my_tag"] == "encoder"
    torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1.0, last_epoch=3)  # raised KeyError
    fresh.load_state_dict(torch.optim.AdamW([p], foreach=True).state_dict())
    assert "foreach" not in fresh.param_groups[0]
