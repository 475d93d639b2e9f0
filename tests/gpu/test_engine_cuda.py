"""The one-process engine on a GPU (run on the GPU machine: `python -m pytest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

import hdet
from hdet.engine import ReplicaEngine
from hdet.app.tasks import ByteGPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _lm(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, 256), b[..., 1:].reshape(-1))


def _engine(mode, N=4, steps=20, auto=True, attn="auto"):
    torch.manual_seed(0)
    model = ByteGPT(32, 64, 2, 2, attn=attn).cuda()
    return ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=steps,
                                                               ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                               controller="paper", enable_auto_lr=auto, auto_lr_warmup_steps=5,
                                                               replicas=rep, model=m), mode=mode)


def test_vmap_on_cuda_matches_loop_and_never_syncs_off_sync_steps():
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (20, 4, 8, 33), device="cuda", generator=g)
    engines = {m: _engine(m) for m in ("loop", "vmap")}
    for mode, eng in engines.items():
        for t in range(1, 21):
            sync = eng.schedulers[0].is_sync_step(t)
            torch.cuda.set_sync_debug_mode(0 if (sync or t == 1) else "error")  # step 1: vmap decides
            try:
                eng.step(data[t - 1], _lm, stacked=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert eng.mode == mode
    # the replicas folded into one SDPA call (vmap) and one call each (loop) round differently, and Adam magnifies it
    for a, b in zip(engines["loop"].models[0].parameters(), engines["vmap"].models[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert engines["vmap"].schedulers[0].ensemble.controllers[0].updates == 4


def test_a_model_calling_sdpa_stays_vmapped_on_cuda():
    """F.scaled_dot_product_attention under the engine's vmap is one fused call for all replicas (hdet.attention);
    before, the memory-efficient kernel's backward failed under vmap and the engine fell back to its loop."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (6, 4, 8, 33), device="cuda", generator=g)
    engines = {m: _engine(m, attn="sdpa") for m in ("loop", "auto")}
    for eng in engines.values():
        for t in range(6):
            eng.step(data[t], _lm, stacked=True)
    assert engines["auto"].mode == "vmap"
    for a, b in zip(engines["loop"].models[0].parameters(), engines["auto"].models[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
