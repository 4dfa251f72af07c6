"""pytest plugin: run timm's own ``tests/test_models.py``, unmodified, on cmhsa's registered models.

Loaded with ``-p timm_plugin`` by tests/test_timm_suite.py. timm's file picks the models each test
runs on with ``list_models(filter, module, exclude_filters, ...)``: name patterns and the source
module, from which it decides, for instance, that a ViT (tokens out, not a feature map) gets the
"non-standard" config test and the ``forward_intermediates`` feature tests. A cmhsa model is such a
ViT, so here it is picked wherever timm picks its own ViT with relative position bias and mean
pooling (:data:`LIKE`), and the properties each model has for itself (weights to download, a
pretrained config under its name) are asked of timm's registry for the cmhsa names. Tests that
name other models (``convnext_atto``, ...) are deselected; the tests cmhsa does not support are
skipped with the reason in :data:`SKIPS`, the table docs/python.md's "timm's own tests" section
shows; the tests of what the modules do run once for the models that build the same modules
(:data:`SAME_MODULES`).
"""

from __future__ import annotations

from typing import Any

import pytest
import timm
import timm.models

import convit_convert.timm  # noqa: F401  (registers the models before timm's test file is collected)

LIKE = "vit_relpos_base_patch16_224"
MODELS = ("cmhsa_conv", "cmhsa_attn", "cmhsa5_224", "cmhsa3_224")
SKIPS = {
    "test_model_forward_torchscript": "TorchScript is not supported: torch.jit.script is deprecated "
    "(it says: switch to torch.compile or torch.export); "
    "deploy with `cmhsa export` (ONNX), torch.fx or torch.export",
    "test_model_forward_fx_torchscript": "TorchScript is not supported (as above); the FX graph itself is "
    "tested by test_model_forward_fx / test_model_backward_fx",
}
# cmhsa5_224 and cmhsa3_224 build cmhsa_attn's modules: its ViTConfig but for kernel_size, which no
# phase-2 layer reads (tests/test_timm_suite.py checks this). timm's tests of what the modules do
# (backward, FX, features, pruning: 2 of the suite's 3 minutes on 2 cores went to these three
# 156M-parameter models) run on cmhsa_attn for the three; what each name registers (its pretrained
# config, its forward) is tested on each
SAME_MODULES = {"cmhsa5_224": "cmhsa_attn", "cmhsa3_224": "cmhsa_attn"}
MODULE_TESTS = (
    "test_model_backward",
    "test_model_forward_intermediates",
    "test_model_forward_intermediates_features",
    "test_prune_intermediate_layers_contract",
    "test_model_forward_fx",
    "test_model_backward_fx",
)
SAME_MODULES_REASON = (
    "the same modules as cmhsa_attn (kernel_size aside, which no phase-2 layer reads): tested there"
)

_list_models = timm.list_models


def list_models(
    filter: Any = "",
    module: Any = "",
    pretrained: bool = False,
    exclude_filters: Any = "",
    name_matches_cfg: bool = False,
    include_tags: bool | None = None,
) -> list[str]:
    """timm's ``list_models`` answered for the cmhsa models only: those of them with the asked
    properties, if timm's answer to the same patterns holds :data:`LIKE`, else none."""
    like = _list_models(filter, module, False, exclude_filters, False, include_tags)
    if not any(name.split(".")[0] == LIKE for name in like):
        return []
    own = _list_models("cmhsa*", "", pretrained, "", name_matches_cfg, include_tags)
    return [name for name in own if name.split(".")[0] in MODELS]


def pytest_configure(config: pytest.Config) -> None:
    timm.list_models = timm.models.list_models = list_models
    for marker in tuple(
        "base forward backward cfg cfg_nonstd torchscript features fxforward fxbackward timeout".split()
    ):
        config.addinivalue_line("markers", f"{marker}: timm's marker")


def _model_name(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    name = params.get("model_name")
    return name.split(".")[0] if isinstance(name, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [item for item in items if _model_name(item) in MODELS]
    config.hook.pytest_deselected(items=[item for item in items if _model_name(item) not in MODELS])
    items[:] = keep
    for item in keep:
        reason = SKIPS.get(item.originalname)
        if not reason and _model_name(item) in SAME_MODULES and item.originalname in MODULE_TESTS:
            reason = SAME_MODULES_REASON
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
