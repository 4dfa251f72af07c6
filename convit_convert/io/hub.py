"""Models on the Hugging Face Hub, named as timm names them: ``hf-hub:ORG/NAME[@REVISION]``, resolved
through huggingface_hub's cache to a local timm folder (``snapshot_download``; with
``HF_HUB_OFFLINE=1``, from what the cache already holds), then read as any folder is.

    hub_folder("hf-hub:someone/cmhsa-digits")   # -> (the snapshot's folder, "someone/cmhsa-digits")
    hub_id_of(path)                              # the Hub model a local folder is a cached snapshot of

A folder's name never makes it a Hub model: ``hub_id_of`` answers only for a snapshot in
huggingface_hub's own cache that huggingface_hub resolves to that folder (a copy elsewhere, whatever
its path says, is a local folder).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CmhsaError, one_line
from .model_card import HUB_ID

PREFIX = "hf-hub:"
# what cmhsa reads of a folder: its ONNX file and anything else the repository holds stay on the Hub
FILES = ["config.json", "model.safetensors", "README.md", "modeling_cmhsa.py"]


def is_hub_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``hf-hub:ORG/NAME[@REVISION]`` -> (ORG/NAME, REVISION or None), or a one-line CmhsaError."""
    repo, _, revision = name[len(PREFIX) :].partition("@")
    if not HUB_ID.fullmatch(repo) or (revision and not _revision_ok(revision)):
        raise CmhsaError(f"{name!r} is not a Hub model name (hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION)")
    return repo, revision or None


def _revision_ok(revision: str) -> bool:
    """A branch, tag or commit: no path separators beyond a branch's, no '..', at most 100 characters."""
    allowed = all(c.isalnum() or c in "._-/" for c in revision)
    return 0 < len(revision) <= 100 and ".." not in revision and allowed


def _hub() -> object:
    """huggingface_hub, an optional dependency (the `hub` extra), or a one-line CmhsaError."""
    try:
        import huggingface_hub
    except ImportError:
        raise CmhsaError(
            "hf-hub: names need huggingface_hub (pip install huggingface_hub, or cmhsa's `hub` extra)"
        ) from None
    return huggingface_hub


def hub_folder(name: str) -> tuple[Path, str]:
    """The local folder a Hub model name resolves to through huggingface_hub's cache (downloading
    what the cache lacks, unless ``HF_HUB_OFFLINE`` is set), and the model's ORG/NAME."""
    repo, revision = parse_hub_name(name)
    hf = _hub()
    try:
        path = hf.snapshot_download(repo, revision=revision, allow_patterns=FILES)
    except Exception as e:  # huggingface_hub's: not in the cache offline, no such repository, no network
        why = one_line(str(e))[:200]
        raise CmhsaError(f"huggingface_hub could not provide {name} ({type(e).__name__}: {why})") from None
    return Path(path), repo


def hub_id_of(path: Path) -> str | None:
    """ORG/NAME, where ``path`` is a snapshot folder in huggingface_hub's cache that huggingface_hub
    itself resolves (offline, from the cache) to this folder; else None. Never fetched."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    path = Path(path).resolve()
    parts = path.parts
    if len(parts) < 3 or parts[-2] != "snapshots":
        return None
    repo = parts[-3]
    if not repo.startswith("models--") or repo.count("--") != 2:
        return None
    hub = "/".join(repo.split("--")[1:])
    if not HUB_ID.fullmatch(hub):
        return None
    try:
        resolved = huggingface_hub.snapshot_download(hub, revision=parts[-1], local_files_only=True)
    except Exception:  # not a snapshot huggingface_hub knows
        return None
    return hub if Path(resolved).resolve() == path else None
