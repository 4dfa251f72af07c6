"""The model card of a timm folder (README.md): YAML metadata as the Hugging Face Hub reads it
(``huggingface_hub.ModelCard.load``), then how the model was made, its input, and the one import
line ``create_model("local-dir:...")`` / ``hf-hub:`` needs. Everything in it comes from the model's
config and the metadata cmhsa wrote into the checkpoint (``cmhsa.trained``, ``cmhsa.init``,
``cmhsa.result`` from ``cmhsa train``; ``cmhsa.source_sha256`` from ``cmhsa convert``); what is
not known is not claimed. No torch."""

from __future__ import annotations

import re
from typing import Any

from ..config import ViTConfig
from ..errors import CmhsaError
from ..labels import from_metadata
from ..text import card_number, markdown_safe
from .paths import parse_json

CARD = "README.md"
SHOWN_CLASSES = 20  # class names the card lists; all of them are in config.json
# the Hub's ids of the datasets cmhsa reads, where the Hub has one (digits, a folder, synthetic: none)
HUB_DATASETS = {
    "fashion-mnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
}
# what cmhsa knows of each dataset it reads: the Hub's licence id for weights trained on it, and
# the data as a card names it (an image folder's licence, and CIFAR's, are not known: said so)
DATA_LICENSES = {
    "digits": (
        "cc-by-4.0",
        "scikit-learn's digits (UCI's Optical Recognition of Handwritten Digits), licensed CC BY 4.0",
    ),
    "fashion-mnist": ("mit", "Fashion-MNIST (Zalando Research), licensed MIT"),
    "cifar10": ("unknown", "CIFAR-10 (Krizhevsky, 2009), published with no licence stated"),
    "cifar100": ("unknown", "CIFAR-100 (Krizhevsky, 2009), published with no licence stated"),
    "imagefolder": ("unknown", "an image folder, whose licence cmhsa cannot know"),
    "synthetic": ("mit", "cmhsa's own synthetic images (MIT, as cmhsa)"),
}
NOT_RECORDED = ("unknown", "not recorded in the weights' metadata")
# a repository's address as a card may show it: https, no space, quote, backtick or bracket
SOURCE_URL = re.compile(r"https://[A-Za-z0-9.-]+(/[A-Za-z0-9._~%+@/-]*)?")
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # the Hub's licence ids: cc-by-4.0, mit, other


def data_license(metadata: dict[str, str]) -> tuple[str, str]:
    """The licence id a card declares by default for weights with ``metadata``, and the training
    data as the card names it: from the dataset the run recorded (``cmhsa.result``'s ``data``, or
    the second word of ``cmhsa.trained``, "phase1 digits, 30 epochs", which older runs wrote alone)."""
    data = _json(metadata, "cmhsa.result").get("data")
    if data is None and isinstance(metadata.get("cmhsa.trained"), str):
        words = metadata["cmhsa.trained"].replace(",", " ").split()
        data = words[1] if len(words) > 1 else None
    return DATA_LICENSES.get(data, NOT_RECORDED) if isinstance(data, str) else NOT_RECORDED


def check_license(license_id: str) -> str:
    """A licence id as the Hub's front matter takes it (lower case: ``mit``, ``cc-by-4.0``,
    ``apache-2.0``, ``other``); anything else is refused."""
    if not isinstance(license_id, str) or not LICENSE_ID.fullmatch(license_id):
        raise CmhsaError(
            f"`license` {license_id!r} is not a licence id as the Hugging Face Hub writes one (lower "
            "case letters, digits, '.', '+', '-': mit, cc-by-4.0, apache-2.0, other)"
        )
    return license_id


def source_url() -> str | None:
    """The project's source repository as the installed distribution records it (pyproject's
    ``[project.urls]`` Source), or None: a card never names a package an index may not serve."""
    from importlib import metadata

    try:
        urls = metadata.metadata("cmhsa").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("source", "repository") and SOURCE_URL.fullmatch(url.strip()):
            return url.strip()
    return None


def install_line(url: str | None) -> str:
    """How a reader gets cmhsa: from its source repository; it is on no package index, so never
    ``pip install cmhsa`` (which would install whatever someone else registered under the name)."""
    if url is None:
        return (
            "cmhsa is on no package index (a package of that name there would be someone else's): "
            "install it from the source this model was exported with, `pip install -e .` in its folder."
        )
    return f'cmhsa is on no package index: install it from its source, `pip install "cmhsa @ git+{url}"`.'


KINDS = {
    "conv": "phase 1: a convolutional ViT (each block's attention replaced by a K×K convolution)",
    "attn": "phase 2: a Vision Transformer with relative-position multi-head self-attention",
}


def _json(metadata: dict[str, str], key: str) -> dict[str, Any]:
    """A JSON object cmhsa wrote into the metadata, or {} (absent, or not an object); JSON that is
    not (too deep, too long a number, not JSON) is a CmhsaError (the one bounded parser's)."""
    value = parse_json(metadata.get(key, "{}"), None, f"metadata {key}")
    return value if isinstance(value, dict) else {}


def model_card(
    cfg: ViTConfig,
    metadata: dict[str, str],
    num_params: int,
    preprocessing: dict[str, str],
    license_id: str | None = None,
    url: str | None = None,
) -> str:
    """README.md of a timm folder holding a model of ``cfg`` (``preprocessing``: how it wants an
    image, io.timm_folder.preprocessing; ``license_id``: the weights' licence, by default the
    training data's, :func:`data_license`; ``url``: cmhsa's source repository, :func:`source_url`)."""
    result, init = _json(metadata, "cmhsa.result"), _json(metadata, "cmhsa.init")
    data = result.get("data")
    default_license, data_named = data_license(metadata)
    license_id = check_license(license_id or default_license)
    arch = "cmhsa_attn" if cfg.kind == "attn" else "cmhsa_conv"
    yaml = ["---", "library_name: timm", f"license: {license_id}", "pipeline_tag: image-classification"]
    yaml += ["tags:"]
    yaml += [f"- {t}" for t in ("image-classification", "timm", "cmhsa", "vision-transformer", arch)]
    if data in HUB_DATASETS:
        yaml += ["datasets:", f"- {HUB_DATASETS[data]}"]
    top1 = card_number(result.get("top1"), 0, 100)  # a figure from a file: only a real percentage
    if top1 is not None:
        yaml += ["metrics:", "- accuracy"]
    yaml.append("---")
    heads = f", {cfg.num_heads} heads" if cfg.kind == "attn" else ""
    lines = [
        f"# {arch}: {KINDS[cfg.kind]}",
        "",
        "Made with cmhsa"
        + (f" ({url})" if url else "")
        + ", the tool of the paper [*Can Vision Transformers Perform Convolution?*]"
        "(https://arxiv.org/abs/2111.01353): "
        f"depth {cfg.depth}, width {cfg.embed_dim}, {cfg.patch_size}×{cfg.patch_size} patches, "
        f"{cfg.kernel_size}×{cfg.kernel_size} kernel{heads}; {num_params:,} parameters; "
        f"{cfg.num_classes} classes.",
        "",
        "## How it was made",
        "",
    ]
    made = []
    if "cmhsa.trained" in metadata:
        made.append(f"- Trained by `cmhsa train`: {markdown_safe(metadata['cmhsa.trained'])}.")
    if init.get("init") is not None:  # a file by its name (and hash), never a local path
        start = markdown_safe(str(init["init"]).replace("\\", "/").rsplit("/", 1)[-1])
        sha = init.get("init_sha256")
        made.append(
            f"- Start: {start}"
            + (f" (sha256 {markdown_safe(sha, 64)})" if isinstance(sha, str) else "")
            + "."
        )
    if top1 is not None:
        epoch = card_number(result.get("epoch"), 0, 10**9, digits=0)
        at = f" after epoch {epoch}" if epoch is not None else ""
        made.append(
            f"- Validation top-1 {top1}%{at}, on {markdown_safe(data)}'s validation split as "
            "`cmhsa train` held it out (the run's metrics.csv)."
        )
    if "cmhsa.source_sha256" in metadata:
        made.append(
            "- Converted exactly (Theorem 1) by `cmhsa convert` from the convolutional model with "
            f"sha256 {markdown_safe(metadata['cmhsa.source_sha256'], 64)}."
        )
    lines += made or ["- Not recorded in the weights' metadata (not written by `cmhsa train`)."]
    same = license_id == default_license
    lines += [
        "",
        "## Training data and licence",
        "",
        f"Training data: {data_named}. These weights are declared `{license_id}`"
        + (
            " here, the training data's licence, as `cmhsa export` sets it by default (`--license ID` "
            "sets another)."
            if same
            else f", set by `cmhsa export --license`; the training data's is `{default_license}`."
        ),
    ]
    names = from_metadata(metadata, cfg.num_classes)
    if names is not None:  # output i is class names[i]; anyone's folder names: inert text, bounded
        shown = ", ".join(markdown_safe(n, 60) for n in names[:SHOWN_CLASSES])
        more = len(names) - SHOWN_CLASSES
        rest = f", and {more:,} more (config.json's `label_names`)" if more > 0 else ""
        lines += ["", "## Classes", "", f"Output 0 first: {shown}{rest}."]
    p = preprocessing
    lines += [
        "",
        "## Input",
        "",
        f"{'Grey (PIL mode L)' if p['channels'] == 'L' else 'RGB'} images, {p['input_size']} "
        "(channels, height, width), fixed size. As "
        f"`cmhsa eval` and timm's evaluation transform: resize the shorter side to "
        f"{p['resize_shorter_to']} px ({p['interpolation']}), centre crop, scale to 0..1, normalise "
        f"with mean {p['mean']} and std {p['std']}. Output: {p['num_classes']} logits.",
        "",
        "## Use",
        "",
        f"You need cmhsa and timm. {install_line(url)} Then `import convit_convert.timm` before "
        "`timm.create_model`: it registers `cmhsa_conv` and `cmhsa_attn` with timm (without it timm "
        "says `Unknown model`, and transformers' pipeline asks to upgrade timm).",
        "",
        "```python",
        "import timm",
        "import timm.data",
        "import convit_convert.timm  # registers cmhsa_conv and cmhsa_attn with timm",
        "",
        '# "local-dir:" and this folder\'s path, or "hf-hub:" and its Hub name once uploaded',
        'model = timm.create_model("local-dir:PATH/TO/THIS/FOLDER", pretrained=True)',
        "config = timm.data.resolve_data_config({}, model=model)",
        "transform = timm.data.create_transform(**config)",
        "```",
        "",
        "Files: `model.safetensors` (the weights, cmhsa's checkpoint format: `cmhsa inspect` reads it) "
        "and `config.json` (timm's: the architecture, `model_args` with the whole cmhsa config, "
        "`pretrained_cfg`, whose `license` is the card's). Without cmhsa or torch: `cmhsa export "
        "model.safetensors -o model.onnx` writes an ONNX file that runs with onnxruntime alone, its "
        "preprocessing in its metadata.",
        "",
    ]
    return "\n".join(yaml) + "\n\n" + "\n".join(lines)
