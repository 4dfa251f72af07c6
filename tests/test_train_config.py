"""TrainConfig: frozen groups built from the flat flags once, saved flat (config.json's format)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from convit_convert.cli.train import FLAGS as CLI_FLAGS
from convit_convert.errors import CmhsaError
from convit_convert.spec import ConversionSpec
from convit_convert.train.config import (
    FLAGS,
    DataConfig,
    ModelFlags,
    RecipeConfig,
    RuntimeConfig,
    StartConfig,
    TrainConfig,
)

# one flag of every group set away from its default
FLAT = dict(phase="phase2", out="runs/x", data="digits", data_dir="/d", img_size=32, depth=3, mlp_ratio=2.7,
            init="mimetic", mimetic_alpha=0.5, heads=4, qk_dim=8, pinning="gated", margin=20.0,
            verify_tol=1e-4, epochs=7, lr=1e-3, scale=[0.5, 1.0], opt_betas=[0.8, 0.9], amp="none",
            seed=3, workers=1, threads=2, given=["depth", "epochs"])  # fmt: skip


def test_flags_land_in_their_groups() -> None:
    cfg = TrainConfig.from_flags(**FLAT)
    assert isinstance(cfg.data, DataConfig) and (cfg.data.name, cfg.data.dir) == ("digits", "/d")
    assert isinstance(cfg.model, ModelFlags) and (cfg.model.img_size, cfg.model.depth, cfg.model.mlp_ratio) == (
        32, 3, 2.7,
    )  # fmt: skip
    assert isinstance(cfg.start, StartConfig) and (cfg.start.init, cfg.start.mimetic_alpha) == (
        "mimetic",
        0.5,
    )
    assert isinstance(cfg.conversion, ConversionSpec)
    assert (cfg.conversion.heads, cfg.conversion.qk_dim, cfg.conversion.margin, cfg.conversion.tol) == (
        4, 8, 20.0, 1e-4,
    )  # fmt: skip
    assert cfg.conversion.seed == cfg.seed == 3  # one seed: the run's
    assert isinstance(cfg.recipe, RecipeConfig) and (cfg.recipe.epochs, cfg.recipe.amp) == (7, "none")
    assert (cfg.recipe.scale, cfg.recipe.opt_betas) == ((0.5, 1.0), (0.8, 0.9))  # tuples, as timm takes them
    assert isinstance(cfg.runtime, RuntimeConfig) and (cfg.runtime.out, cfg.runtime.workers) == ("runs/x", 1)
    assert cfg.given == frozenset({"depth", "epochs"})


def test_saved_flat_and_read_back_equal() -> None:
    """config.json keeps one key per flag; reading it gives the same config."""
    cfg = TrainConfig.from_flags(**FLAT)
    d = json.loads(cfg.to_json())
    assert set(d) == set(FLAGS) and d["data"] == "digits" and d["verify_tol"] == 1e-4 and d["seed"] == 3
    assert {k: d[k] for k in FLAT} == {**FLAT, "given": sorted(FLAT["given"])}
    assert TrainConfig.from_dict(d) == cfg
    assert TrainConfig.from_dict({**d, "a_flag_of_an_older_cmhsa": 1}) == cfg  # unknown keys ignored


def test_every_cli_flag_is_one_config_flag() -> None:
    """The CLI's table and the config's flags are the same set (``out``, the run folder, is the CLI's
    own option; ``phase`` its subcommand; ``given`` what was typed)."""
    cli = {row[0] for row in CLI_FLAGS}
    assert cli == set(FLAGS) - {"phase", "out", "given"}
    groups = [FLAGS[name] for name in FLAGS]
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
    [("phase2", "conv.safetensors", "gated"), ("phase2", "impulse", "gated"), ("phase2", "random", "hard"),
     ("phase2", "mimetic", "hard"), ("phase1", "random", "hard")],
)  # fmt: skip
def test_pinning_default_follows_the_start(phase: str, init: str, pinning: str) -> None:
    """Left out (None, as an old config.json saved it), the pinning is resolved once, from the start."""
    assert TrainConfig.from_flags(phase=phase, init=init).conversion.pinning == pinning
    assert (
        TrainConfig.from_dict({"phase": phase, "init": init, "pinning": None}).conversion.pinning == pinning
    )
    assert TrainConfig.from_flags(phase=phase, init=init, pinning="hard").conversion.pinning == "hard"


def test_a_bad_conversion_flag_is_one_line() -> None:
    with pytest.raises(CmhsaError, match="`pinning` must be hard or gated, got 'soft'"):
        TrainConfig.from_flags(pinning="soft")
    with pytest.raises(CmhsaError, match="`heads` must be at least 1"):
        TrainConfig.from_flags(heads=0)
