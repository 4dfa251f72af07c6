"""Class names: what each of a model's outputs means, learnt once where a run reads its dataset and
carried by every file that holds the model (a checkpoint's ``cmhsa.classes`` metadata, a run's
config.json, an ONNX file's ``metadata_props``, a timm folder's ``pretrained_cfg.label_names``, the
model card). A name may come from anyone's folder, so names are checked where they enter: one
string each, at most MAX_NAME_CHARS, valid text a file can hold (:func:`check_name`: NFC, no
character ``text.hidden`` classifies as one a reader cannot see (controls, format, surrogate,
private-use, unassigned, default-ignorable, blank glyphs, spaces but U+0020), no space at either
end, no combining mark first), one per class, and no two that read alike: equal skeletons by
Unicode's confusables (UTS #39, :func:`skeleton`), at most MAX_NAMES_BYTES together as JSON.
Shown through ``text.py`` like any foreign string. No torch."""

from __future__ import annotations

import functools
import importlib.resources
import unicodedata
from collections.abc import Mapping, Sequence

from .errors import CmhsaError
from .io.paths import parse_json
from .text import hidden, json_text

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


# how a refusal names what ``text.hidden`` found, by the character's general category
CATEGORY_WORDS = {
    "Cc": "a control character",
    "Cf": "a format character (invisible: zero-width or bidi)",
    "Cs": "a lone surrogate (not text any file can hold)",
    "Co": "a private-use character",
    "Cn": "an unassigned character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Zs": "a space other than U+0020",
}


def _refused(ch: str) -> str | None:
    """Why the character ``ch`` may not be in a class name (None: it may): one that no reader can
    see for what it is (:func:`text.hidden`, the classification every sink shows escaped)."""
    if hidden(ch):
        return CATEGORY_WORDS.get(
            unicodedata.category(ch), "an invisible character (default-ignorable, or a blank glyph)"
        )
    return None


@functools.lru_cache(maxsize=1)
def _prototypes() -> dict[str, str]:
    """Each character of Unicode's confusables.txt (UTS #39) with the prototype it reads as, from
    the data the maintained ``confusable_homoglyphs`` package ships (Unicode's file as pairs, each
    listed both ways). Every pair joins a source character to its prototype, and a prototype is
    never a source, so the pairs form stars: a character with one partner is a source whose
    prototype is that partner, unless the partner has no other source either (a pair of two: either
    stands for both)."""
    data = importlib.resources.files("confusable_homoglyphs").joinpath("confusables.json").read_text("utf-8")
    pairs = parse_json(data, "confusable_homoglyphs/confusables.json", "Unicode's confusables")
    out = {}
    for ch, partners in pairs.items():
        if len(ch) == 1 and len(partners) == 1:
            to = partners[0]["c"]
            out[ch] = to if len(to) > 1 or len(pairs.get(to, ())) > 1 else min(ch, to)
    return out


def skeleton(name: str) -> str:
    """UTS #39's skeleton: NFD, each character replaced by its prototype, NFD again. Two names with
    one skeleton read alike (Latin ``a``, Cyrillic ``а`` and mathematical sans-serif ``𝖺``; ``m``
    and ``rn``)."""
    table = _prototypes()
    decomposed = unicodedata.normalize("NFD", name)
    return unicodedata.normalize("NFD", "".join(table.get(ch, ch) for ch in decomposed))


def _check_apart(names: Sequence[str], where: object) -> None:
    """No two names that read alike (one :func:`skeleton`), naming both and the characters apart."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        j = seen.setdefault(skeleton(name), i)
        if j != i and names[j] == name:
            raise CmhsaError(f"class name {name[:60]!r} is given twice (classes {j} and {i})", where)
        if j != i:
            apart = sorted(set(names[j]) ^ set(name))[:4]
            said = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, '')}".strip() for c in apart)
            raise CmhsaError(
                f"class names {j} and {i} read alike ({names[j][:60]!r} and {name[:60]!r}: "
                f"{said}; Unicode's confusables, UTS #39); rename one",
                where,
            )


def check_name(name: object, index: int, where: object = None) -> str:
    """Class ``index``'s name ``name`` as text a person can read and every file can hold: a string
    of 1 to MAX_NAME_CHARS characters in Unicode's NFC form, with no character :func:`_refused`
    and no space at either end (``one`` and ``one\\u200b`` would be two classes that read alike);
    else a one-line CmhsaError naming ``where`` and the index."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise CmhsaError(f"class name {index} is not a string of 1 to {MAX_NAME_CHARS} characters", where)
    for ch in name:
        why = _refused(ch)
        if why is not None:
            raise CmhsaError(f"class name {index} holds U+{ord(ch):04X}, {why}; rename the class", where)
    if name != name.strip(" "):
        raise CmhsaError(f"class name {index} begins or ends with a space; rename the class", where)
    if unicodedata.category(name[0]).startswith("M"):
        raise CmhsaError(
            f"class name {index} begins with U+{ord(name[0]):04X}, a combining mark (it joins what is "
            "shown before it); rename the class",
            where,
        )
    if unicodedata.normalize("NFC", name) != name:
        raise CmhsaError(
            f"class name {index} is not in Unicode's NFC form (a decomposed accent, as some file systems "
            "store names); rename the class",
            where,
        )
    return name


def check_class_names(names: object, num_classes: int, where: object = None) -> tuple[str, ...]:
    """``names`` as a tuple of ``num_classes`` distinct names (:func:`check_name` each), at most
    MAX_NAMES_BYTES as JSON; a one-line CmhsaError naming ``where`` otherwise."""
    if not isinstance(names, Sequence) or isinstance(names, str | bytes):
        raise CmhsaError(f"class names are {type(names).__name__}, not a list of strings", where)
    if len(names) != num_classes:
        raise CmhsaError(f"{len(names):,} class names for a model of {num_classes:,} classes", where)
    _check_each(names, where)
    if _too_many_bytes(names):
        raise CmhsaError(f"class names are more than {MAX_NAMES_BYTES:,} bytes together", where)
    return tuple(names)


def _check_each(names: Sequence[str], where: object) -> None:
    """Each name valid text (:func:`check_name`), and no two that read alike."""
    for i, name in enumerate(names):
        check_name(name, i, where)
    _check_apart(names, where)


def _too_many_bytes(names: Sequence[str]) -> bool:
    """More than MAX_NAMES_BYTES together as JSON (what a file's metadata holds)."""
    return len(json_text(list(names), indent=None)) > MAX_NAMES_BYTES


def recordable(names: Sequence[str] | None, num_classes: int, where: object = None) -> tuple[str, ...] | None:
    """A dataset's class names (its class folders', ``where``) if they can be carried, else None: a
    dataset of more names than a file's metadata holds still trains, its outputs then numbered. A
    name that is not valid text (:func:`check_name`) is refused, naming the class."""
    if names is None:
        return None
    _check_each(names, where)
    if len(names) != num_classes or _too_many_bytes(names):  # more than a file's metadata holds
        return None
    return tuple(names)


def from_metadata(
    metadata: Mapping[str, str], num_classes: int, where: object = None
) -> tuple[str, ...] | None:
    """The class names a file's metadata records (None if none), checked as untrusted input."""
    text = metadata.get(KEY)
    if text is None:
        return None
    names = parse_json(text, where, f"metadata {KEY}")
    return check_class_names(names, num_classes, where)


def to_metadata(names: Sequence[str] | None) -> dict[str, str]:
    """``{KEY: JSON}`` for a file's metadata, or {} when the names are not known."""
    return {} if names is None else {KEY: json_text(list(names), indent=None)}


def name_of(names: Sequence[str] | None, index: int) -> str:
    """Class ``index`` by name where known, else its number."""
    return names[index] if names is not None else str(index)
