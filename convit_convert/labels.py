"""Class names: what each of a model's outputs means, learnt once where a run reads its dataset and
carried by every file that holds the model (a checkpoint's ``cmhsa.classes`` metadata, a run's
config.json, an ONNX file's ``metadata_props``, a timm folder's ``pretrained_cfg.label_names``, the
model card). A name may come from anyone's folder, so names are checked where they enter: one
string each, at most MAX_NAME_CHARS, no two alike, one per class, at most MAX_NAMES_BYTES together
as JSON. Shown through ``text.py`` like any foreign string. No torch."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .errors import CmhsaError

KEY = "cmhsa.classes"  # the checkpoint metadata key; an ONNX file's metadata_props says "classes"
MAX_NAME_CHARS = 256  # a folder name is at most 255 bytes on the file systems cmhsa runs on
MAX_NAMES_BYTES = 64 * 2**10  # an ONNX metadata_props entry's bound; CIFAR-100's are 0.8 KB

DIGITS = tuple(str(i) for i in range(10))
FASHION_MNIST = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def check_class_names(names: object, num_classes: int, where: object = None) -> tuple[str, ...]:
    """``names`` as a tuple of ``num_classes`` distinct strings of at most MAX_NAME_CHARS, at most
    MAX_NAMES_BYTES as JSON; a one-line CmhsaError naming ``where`` otherwise."""
    if not isinstance(names, Sequence) or isinstance(names, str | bytes):
        raise CmhsaError(f"class names are {type(names).__name__}, not a list of strings", where)
    if len(names) != num_classes:
        raise CmhsaError(f"{len(names):,} class names for a model of {num_classes:,} classes", where)
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise CmhsaError(f"class name {i} is not a string of 1 to {MAX_NAME_CHARS} characters", where)
    if len(set(names)) != len(names):
        first = next(n for i, n in enumerate(names) if n in names[:i])
        raise CmhsaError(f"class name {first[:60]!r} is given twice", where)
    if len(json.dumps(list(names))) > MAX_NAMES_BYTES:
        raise CmhsaError(f"class names are more than {MAX_NAMES_BYTES:,} bytes together", where)
    return tuple(names)


def recordable(names: Sequence[str] | None, num_classes: int) -> tuple[str, ...] | None:
    """A dataset's class names if they can be carried (:func:`check_class_names`), else None: a
    dataset whose names cannot be recorded still trains, its outputs then numbered."""
    if names is None:
        return None
    try:
        return check_class_names(list(names), num_classes)
    except CmhsaError:
        return None


def from_metadata(
    metadata: Mapping[str, str], num_classes: int, where: object = None
) -> tuple[str, ...] | None:
    """The class names a file's metadata records (None if none), checked as untrusted input."""
    text = metadata.get(KEY)
    if text is None:
        return None
    try:
        names = json.loads(text)
    except (ValueError, RecursionError):
        raise CmhsaError(f"metadata {KEY} is not a JSON list", where) from None
    return check_class_names(names, num_classes, where)


def to_metadata(names: Sequence[str] | None) -> dict[str, str]:
    """``{KEY: JSON}`` for a file's metadata, or {} when the names are not known."""
    return {} if names is None else {KEY: json.dumps(list(names), ensure_ascii=False)}


def name_of(names: Sequence[str] | None, index: int) -> str:
    """Class ``index`` by name where known, else its number."""
    return names[index] if names is not None else str(index)
