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
from ..text import card_number, markdown_safe, yaml_text
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
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")  # user/name
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # the Hub's licence ids: cc-by-4.0, mit, other


def trained_data(metadata: dict[str, str]) -> str | None:
    """The dataset the run that made the weights recorded (``cmhsa.result``'s ``data``, or the
    second word of ``cmhsa.trained``, "phase1 digits, 30 epochs", which older runs wrote alone):
    a text, or None (absent, or not a text)."""
    data = _json(metadata, "cmhsa.result").get("data")
    if data is None and isinstance(metadata.get("cmhsa.trained"), str):
        words = metadata["cmhsa.trained"].replace(",", " ").split()
        data = words[1] if len(words) > 1 else None
    return data if isinstance(data, str) else None


def data_license(metadata: dict[str, str]) -> tuple[str, str]:
    """The licence id a card declares by default for weights with ``metadata``, and the training
    data as the card names it, from :func:`trained_data`. Weights fine-tuned from another model
    (``cmhsa.init``'s ``init_license``, recorded by `cmhsa train --init`) owe both datasets: the
    one licence where both are the same, else ``unknown`` where either is, else ``other``."""
    data = trained_data(metadata)
    own = DATA_LICENSES.get(data, NOT_RECORDED) if data is not None else NOT_RECORDED
    start = _json(metadata, "cmhsa.init").get("init_license")
    if not isinstance(start, str) or not LICENSE_ID.fullmatch(start) or start == own[0]:
        return own
    return ("unknown" if "unknown" in (start, own[0]) else "other"), own[1]


NOT_SPDX = ("other", "unknown")  # the Hub's two licence ids that name no licence


def check_license(license_id: str) -> str:
    """A known licence id as the Hub's front matter takes it: an SPDX licence identifier in lower
    case (``mit``, ``cc-by-4.0``, ``apache-2.0``; SPDX's list as the installed ``packaging`` has
    it), or ``other`` or ``unknown``; anything else (``no``, ``null``, ``0x1f``, a licence
    expression or reference) is refused."""
    from packaging.licenses import InvalidLicenseExpression, canonicalize_license_expression

    known = isinstance(license_id, str) and LICENSE_ID.fullmatch(license_id) is not None
    if known and license_id not in NOT_SPDX:
        try:
            spdx = canonicalize_license_expression(license_id)
            known = spdx.lower() == license_id and " " not in spdx and "licenseref" not in license_id
        except InvalidLicenseExpression:
            known = False
    if not known:
        raise CmhsaError(
            f"`license` {license_id!r} is not a known licence id: an SPDX identifier in lower case as "
            "the Hugging Face Hub writes one (mit, cc-by-4.0, apache-2.0), other or unknown"
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
    ``pip install cmhsa`` (which would install whatever someone else registered under the name),
    and, where the installed cmhsa records no source address, no command at all (none would work
    where the card is read)."""
    if url is None:
        return (
            "cmhsa is on no package index (a package of that name there would be someone else's), "
            "and this folder records no address for its source: install cmhsa from a copy of its "
            "source code, as its own README says."
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
    data = trained_data(metadata)
    start_data = init.get("init_data") if isinstance(init.get("init_data"), str) else None
    hub_id = init.get("init_hub_id")
    hub_id = hub_id if isinstance(hub_id, str) and HUB_ID.fullmatch(hub_id) else None
    default_license, data_named = data_license(metadata)
    license_id = check_license(license_id or default_license)
    arch = "cmhsa_attn" if cfg.kind == "attn" else "cmhsa_conv"
    # the Hub's convention for a model whose code travels with it: transformers runs it with
    # trust_remote_code=True and nothing else installed; timm needs cmhsa to know the architecture
    front: dict[str, Any] = {
        "library_name": "transformers",
        "license": license_id,
        "pipeline_tag": "image-classification",
        "tags": ["image-classification", "custom_code", "cmhsa", "vision-transformer", "timm", arch],
    }
    datasets = list(dict.fromkeys(HUB_DATASETS[d] for d in (data, start_data) if d in HUB_DATASETS))
    if datasets:
        front["datasets"] = datasets
    if hub_id is not None:  # the Hub's convention for a model fine-tuned from one of its models
        front["base_model"] = hub_id
    top1 = card_number(result.get("top1"), 0, 100)  # a figure from a file: only a real percentage
    if top1 is not None:
        front["metrics"] = ["accuracy"]
    heads = f", {cfg.num_heads} heads" if cfg.kind == "attn" else ""
    lines = [
        f"# {arch}: {KINDS[cfg.kind]}",
        "",
        "Made with cmhsa"
        + (f" ({url})" if url else "")
        + ", a reference implementation of the paper [*Can Vision Transformers Perform Convolution?*]"
        "(https://arxiv.org/abs/2111.01353), not its authors' code: "
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
        start = markdown_safe(str(init["init"]).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1])
        sha = init.get("init_sha256")
        made.append(
            f"- Start: {start}"
            + (f" (sha256 {markdown_safe(sha, 64)})" if isinstance(sha, str) else "")
            + (f", the Hub's `{hub_id}`" if hub_id else "")
            + (
                f", a model trained on {DATA_LICENSES.get(start_data, (None, markdown_safe(start_data)))[1]}"
                if start_data is not None
                else ""
            )
            + "."
        )
    if top1 is not None:
        epoch = card_number(result.get("epoch"), 0, 10**9, digits=0)
        at = f" after epoch {epoch}" if epoch is not None else ""
        split = result.get("split")
        where = f"{markdown_safe(data)}'s validation images"
        where = markdown_safe(split, 120) if isinstance(split, str) else where
        made.append(f"- Validation top-1 {top1}%{at}, on {where} (the run's metrics.csv).")
    if "cmhsa.source_sha256" in metadata:
        made.append(
            "- Converted exactly (Theorem 1) by `cmhsa convert` from the convolutional model with "
            f"sha256 {markdown_safe(metadata['cmhsa.source_sha256'], 64)}."
        )
    lines += made or ["- Not recorded in the weights' metadata (not written by `cmhsa train`)."]
    same = license_id == default_license
    started = (
        f" They were fine-tuned from a model trained on "
        f"{DATA_LICENSES.get(start_data, (None, markdown_safe(start_data)))[1]}, so they owe both."
        if start_data not in (None, data)
        else ""
    )
    subset = card_number(result.get("train_samples"), 1, 10**9, digits=0)
    subset = (
        f" A seeded subset of {subset} of its training images (`--train-samples {subset}`)." if subset else ""
    )
    if not same:
        declared = f", set by `cmhsa export --license`; by the data it would be `{default_license}`."
    elif license_id == "unknown":
        declared = (
            ": a licence cmhsa cannot know (the data's is not recorded or not known), as `cmhsa export` "
        )
        declared += "declares it by default (`--license ID` sets one you know)."
    elif license_id == "other":
        declared = ": the two datasets' licences differ, so no one licence is named; read both."
    else:
        whose = "the training data's licence" if not started else "the licence both datasets share"
        declared = f" here, {whose}, as `cmhsa export` sets it by default (`--license ID` sets another)."
    lines += [
        "",
        "## Training data and licence",
        "",
        f"Training data: {data_named}.{subset}{started} These weights are declared `{license_id}`{declared}",
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
        "With transformers alone (torch, transformers and Pillow; no cmhsa): the folder carries its "
        "model's code, `modeling_cmhsa.py`, which `trust_remote_code=True` runs (read it first: it "
        "imports torch and transformers only, and reads no file itself).",
        "",
        "```python",
        "from PIL import Image",
        "from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline",
        "",
        "# this folder's path, or its Hub name once uploaded",
        'folder = "PATH/TO/THIS/FOLDER"',
        'classify = pipeline("image-classification", model=folder, trust_remote_code=True)',
        'print(classify(Image.open("image.png")))',
        "",
        "processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)",
        "model = AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True)",
        'logits = model(**processor(Image.open("image.png"))).logits',
        "```",
        "",
        "Without `trust_remote_code=True`, transformers takes the folder for a timm model and asks "
        "for timm (`pip install timm`, then `pip install -U timm`): neither helps, as timm knows "
        "cmhsa's architectures only through cmhsa. Pass `trust_remote_code=True`.",
        "",
        f"With timm, cmhsa must be installed (timm alone says `No module named 'convit_convert'` or "
        f"`Unknown model`): {install_line(url)} Then `import convit_convert.timm` before "
        "`timm.create_model` registers `cmhsa_conv` and `cmhsa_attn`; `cmhsa predict` and "
        "`cmhsa eval` read the folder as it is.",
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
        "Files: `model.safetensors` (the weights, cmhsa's checkpoint format), `config.json` (timm's: "
        "the architecture, `model_args` with the whole cmhsa config, `pretrained_cfg`, whose "
        "`license` is the card's; its `auto_map` names `modeling_cmhsa.py`'s classes for "
        "transformers) and `modeling_cmhsa.py`. For onnxruntime alone, an ONNX file with its "
        "preprocessing in its metadata is made once, where cmhsa is installed: `cmhsa export "
        "model.safetensors -o model.onnx`.",
        "",
    ]
    return "---\n" + yaml_text(front) + "---\n\n" + "\n".join(lines)
