"""The training step (train/step.py): no host read per step, a non-finite loss's update skipped on
the device, and ``--compile``'s step as one graph that trains as the eager one does."""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import ROOT
from convit_convert.options.training import TrainConfig
from convit_convert.train import run as engine
from convit_convert.train.distributed import Context
from convit_convert.train.loop import train_one_step
from convit_convert.train.profiling import OpCounter
from convit_convert.train.progress import Progress
from convit_convert.train.run import run
from convit_convert.train.step import Tally, assign_gradients, fusable


def small(tmp_path: Path, name: str, phase: str = "phase1", **kw) -> TrainConfig:
    """The EXPERIMENTS.md model and recipe (``--preset cpu``: crop, flip, colour jitter) at 16 px on
    digits, on the device loader; phase 2 from impulse init with gated pinning."""
    extra = dict(init="impulse", pinning="gated") if phase == "phase2" else {}
    flags = dict(
        phase=phase,
        preset="cpu",
        data=kw.pop("data", "digits"),
        img_size=16,
        in_chans=1,
        hidden_chans=1,
        loader="device",
        device="cpu",
        threads=1,
        batch_size=4,
        val_samples=8,
        epochs=1,
        log_every=10**6,
        out=str(tmp_path / name),
    )
    return TrainConfig.from_flags(**{**flags, **extra, **kw})


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_training_reads_nothing_from_the_device_per_step(tmp_path: Path, phase: str) -> None:
    """aten::_local_scalar_dense (what .item(), bool() and float() of a tensor dispatch: the host
    waiting for the device) counted over a whole run of 16 steps and one of 48, each read out
    once at the epoch's end: the same count, so none per step. Before issue 41 the step read the
    loss and the stop flag every step (2 per step)."""
    reads = {}
    for steps in (16, 48):
        counter = OpCounter()
        with counter:
            run(small(tmp_path, f"{phase}-{steps}", phase, train_samples=4 * steps), progress=Progress(None))
        reads[steps] = counter.ops["aten._local_scalar_dense"]
    assert reads[16] == reads[48]


def tiny_loop(model: nn.Module, opt: str, clip_grad: float | None = None) -> SimpleNamespace:
    """What :func:`train_one_step` reads of a Loop, for ``model`` with timm's ``opt`` (fused where
    torch has the kernel, as recipe.py builds it), eager, on the CPU, without EMA or schedule."""
    from timm.optim import create_optimizer_v2, get_optimizer_info

    fused = {"fused": True} if fusable(get_optimizer_info(opt).opt_class) else {}
    ctx = Context(0, 1, 0, torch.device("cpu"))
    state = SimpleNamespace(
        model=model,
        optimizer=create_optimizer_v2(model, opt=opt, lr=0.1, weight_decay=0.05, **fused),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,
        scheduler=SimpleNamespace(step_update=lambda num_updates: None),
        global_step=0,
    )
    return SimpleNamespace(
        cfg=SimpleNamespace(recipe=SimpleNamespace(clip_grad=clip_grad, grad_accum_steps=1)),
        ctx=ctx,
        state=state,
        forward=model,
        criterion=nn.CrossEntropyLoss(),
        dtype=None,
        prepare=None,
        mixup=None,
        compiled=None,
        tally=Tally(ctx),
        params=list(model.parameters()),
    )


@pytest.mark.parametrize("opt", ["adamw", "sgd", "lamb"])
def test_a_non_finite_loss_changes_no_weight_or_optimizer_state(opt: str) -> None:
    """Two good steps, a step whose input makes the loss NaN, then a good one: the NaN step leaves
    weights and optimizer state (moments, step counters) bit for bit as they were, on the device
    for the fused kernels (adamw, sgd) and by the host's check for the others (lamb); the read
    names it as the third step and the sum as nan. The good step after it is skipped too (the
    flag holds until the read), and one after the read trains again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 3))
    loop = tiny_loop(model, opt, clip_grad=1.0)
    optimizer = loop.state.optimizer
    x, y = torch.randn(4, 1, 4, 4), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        train_one_step(loop, x, y)
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    train_one_step(loop, torch.full_like(x, math.nan), y)
    train_one_step(loop, x, y)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = optimizer.state_dict()["state"]
    for i, entry in state["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after[i][k])), (i, k)
    totals = loop.tally.read(4)
    assert totals.bad_step == 2 and math.isnan(totals.loss_sum)
    train_one_step(loop, x, y)
    assert loop.tally.read(1).bad_step is None
    assert not torch.equal(weights["1.weight"], model.state_dict()["1.weight"])


def capture_loop(monkeypatch) -> dict:
    """Runs stop after one step; the loop they built lands in the returned dict."""
    captured: dict = {}
    real = engine.train_one_epoch

    def one_step(loop, stop, stop_after_steps=None):
        captured["loop"] = loop
        return real(loop, stop, 1)

    monkeypatch.setattr(engine, "train_one_epoch", one_step)
    return captured


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_compiled_step_is_one_graph(tmp_path: Path, monkeypatch, phase: str) -> None:
    """With --compile, the step up to the update (the device loader's crop, flip and colour
    jitter, forward, loss, gradients, the tally) is one graph: torch._dynamo.explain finds no
    graph break."""
    captured = capture_loop(monkeypatch)
    run(small(tmp_path, "run", phase, train_samples=32, compile=True, drop_path=0.1), progress=Progress(None))
    loop = captured["loop"]
    step = loop.compiled
    assert step is not None and step.augment_inside
    loop.train_loader.sampler.set_epoch(0)
    inputs, y = next(loop.train_loader.batches())
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # as step.with_autograd_traced runs it
        masks = loop.state.model.drop_masks(len(y), step.mask_dtype, y.device)
        explained = torch._dynamo.explain(step.prepared_learn)(inputs, y, loop.tally.values, masks)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow  # compiles a step
def test_compiled_step_trains_as_the_eager_one(tmp_path: Path) -> None:
    """Phase 1 on synthetic images, 8 steps of SGD (an update linear in the gradients, so rounding
    stays rounding; Adam's first steps are about lr·sign(g), which turns a rounding-sized gradient
    into a whole step), eager against --compile: every weight within 1e-5 of its tensor's scale.
    Why 1e-5: the compiled graph fuses and reorders float32 sums (2^-24 ≈ 6e-8 relative per
    rounding, over sums of a few hundred terms and 8 steps); measured, the two differ by at most
    4e-7 (1.5e-8 without drop path, as much as the eager run with 2 threads differs from 1
    thread). Training moved every
    weight tensor but the zero-gradient conv bias by far more (> 1e-6 absolute, checked).
    (Not on digits: their flat backgrounds make constant tokens, where LayerNorm magnifies the
    rounding into differences of 30% of the largest gradient, BENCHMARKS.md, "Investigations".)
    Drop path 0.3: the compiled step is given the masks the eager forward draws; drawn inside the
    graph (inductor's generator), they differ, and so do the weights (measured: 4e-3)."""
    kw = dict(data="synthetic", train_samples=32, opt="sgd", lr=0.05, drop_path=0.3)
    start = run(small(tmp_path, "start", **{**kw, "lr": 1e-12}), progress=Progress(None))  # the init
    eager = run(small(tmp_path, "eager", **kw, epochs=2), progress=Progress(None))
    traced = torch._dynamo.config.trace_autograd_ops
    compiled = run(small(tmp_path, "compiled", **kw, epochs=2, compile=True), progress=Progress(None))
    assert torch._dynamo.config.trace_autograd_ops == traced  # the step's setting stayed in the step
    a, b, s = (load_file(str(r.model_path)) for r in (eager, compiled, start))
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-5 * a[k].abs().max().item(), k
    moved = {k for k in a if (a[k] - s[k]).abs().max().item() > 1e-6}
    assert moved == set(a) - {"blocks.0.conv.bias", "blocks.1.conv.bias"}


@pytest.mark.parametrize("compile", [False, True])
def test_a_stopped_run_resumes_bit_for_bit(tmp_path: Path, compile: bool) -> None:
    """Phase 2 (gated) with drop path and the device loader's augmentation, stopped mid-epoch
    (step 11 of 16, between read-outs: `log_every` 4) and resumed, against an uninterrupted run:
    every weight bit-identical, eager and compiled (the compiled graph's random numbers come from
    torch's generator, whose state the checkpoint restores)."""
    kw = dict(train_samples=32, epochs=2, drop_path=0.1, log_every=4, compile=compile)
    whole = run(small(tmp_path, "whole", "phase2", **kw), progress=Progress(None))
    run(small(tmp_path, "split", "phase2", **kw), progress=Progress(None), stop_after_steps=11)
    split = run(small(tmp_path, "split", "phase2", **kw, resume=True), progress=Progress(None))
    a, b = (load_file(str(r.model_path)) for r in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_under_torchrun_one_ranks_stop_stops_every_rank_at_the_next_read_out(tmp_path: Path) -> None:
    """2 gloo processes, 16 steps an epoch, `--log-every 4`: SIGTERM to rank 1 alone, once rank 0
    has logged step 4. No rank reads the device between read-outs, so rank 1 goes on to the next
    one; there the stop request is all-reduced and both ranks stop at that step, where rank 0
    saves: a checkpoint at a multiple of 4 steps, mid-epoch, that resumes."""
    out = tmp_path / "ddp"
    args = [
        *"train phase1 --data synthetic --img-size 16 --patch-size 4 --depth 1 "
        "--kernel-size 3 --train-samples 512 --batch-size 16 --epochs 2 "
        "--warmup-epochs 0 --workers 0 --device cpu --threads 1 --log-every 4 -o".split(),
        str(out),
    ]
    cmd = [
        sys.executable,
        *"-m torch.distributed.run --nproc-per-node 2 --master-port 29541 -m convit_convert".split(),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    assert p.stdout is not None
    for line in p.stdout:
        if "step 4/16" in line:
            break
    workers = [
        int(pid)
        for pid in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    ]
    rank1 = [pid for pid in workers if b"RANK=1\x00" in Path(f"/proc/{pid}/environ").read_bytes()]
    assert len(rank1) == 1, workers
    os.kill(rank1[0], signal.SIGTERM)
    _, err = p.communicate(timeout=240)
    # torchrun prints its own traceback for the rank that exited 143; none comes from cmhsa's code
    assert "/convit_convert/" not in err and f"{os.sep}train{os.sep}" not in err, err[-2000:]
    state = torch.load(out / "checkpoint-last.pt", weights_only=True)
    assert (state["epoch"], state["step"] % 4) == (0, 0) and 4 <= state["step"] < 16, state["step"]
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert r.returncode == 0 and (out / "conv.safetensors").is_file(), r.stderr[-2000:]


@pytest.mark.parametrize(("chans", "noted"), [(3, True), (1, False)])
def test_the_start_line_names_the_channels_and_grey_data_at_3_gets_a_note(
    tmp_path: Path, chans: int, noted: bool
) -> None:
    """Digits are grey: trained with 3 input channels (the default) the run says so in one line;
    the start line names the channel count either way."""
    lines: list[str] = []
    run(small(tmp_path, f"c{chans}", train_samples=8, in_chans=chans), progress=Progress(lines.append))
    start = next(line for line in lines if line.startswith("phase1: conv model"))
    assert f"{chans} input channel" in start
    assert any(line.startswith("note: the digits images are grey") for line in lines) == noted


def test_gradients_reach_the_fused_optimizer_in_the_parameters_layout() -> None:
    """Phase 1's token form makes autograd.grad return conv.weight's gradient as a permuted view
    (found on an H200), which torch's fused AdamW refuses ("params, grads, exp_avgs, and
    exp_avg_sqs must have same dtype, device, and layout"): the step's gradients (compiled and
    eager alike) are assigned in the parameter's layout, as backward() lays them out."""
    from timm.optim import create_optimizer_v2

    from convit_convert.conv_mixer import ConvMixer

    mixer = ConvMixer(3, 5, 1, (2, 2), 4, "tokens")
    model = nn.Sequential(mixer, nn.Flatten(), nn.Linear(4 * 48, 3))
    x, y = torch.randn(4, 4, 48), torch.tensor([0, 1, 2, 0])
    raw = list(torch.autograd.grad(nn.CrossEntropyLoss()(model(x), y), list(model.parameters())))
    assert raw[0].stride() != mixer.weight.stride()  # what autograd.grad gives: the case in question
    assign_gradients(list(model.parameters()), raw)  # as the compiled step hands its gradients over
    optimizer = create_optimizer_v2(model, opt="adamw", lr=0.1, fused=True)
    before = mixer.weight.detach().clone()
    optimizer.step()
    assert all(p.grad.stride() == p.stride() for p in model.parameters())
    assert not torch.equal(before, mixer.weight)
    optimizer.zero_grad(set_to_none=True)
    loop = tiny_loop(model, "adamw")  # the eager step
    before = mixer.weight.detach().clone()
    train_one_step(loop, x, y)
    assert not torch.equal(before, mixer.weight)
