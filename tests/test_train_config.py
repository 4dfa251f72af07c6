"""TrainConfig: frozen groups built from the flat flags once, saved flat (config.json's format)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import invoke
from convit_convert.cli.train import OPTION_ROWS as CLI_FLAGS
from convit_convert.errors import CmhsaError
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.training import (
    FLAG_FIELDS,
    DataConfig,
    ModelFlags,
    RecipeConfig,
    RuntimeConfig,
    StartConfig,
    TrainConfig,
)

# one flag of every group set away from its default
FLAT = dict(
    phase="phase2",
    out="runs/x",
    data="digits",
    data_dir="/d",
    img_size=32,
    depth=3,
    mlp_ratio=2.7,
    init="mimetic",
    mimetic_alpha=0.5,
    heads=4,
    qk_dim=8,
    pinning="gated",
    margin=20.0,
    verify_tol=1e-4,
    epochs=7,
    lr=1e-3,
    scale=[0.5, 1.0],
    opt_betas=[0.8, 0.9],
    amp="none",
    seed=3,
    workers=1,
    threads=2,
    given=["depth", "epochs"],
)


def test_flags_land_in_their_groups() -> None:
    cfg = TrainConfig.from_flags(**FLAT)
    assert isinstance(cfg.data, DataConfig) and (cfg.data.name, cfg.data.dir) == ("digits", "/d")
    assert isinstance(cfg.model, ModelFlags) and (
        cfg.model.img_size,
        cfg.model.depth,
        cfg.model.mlp_ratio,
    ) == (
        32,
        3,
        2.7,
    )
    assert isinstance(cfg.start, StartConfig) and (cfg.start.init, cfg.start.mimetic_alpha) == (
        "mimetic",
        0.5,
    )
    assert isinstance(cfg.conversion, ConversionSpec)
    assert (cfg.conversion.heads, cfg.conversion.qk_dim, cfg.conversion.margin, cfg.conversion.tol) == (
        4,
        8,
        20.0,
        1e-4,
    )
    assert cfg.conversion.seed == cfg.seed == 3  # one seed: the run's
    assert isinstance(cfg.recipe, RecipeConfig) and (cfg.recipe.epochs, cfg.recipe.amp) == (7, "none")
    assert (cfg.recipe.scale, cfg.recipe.opt_betas) == ((0.5, 1.0), (0.8, 0.9))  # tuples, as timm takes them
    assert isinstance(cfg.runtime, RuntimeConfig) and (cfg.runtime.out, cfg.runtime.workers) == ("runs/x", 1)
    assert cfg.given == frozenset({"depth", "epochs"})


def test_saved_flat_and_read_back_equal() -> None:
    """config.json keeps one key per flag; reading it gives the same config."""
    cfg = TrainConfig.from_flags(**FLAT)
    d = json.loads(cfg.to_json())
    assert set(d) == set(FLAG_FIELDS) and d["data"] == "digits" and d["verify_tol"] == 1e-4 and d["seed"] == 3
    assert {k: d[k] for k in FLAT} == {**FLAT, "given": sorted(FLAT["given"])}
    assert TrainConfig.from_dict(d) == cfg
    assert TrainConfig.from_dict({**d, "a_flag_of_an_older_cmhsa": 1}) == cfg  # unknown keys ignored


def test_every_cli_flag_is_one_config_flag() -> None:
    """The CLI's table and the config's flags are the same set (``out``, the run folder, is the CLI's
    own option; ``phase`` its subcommand; ``given`` what was typed)."""
    cli = {row[0] for row in CLI_FLAGS}
    assert cli == set(FLAG_FIELDS) - {"phase", "out", "given"}
    groups = [FLAG_FIELDS[name] for name in FLAG_FIELDS]
    assert len(set(groups)) == len(groups)  # no two flags share a field


def test_frozen_and_replaced_not_mutated() -> None:
    cfg = TrainConfig.from_flags(epochs=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recipe.epochs = 4  # type: ignore[misc]
    other = cfg.replace(epochs=4, threads=1)
    assert (cfg.recipe.epochs, cfg.runtime.threads) == (3, None)
    assert (other.recipe.epochs, other.runtime.threads) == (4, 1)
    with pytest.raises(TypeError, match="no flag 'epoch'"):
        TrainConfig.from_flags(epoch=3)


@pytest.mark.parametrize(
    "phase, init, pinning",
    [
        ("phase2", "conv.safetensors", "gated"),
        ("phase2", "impulse", "gated"),
        ("phase2", "random", "hard"),
        ("phase2", "mimetic", "hard"),
        ("phase1", "random", "hard"),
    ],
)
def test_pinning_default_follows_the_start(phase: str, init: str, pinning: str) -> None:
    """Left out (None, as an old config.json saved it), the pinning is resolved once, from the start."""
    assert TrainConfig.from_flags(phase=phase, init=init).conversion.pinning == pinning
    assert (
        TrainConfig.from_dict({"phase": phase, "init": init, "pinning": None}).conversion.pinning == pinning
    )
    assert TrainConfig.from_flags(phase=phase, init=init, pinning="hard").conversion.pinning == "hard"


def test_a_bad_conversion_flag_is_one_line() -> None:
    with pytest.raises(CmhsaError, match="`pinning` must be one of hard, gated, got 'soft'"):
        TrainConfig.from_flags(pinning="soft")
    with pytest.raises(CmhsaError, match="`heads` must be 1 ≤ x ≤ 4096, got 0"):
        TrainConfig.from_flags(heads=0)


@pytest.mark.parametrize(
    ("flags", "lr"),
    [
        (dict(phase="phase1"), 5e-4),
        (dict(phase="phase2"), 5e-4),  # the default start, impulse, is from scratch (issue 34's trap)
        (dict(phase="phase2", init="random"), 5e-4),
        (dict(phase="phase2", init="mimetic"), 5e-4),
        (dict(phase="phase2", init="runs/p1/conv.safetensors"), 5e-5),  # the paper's rate after conversion
        (dict(phase="phase2", preset="cpu"), 2e-3),
        (dict(phase="phase1", preset="cpu"), 2e-3),
        (dict(phase="phase2", preset="cpu", init="runs/p1/conv.safetensors"), 2e-4),
        (dict(phase="phase2", preset="cpu", lr=1e-3), 1e-3),  # given: always wins
    ],
)
def test_default_learning_rate_follows_where_the_weights_start(flags: dict, lr: float) -> None:
    assert TrainConfig.from_flags(**flags).peak_lr == lr


def test_a_config_saved_before_presets_keeps_its_learning_rate() -> None:
    """Phase 2 from impulse saved with lr None ran at 5e-5 then; a resume must not change it."""
    old = {k: v for k, v in TrainConfig.from_flags(phase="phase2").to_dict().items() if k != "preset"}
    assert TrainConfig.from_dict(old).peak_lr == 5e-5
    assert TrainConfig.from_dict({**old, "preset": "paper"}).peak_lr == 5e-4


def test_the_cpu_preset_fills_only_the_flags_not_given() -> None:
    cfg = TrainConfig.from_flags(preset="cpu", depth=4, epochs=50)
    assert (cfg.model.img_size, cfg.model.patch_size, cfg.model.depth) == (28, 4, 4)
    assert (cfg.recipe.batch_size, cfg.recipe.lr_base_batch, cfg.recipe.aa, cfg.recipe.mixup) == (
        64,
        64,
        "none",
        0.0,
    )
    assert cfg.recipe.warmup_epochs == 5 and cfg.runtime.workers == 0  # a tenth of --epochs
    assert TrainConfig.from_flags(preset="cpu", epochs=50, warmup_epochs=0).recipe.warmup_epochs == 0
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # saved values, the preset's name included
    with pytest.raises(CmhsaError, match="`preset` must be one of paper, cpu"):
        TrainConfig.from_flags(preset="gpu")


def test_readme_which_start_commands_are_the_experiments_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """README's "Which start?" commands build, flag for flag, what init_comparison.py trained for the
    table (seed 0): the settings that decide what is computed, defaults resolved (learning rates,
    pinning, attention lr multiplier, warm-up); not where it runs or what it evaluates each epoch."""
    import argparse
    import re
    import shlex
    from pathlib import Path

    import convit_convert.cli.train as cli_train
    from convit_convert.options.training import RUNTIME_FIELDS

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "experiments"))
    from init_comparison import seed_arms

    args = argparse.Namespace(
        epochs=200,
        train_samples=1000,
        val_samples=2000,
        batch_size=64,
        compile=False,
        data_dir=None,
        device="auto",
        loader="auto",
        out=Path("runs"),
    )
    arms = {arm.name.split("/")[1]: arm.config for arm in seed_arms(args, 0)}
    block = re.search(
        r"<!-- which-start -->\n```bash\n(.*?)```", (root / "docs" / "training.md").read_text(), re.S
    ).group(1)
    lines = block.splitlines()
    common = shlex.split(lines[0].split("=", 1)[1])[0]
    built: dict = {}
    monkeypatch.setattr(
        cli_train, "_run_training", lambda cfg: built.update({Path(cfg.runtime.out).name: cfg})
    )
    for line in lines[1:]:
        words = shlex.split(line.replace("$C", common), comments=True)
        assert words[:2] == ["cmhsa", "train"], line
        r = invoke(words[1:])
        assert r.exit_code == 0, (line, r.output)

    def computed(cfg: TrainConfig) -> dict:
        d = {k: v for k, v in cfg.to_dict().items() if k not in (*RUNTIME_FIELDS, "val_samples", "preset")}
        d.update(lr=cfg.peak_lr, attn_lr_mult=cfg.attn_lr_scale, pinning=cfg.conversion.pinning)
        d["init"] = Path(d["init"]).name  # the two-phase start: the same half-p1 model, here or there
        return d

    assert len(built) == 7
    for name, cfg in built.items():
        assert computed(cfg) == computed(arms[name]), name
