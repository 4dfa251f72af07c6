"""The model a timm folder carries for transformers (convit_convert/shipped/modeling_cmhsa.py), held
to cmhsa's own model on every value of every option cmhsa's config type declares: the same
parameter names, logits, gradients and training-mode drop path; its config typed, building a
working model from its defaults and refusing what it does not implement; transformers' plumbing
(return_dict, hidden states, the loss by problem type); its image processor the same pixels as
``cmhsa predict``'s; its imports torch and transformers alone."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import typing

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import randomize
from convit_convert.config import ViTConfig
from convit_convert.io.timm_folder import AUTO_MAP, MODELING, SHIPPED, check_folder_config, timm_config
from convit_convert.model import VisionTransformer
from convit_convert.version import __version__

pytest.importorskip("transformers")  # the dev extra installs it
from convit_convert.shipped import modeling_cmhsa as hub


def literal_options() -> dict[str, tuple[object, ...]]:
    """Every option of cmhsa's config type whose values are a Literal, with those values: read from
    the type, so a value added there is a case here (and must be one the shipped file implements)."""
    out = {}
    for name, hint in typing.get_type_hints(ViTConfig).items():
        union = [hint] if typing.get_origin(hint) is typing.Literal else typing.get_args(hint)
        literal = [a for a in union if typing.get_origin(a) is typing.Literal]
        if literal:
            out[name] = typing.get_args(literal[0])
    return out


def every_option() -> dict[str, ViTConfig]:
    """A small config for each combination of the Literal options and the sink (attention), the
    sizes varied alongside: grey and colour, square and not, dilated or not."""
    opts = literal_options()
    cases = {}
    for i, (kind, embed) in enumerate(itertools.product(opts["kind"], opts["patch_embed"])):
        chans = 1 if i % 2 else 3
        hidden = chans if embed == "identity" else 2
        base = ViTConfig.build(
            img_size=(12, 8) if i % 2 else 8,
            patch_size=4,
            in_chans=chans,
            hidden_chans=hidden,
            depth=2,
            num_classes=5,
            kernel_size=5 if kind == "attn" else 3,
            dilation=1 + i % 2,
            patch_embed=embed,
        )
        if kind == "conv":
            cases[f"conv, {embed}"] = base
            continue
        for pinning, sink in itertools.product(opts["pinning"], (True, False)):
            cfg = base.with_attention(9, qk_dim=8, v_dim=base.embed_dim, sink=sink, pinning=pinning)
            cases[f"attn, {embed}, {pinning}, sink {sink}"] = cfg
    return cases


CASES = every_option()


def cmhsa_model(
    cfg: ViTConfig, seed: int = 0, gates: tuple[float, ...] = (), drop_path: float = 0.0
) -> VisionTransformer:
    """cmhsa's model of ``cfg``, every parameter non-trivial: sinks and tables nonzero, gates
    ``gates`` cycled over the heads (default: inside (0, 1)), in eval mode."""
    torch.manual_seed(seed)
    model = randomize(VisionTransformer(cfg, drop_path_rate=drop_path), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate"):
                values = torch.tensor(gates or (0.2, 0.5, 0.9))
                p.copy_(values[torch.arange(p.numel()) % len(values)])
            elif name.endswith((".sink", "rel_pos_bias", "content_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    return model.eval()


def shipped_model(
    cfg: ViTConfig, state: dict[str, torch.Tensor], drop_path: float = 0.0
) -> hub.CmhsaForImageClassification:
    """The shipped model from config.json as cmhsa writes it, the weights loaded strictly."""
    config = hub.CmhsaConfig(**json.loads(json.dumps(timm_config(cfg))), drop_path_rate=drop_path)
    model = hub.CmhsaForImageClassification(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


# gates outside [0, 1] on both sides, at its ends and inside: where a clamp and a straight-through part
GATES = (-0.05, 0.3, 1.1, 0.0, 1.0, 0.7, -0.2, 0.5, 1.3)


def largest_differences(cfg: ViTConfig, drop_path: float = 0.0, train: bool = False) -> dict[str, float]:
    """Float64, both models from the same weights, gates inside and outside [0, 1]: the largest
    relative difference (|Δ| over the largest |value| of the tensor) of the logits and of every
    parameter's gradient of a cross-entropy loss; with ``train``, in training mode, each forward
    from the same generator state (the same drop-path draws)."""
    ours = cmhsa_model(cfg, gates=GATES, drop_path=drop_path).double()
    theirs = shipped_model(cfg, ours.state_dict(), drop_path=drop_path).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, cfg.in_chans, *cfg.img_size, generator=g, dtype=torch.float64)
    labels = torch.randint(0, cfg.num_classes, (4,), generator=g)
    out = {}
    for model in (ours, theirs):
        model.train(train)
        torch.manual_seed(11)
        logits = model(x) if model is ours else model(pixel_values=x).logits
        F.cross_entropy(logits, labels).backward()
        out[model] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (want, grads), (got, their_grads) = out[ours], out[theirs]
    diffs = {"logits": ((got - want).abs().max() / want.abs().max()).item()}
    assert grads.keys() == their_grads.keys()
    for name, grad in grads.items():
        scale = grad.abs().max().clamp_min(1e-300)
        diffs[name] = ((their_grads[name] - grad).abs().max() / scale).item()
    return diffs


def worst(diffs: dict[str, float]) -> tuple[str, float]:
    name = max(diffs, key=diffs.get)
    return name, diffs[name]


@pytest.mark.parametrize("case", list(CASES))
def test_the_shipped_model_computes_cmhsas_function(case: str) -> None:
    """float32 logits within 1e-5 of the largest: float32 rounding, as the shipped attention gathers
    its bias and sums its heads in another order than cmhsa's padded form."""
    cfg = CASES[case]
    ours = cmhsa_model(cfg)
    theirs = shipped_model(cfg, ours.state_dict())
    x = torch.randn(4, cfg.in_chans, *cfg.img_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = ours(x), theirs(pixel_values=x).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, case


@pytest.mark.parametrize("case", list(CASES))
def test_the_shipped_model_trains_as_cmhsas(case: str) -> None:
    """Gradients of every parameter, eval mode and training mode with drop path: within 1e-5 of each
    tensor's largest, in float64 (where the two orders of summation differ by about 1e-14; a
    different gradient rule, as a clamp's zero outside [0, 1], differs by 100 %)."""
    cfg = CASES[case]
    for train, drop_path in ((False, 0.0), (True, 0.25)):
        name, diff = worst(largest_differences(cfg, drop_path, train))
        assert diff <= 1e-5, (case, train, name, diff)


def test_a_change_to_cmhsas_model_fails_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above fail when cmhsa's model changes and the shipped file does not follow: the
    gate's gradient made the plain clamp's (the forward unchanged), and drop path removed from
    cmhsa's training mode."""
    from convit_convert import attention, model

    cfg = CASES["attn, identity, gated, sink True"]
    assert worst(largest_differences(cfg))[1] <= 1e-5
    with monkeypatch.context() as m:
        m.setattr(attention.RelPosAttention, "gates", lambda self: self.gate.clamp(0, 1))
        diffs = largest_differences(cfg)
        assert diffs["logits"] <= 1e-12  # the same forward
        assert diffs["blocks.0.attn.gate"] > 0.5, diffs["blocks.0.attn.gate"]
    with monkeypatch.context() as m:
        m.setattr(model.DropPath, "forward", lambda self, x, mask=None: x)
        assert worst(largest_differences(cfg, 0.25, train=True))[1] > 1e-3


def test_the_options_are_cmhsas() -> None:
    """The shipped file's allowed values of each Literal option are cmhsa's config type's."""
    opts = literal_options()
    assert set(opts) == {"kind", "patch_embed", "pinning"}, opts
    assert tuple(hub.ARCHITECTURES.values()) == opts["kind"]
    assert opts["patch_embed"] == hub.PATCH_EMBEDS
    assert opts["pinning"] == hub.PINNINGS
    names = {f.name for f in ViTConfig.__dataclass_fields__.values()} - {"kind", "num_classes"}
    assert set(hub.MODEL_OPTIONS) | set(hub.ATTENTION_OPTIONS) == names


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("pinning", "soft", "pinning 'soft' is not one of hard, gated"),
        ("patch_embed", "conv", "patch_embed 'conv' is not one of identity, linear"),
        ("architecture", "cmhsa_mlp", "architecture 'cmhsa_mlp' is not one of cmhsa_conv, cmhsa_attn"),
        ("sink", "yes", "sink must be true or false"),
        ("depth", 0, "depth must be a positive integer"),
        ("embed_dim", 769, "embed_dim 769 is not patch_size² · hidden_chans"),
    ],
)
def test_a_value_the_model_lacks_is_refused(option: str, value: object, named: str) -> None:
    """In the typed arguments and in config.json's model_args alike: one ValueError naming the
    option and the values it takes, before any model is built."""
    with pytest.raises(ValueError, match="CmhsaConfig: " + named.replace("·", ".").replace("²", ".")) as e:
        hub.CmhsaConfig(**{option: value})
    assert "\n" not in str(e.value)
    doc = timm_config(CASES["attn, linear, gated, sink True"])
    if option == "architecture":
        doc["architecture"] = value
    else:
        doc["model_args"]["cmhsa_config"][option] = value
    with pytest.raises(ValueError, match="CmhsaConfig: "):
        hub.CmhsaConfig(**json.loads(json.dumps(doc)))


def test_a_config_json_that_contradicts_itself_is_refused() -> None:
    """The top-level num_classes and num_features, pretrained_cfg's input and classes, and the class
    names must say what model_args says."""
    doc = timm_config(CASES["conv, linear"], classes=tuple("abcde"))
    for path, value in (
        (("num_classes",), 6),
        (("num_features",), 7),
        (("pretrained_cfg", "input_size"), [3, 8, 8]),
        (("pretrained_cfg", "num_classes"), 4),
        (("label_names",), ["a", "b"]),
    ):
        bad = json.loads(json.dumps(doc))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(ValueError, match="CmhsaConfig: "):
            hub.CmhsaConfig(**bad)
    hub.CmhsaConfig(**json.loads(json.dumps(doc)))


def test_the_default_config_builds_the_papers_model() -> None:
    """transformers' convention: a config's defaults build a working model (``from_config``): here
    the paper's CMHSA-5 after conversion, as timm's cmhsa5_224 builds it, parameter for parameter."""
    import timm

    import convit_convert.timm  # noqa: F401

    config = hub.CmhsaConfig()
    with torch.device("meta"):
        ours = timm.create_model("cmhsa5_224")
        theirs = hub.CmhsaForImageClassification(config)
    assert {n: t.shape for n, t in theirs.state_dict().items()} == {
        n: t.shape for n, t in ours.state_dict().items()
    }
    small = hub.CmhsaForImageClassification(hub.CmhsaConfig(depth=1, num_labels=3, img_size=[32, 32]))
    out = small(pixel_values=torch.randn(2, 3, 32, 32))
    assert out.logits.shape == (2, 3) and torch.isfinite(out.logits).all()


def test_the_config_reads_and_writes_the_one_config_json() -> None:
    """What ``save_pretrained`` writes is timm's layout as cmhsa writes it (cmhsa's folder check
    reads it as the same model), beside transformers' own keys; class names kept or absent."""
    for classes in (None, tuple("abcde")):
        cfg = CASES["attn, linear, gated, sink False"]
        doc = json.loads(json.dumps(timm_config(cfg, classes)))
        config = hub.CmhsaConfig(**doc)
        written = config.to_dict()
        for key in ("architecture", "num_classes", "num_features", "model_args", "pretrained_cfg"):
            assert written[key] == doc[key], key
        assert written.get("label_names") == doc.get("label_names")
        assert check_folder_config(json.loads(config.to_json_string()), "config.json") == cfg
        assert hub.CmhsaConfig(**json.loads(config.to_json_string())).to_dict() == written


def test_transformers_plumbing() -> None:
    """return_dict and output_hidden_states from the config or the call; hidden states the patch
    embedding's and every block's output; the loss by problem type against torch's own; the model
    its own base; the relative-position index a buffer no file holds, built once."""
    cfg = CASES["attn, linear, gated, sink True"]
    ours = cmhsa_model(cfg)
    model = shipped_model(cfg, ours.state_dict())
    x = torch.randn(3, cfg.in_chans, *cfg.img_size)
    out = model(pixel_values=x, output_hidden_states=True)
    assert len(out.hidden_states) == cfg.depth + 1
    assert all(h.shape == (3, cfg.num_patches, cfg.embed_dim) for h in out.hidden_states)
    with torch.no_grad():
        assert torch.allclose(
            out.hidden_states[-1], ours.blocks[-1](ours.blocks[0](ours.patch_embed(x))), atol=1e-5
        )
    model.config.return_dict = False
    assert isinstance(model(pixel_values=x), tuple) and len(model(pixel_values=x)) == 1
    model.config.return_dict = True
    labels = torch.tensor([0, 3, 4])
    logits = model(pixel_values=x).logits
    assert torch.allclose(model(pixel_values=x, labels=labels).loss, F.cross_entropy(logits, labels))
    assert model.config.problem_type == "single_label_classification"
    multi = torch.tensor([[1.0, 0, 1, 0, 0]] * 3)
    model.config.problem_type = "multi_label_classification"
    assert torch.allclose(
        model(pixel_values=x, labels=multi).loss, F.binary_cross_entropy_with_logits(logits, multi)
    )
    one = hub.CmhsaForImageClassification(
        hub.CmhsaConfig(**timm_config(dataclasses.replace(cfg, num_classes=1)))
    )
    target = torch.randn(3)
    pred = one(pixel_values=x).logits
    assert one.config.problem_type is None
    assert torch.allclose(one(pixel_values=x, labels=target).loss, F.mse_loss(pred.squeeze(), target))
    assert one.config.problem_type == "regression"
    assert model.base_model is model and model.base_model_prefix == ""
    assert "blocks.0.attn.rel_pos_index" not in model.state_dict()
    built = []
    original = hub.relative_index
    try:
        hub.relative_index = lambda grid: built.append(grid) or original(grid)
        model(pixel_values=x)
    finally:
        hub.relative_index = original
    assert built == []


def test_colour_becomes_grey_in_the_processor_not_the_model() -> None:
    """A grey model takes one channel; the processor gives it PIL's "L" of a colour image."""
    cfg = CASES["conv, linear"]
    assert cfg.in_chans == 1
    model = shipped_model(cfg, cmhsa_model(cfg).state_dict())
    with pytest.raises(ValueError, match=r"expected pixel_values of shape \(B, 1, 12, 8\)"):
        model(pixel_values=torch.randn(2, 3, 12, 8))
    processor = hub.CmhsaImageProcessor(pretrained_cfg=timm_config(cfg)["pretrained_cfg"])
    pixels = processor(Image.new("RGB", (9, 14), (200, 30, 90)))["pixel_values"]
    assert pixels.shape == (1, 1, 12, 8)


def test_the_shipped_processor_gives_cmhsa_predicts_pixels() -> None:
    """timm's evaluation transform (what ``cmhsa predict`` runs), pixel for pixel, on grey and
    colour images smaller, larger and of other shapes than the model's, for square and non-square
    models."""
    from convit_convert.loaders import build_transform

    shapes = [(5, 9), (40, 17), (8, 8), (31, 64), (100, 100)]
    for size, chans in (((28, 28), 1), ((12, 8), 3), ((32, 32), 3)):
        cfg = ViTConfig.build(img_size=size, patch_size=4, in_chans=chans)
        processor = hub.CmhsaImageProcessor(pretrained_cfg=timm_config(cfg)["pretrained_cfg"])
        transform = build_transform(cfg.img_size, False, None, chans)
        g = torch.Generator().manual_seed(0)
        for w, h in shapes:
            pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
            image = Image.fromarray(pixels, "RGB")
            want = transform(image.convert("L" if chans == 1 else "RGB"))
            got = processor(image)["pixel_values"][0]
            assert torch.equal(got, want), (size, chans, (w, h))


def test_the_shipped_file_imports_torch_and_transformers_alone() -> None:
    """Code others run: no import beyond torch and transformers, no file, process or network call,
    nothing evaluated; it names the cmhsa release that ships it."""
    tree = ast.parse(SHIPPED.read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "torch", "transformers"}, roots
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"open", "exec", "eval", "compile", "__import__", "input", "breakpoint"}, called
    assert SHIPPED.name == MODELING and set(AUTO_MAP.values()) <= {
        f"modeling_cmhsa.{c}" for c in ("CmhsaConfig", "CmhsaForImageClassification", "CmhsaImageProcessor")
    }
    assert hub.CmhsaConfig.model_type == "cmhsa"
    assert __version__ == hub.SHIPPED_BY
