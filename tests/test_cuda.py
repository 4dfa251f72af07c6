"""CUDA: exact conversion with TF32 off, bf16/fp16 error, AMP training, --compile, bit-exact resume
with --deterministic, DDP over NCCL under torchrun.

Marked ``cuda`` and skipped where there is no GPU (CI has none). On a GPU machine run
``pytest -m cuda tests/test_cuda.py``, or ``python bench/gpu_suite.py OUT``, which runs these and
records the figures. Tiny configs: the file takes well under a minute on an H100.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# cuBLAS reads this once, at its first use: set before any test touches the GPU (--deterministic)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_RUN, conv_model, rel_err, tiny_config
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.training import TrainConfig
from convit_convert.train.run import run
from convit_convert.verify import verify_models

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY = {**TINY_RUN, "depth": 2, "workers": 0, "warmup_epochs": 1, "device": "cuda"}
PLAIN = dict(mixup=0.0, cutmix=0.0, smoothing=0.0, drop_path=0.0, aa="none", reprob=0.0)


def converted(dtype: torch.dtype = torch.float32):
    conv = conv_model(dtype=torch.float64)  # 12×8 px, P = 4, K = 5, depth 2, random affines
    plan = ConversionSpec().plan(conv.cfg)
    sd, mcfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(mcfg).double().eval()
    attn.load_state_dict(sd)
    return conv, attn


def test_conversion_is_exact_on_cuda_with_tf32_off() -> None:
    """verify_models on CUDA passes at 1e-5 even with TF32 switched on globally (it switches TF32
    off while it checks, and back on after); the CUDA fp32 logits match the float64 conv model on
    the CPU (an independent device and precision) to 1e-5: fp32's unit roundoff is 6e-8, and the
    CPU measures ~8e-8 on this model."""
    conv, attn = converted()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        result = verify_models(conv, attn, device="cuda", dtype=torch.float32, tol=1e-5)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's defaults
    assert result.passed and result.device == "cuda", result.worst
    assert result.worst.rel < 1e-5
    x = torch.randn(4, 3, *conv.cfg.img_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = conv.cpu().double()(x)
        out = attn.cuda().float()(x.float().cuda()).cpu().double()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_low_precision_error_is_the_formats_not_the_conversions(dtype: torch.dtype, bound: float) -> None:
    """Under autocast the converted model's logits are off by about what the conv model's own are
    (both against float64): the conversion adds no error of its own. Bounds: ~5× the unit roundoff
    (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4) times a few roundings per block; the CPU measured
    3.8e-3 for bf16 on this model."""
    conv, attn = converted()
    x = torch.randn(4, 3, *conv.cfg.img_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = conv(x)
        conv32, attn32, xc = conv.float().cuda(), attn.float().cuda(), x.float().cuda()
        with torch.autocast("cuda", dtype=dtype):
            e_attn = rel_err(attn32(xc).double().cpu(), ref)
            e_conv = rel_err(conv32(xc).double().cpu(), ref)
    assert 0 < e_attn < bound, (e_attn, e_conv)
    assert e_attn < 2 * e_conv + 1e-3, (e_attn, e_conv)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_training_steps_both_phases(tmp_path: Path, amp: str) -> None:
    """Phase 1, then phase 2 from its exact conversion, on CUDA under AMP: finite losses, and every
    phase moves the weights it started from."""
    p1 = run(tiny_config(tmp_path / "p1", TINY, epochs=1, amp=amp))
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in p1.rows)
    conv = load_file(str(p1.out / "conv.safetensors"))
    p2 = run(
        tiny_config(
            tmp_path / "p2", TINY, phase="phase2", epochs=1, amp=amp, init=str(p1.out / "conv.safetensors")
        )
    )
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in p2.rows)
    vit = load_file(str(p2.out / "vit.safetensors"))
    assert all(torch.isfinite(t).all() for t in vit.values())
    assert not torch.equal(vit["blocks.0.mlp.fc1.weight"], conv["blocks.0.mlp.fc1.weight"])
    cfg = json.loads((p2.out / "config.json").read_text())
    assert cfg["amp"] == amp and cfg["init_info"]["init_kind"] == "conv"


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_compile_matches_eager(tmp_path: Path, phase: str) -> None:
    """--compile trains the same model as eager: one epoch of 16 steps, float32, losses within 1e-3
    relative (inductor reorders sums; measured differences without drop path are ~1e-6). Drop path
    0.1: the compiled step is given the masks the eager forward draws (train/step.py), here through
    CUDA graphs; that they are the eager masks is checked on the CPU (tests/test_step.py)."""
    kw = dict(phase=phase, epochs=1, amp="none", **{**PLAIN, "drop_path": 0.1})
    eager = run(tiny_config(tmp_path / "eager", TINY, **kw))
    compiled = run(tiny_config(tmp_path / "compiled", TINY, compile=True, **kw))
    for a, b in zip(eager.rows, compiled.rows, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-3)
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-3)


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_resume_on_cuda_is_bit_exact(tmp_path: Path, phase: str) -> None:
    """--deterministic, bf16, depth 2 with drop path, Mixup/CutMix, RandAugment, erasing and EMA
    (the full recipe): stopped mid epoch 2 and resumed equals straight through, bit for bit."""
    kw = dict(phase=phase, epochs=3, deterministic=True, model_ema=True, model_ema_decay=0.9, drop_path=0.1)
    straight = run(tiny_config(tmp_path / "a", TINY, **kw))
    first = run(tiny_config(tmp_path / "b", TINY, **kw), stop_after_steps=24)  # 16 steps/epoch
    assert first.stopped == "limit"
    resumed = run(tiny_config(tmp_path / "b", TINY, resume=True, **kw))
    name = "conv" if phase == "phase1" else "vit"
    for suffix in ("", "-ema"):
        a = load_file(str(straight.out / f"{name}{suffix}.safetensors"))
        b = load_file(str(resumed.out / f"{name}{suffix}.safetensors"))
        diff = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
        assert not diff, diff


def test_ddp_over_nccl_under_torchrun(tmp_path: Path) -> None:
    """torchrun with one process: a real NCCL process group and the DDP wrapper (not the
    single-process shortcut), the same training as a plain process to float rounding."""
    common = (
        "--data synthetic --img-size 16 --patch-size 4 --depth 2 --kernel-size 3 "
        "--epochs 2 --warmup-epochs 1 --lr 4e-3 --lr-base-batch 32 --batch-size "
        "32 --workers 0 --mixup 0 --cutmix 0 --drop-path 0 --device cuda --amp "
        "none"
    ).split()
    ddp = [
        sys.executable,
        *"-m torch.distributed.run --nproc-per-node 1 --master-port 29531 -m "
        "convit_convert train phase1".split(),
        *common,
        "-o",
        str(tmp_path / "ddp"),
    ]
    r = subprocess.run(ddp, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cfg = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert (cfg["backend"], cfg["world_size"]) == ("nccl", 1)
    single = [
        sys.executable,
        *"-m convit_convert train phase1".split(),
        *common,
        "-o",
        str(tmp_path / "one"),
    ]
    r = subprocess.run(single, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "one" / "config.json").read_text())["backend"] is None
    a, b = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "one")
    for ra, rb in zip(a, b, strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


@pytest.mark.parametrize("compiled", [False, True])
def test_attention_forms_agree_on_cuda(compiled: bool) -> None:
    """The by-head custom ops (form "by_head") against the padded batched products ("padded") on
    CUDA, eager and through inductor, float32 with TF32 off: outputs and every gradient of a
    gated layer (both softmaxes) and a hard one with a sink (padded key columns). 1e-5: both are
    float32 GEMMs over the same products, summed in different orders (fp32 unit roundoff 6e-8)."""
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        forms_agree(compiled)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def forms_agree(compiled: bool) -> None:
    from convit_convert.attention import RelPosAttention

    for gated in (False, True):
        torch.manual_seed(0)
        first = RelPosAttention(48, (7, 7), num_heads=9, qk_dim=16, v_dim=48, gated=gated).cuda()
        for t in first.parameters():
            torch.nn.init.normal_(t, std=0.3)
        if gated:
            torch.nn.init.constant_(first.gate, 0.5)
        x = torch.randn(4, 49, 48, device="cuda")
        results = []
        for form in ("padded", "by_head"):
            attn = RelPosAttention(
                48, (7, 7), num_heads=9, qk_dim=16, v_dim=48, gated=gated, form=form
            ).cuda()
            attn.load_state_dict(first.state_dict())
            torch._dynamo.reset()
            fn = torch.compile(attn) if compiled else attn
            attn.zero_grad()
            out = fn(x)
            out.square().sum().backward()
            results.append(
                torch.cat([out.detach().flatten()] + [t.grad.flatten() for t in attn.parameters()])
            )
        assert rel_err(results[1], results[0]) < 1e-5, gated


def test_device_loader_on_cuda_matches_cpu() -> None:
    """The device loader's batches on the GPU against the same step on the CPU (DeiT's
    RandAugment, crop, flip; erasing off, its normals come from each device's own generator):
    the same parameters, so every pixel within one grey level (resampling and rounding order
    differ between devices), nearly all exactly equal."""
    from convit_convert.loaders import EpochSampler, channel_stats
    from convit_convert.train.augment import augment_spec
    from convit_convert.train.held import HeldLoader

    mean, std = channel_stats(3)
    spec = augment_spec(TrainConfig.from_flags(reprob=0.0).recipe, (32, 32), mean, std)
    images = torch.randint(0, 256, (64, 3, 24, 24), dtype=torch.uint8)
    batches = []
    for dev in ("cpu", "cuda"):
        sampler = EpochSampler(64, rank=0, world=1, batch_size=32, seed=1, shuffle=True)
        sampler.set_epoch(2)
        loader = HeldLoader(images.to(dev), torch.arange(64, device=dev), sampler, spec, seed=1)
        batches.append(next(iter(loader))[0].cpu())
    level = torch.tensor(std).view(1, 3, 1, 1) * 255
    diff = ((batches[0] - batches[1]).abs() * level).round()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("compiled", [False, True])
def test_conv_forms_agree_on_cuda(compiled: bool) -> None:
    """Phase 1's token form (the default on CUDA) against F.conv2d on the pixel view, eager and
    through inductor: the output and every gradient of a mixer at P 16 / K 5 (strips of 96 and 12
    features) and at P 4 / K 5, float32 with TF32 off within 1e-5 (the same products summed in
    another order), and under bf16 autocast within 5e-2 (bf16 rounds inputs and weights to 8 bits)."""
    from convit_convert.conv_mixer import ConvMixer

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for c, k, p, grid in ((3, 5, 16, (5, 4)), (3, 5, 4, (7, 7))):
            torch.manual_seed(0)
            first = ConvMixer(c, k, 1, grid, p).cuda()
            assert first.form_on(torch.device("cuda")) == "tokens"  # auto
            x = torch.randn(8, grid[0] * grid[1], p * p * c, device="cuda")
            for amp, tol in ((None, 1e-5), (torch.bfloat16, 5e-2)):
                results = []
                for form in ("pixels", "tokens"):
                    mixer = ConvMixer(c, k, 1, grid, p, form).cuda()
                    mixer.load_state_dict(first.state_dict())
                    torch._dynamo.reset()
                    fn = torch.compile(mixer) if compiled else mixer
                    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                        out = fn(x)
                    out.float().square().sum().backward()
                    grads = [t.grad.flatten() for t in mixer.parameters()]
                    results.append(torch.cat([out.detach().float().flatten(), *grads]))
                assert rel_err(results[1], results[0]) < tol, (c, k, p, amp)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
