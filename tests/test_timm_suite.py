"""timm's own model tests (``tests/test_models.py`` from the installed timm's source package on PyPI,
unmodified, fetched at test time and never copied here) on cmhsa's four registered models.

tests/timm_plugin.py picks the models as timm picks its own ViTs and skips what cmhsa does not
support (``SKIPS``, docs/python.md's "timm's own tests" table). 86 s on 2 cores, most of it
timm's prune contract on cmhsa_attn's 156M parameters.

Needs PyPI (pip download) once per timm version and machine: the sdist is cached (CMHSA_CACHE,
default ~/.cache/cmhsa) and reused while its sha256 is the pinned one. With no registry and no cached
copy the test fails, so CI cannot pass without running it; CMHSA_OFFLINE=1 turns that failure into
a skip on a machine that is offline on purpose. In the full tier only (``slow``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest
import timm

from timm_plugin import MODELS, MODULE_TESTS, SAME_MODULES, SAME_MODULES_REASON, SKIPS

TESTS = Path(__file__).parent
README = TESTS.parent / "docs" / "python.md"  # its "timm's own tests" section
FILES = ("tests/__init__.py", "tests/conftest.py", "tests/test_models.py")
# What must pass on every model; the rest of the file names other models or is not picked for ViTs
MUST_PASS = {
    "test_model_forward",
    "test_model_backward",
    "test_model_default_cfgs_non_std",
    "test_model_forward_intermediates_features",
    "test_model_forward_intermediates",
    "test_prune_intermediate_layers_contract",
    "test_model_forward_fx",
    "test_model_backward_fx",
}


# sha256 of timm's sdist by version, as PyPI serves it (pip checks the index's hash on download):
# a cached copy is used only while it still has this hash; a version not listed is downloaded and its
# hash kept beside the cached copy
SDIST_SHA256 = {"1.0.31": "baa0b333339c46d3d6d4965d99b69f5053afed71210e8f433d7ea5ee6a18f0ec"}
CACHE = Path(os.environ.get("CMHSA_CACHE", Path.home() / ".cache" / "cmhsa")) / "timm-sdist"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def timm_sdist(dest: Path) -> Path:
    """The installed timm's sdist: the cached copy (CMHSA_CACHE, default ~/.cache/cmhsa) where its
    hash is the pinned one, else downloaded from PyPI once and cached."""
    version = timm.__version__
    cached, sidecar = CACHE / f"timm-{version}.tar.gz", CACHE / f"timm-{version}.tar.gz.sha256"
    want = SDIST_SHA256.get(version) or (sidecar.read_text().strip() if sidecar.is_file() else None)
    if cached.is_file() and want and _sha256(cached) == want:
        return cached
    sdist = dest / "sdist"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
    done = subprocess.run(
        [*pip, f"timm=={version}", "-d", str(sdist)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        if os.environ.get("CMHSA_OFFLINE") == "1":
            pytest.skip("CMHSA_OFFLINE=1 and timm's sdist could not be downloaded")
        pytest.fail(f"could not download timm {version}'s sdist from PyPI:\n{done.stderr[-2000:]}")
    (archive,) = sdist.glob("timm-*.tar.gz")
    got = _sha256(archive)
    if version in SDIST_SHA256 and got != SDIST_SHA256[version]:
        pytest.fail(f"timm {version}'s sdist has sha256 {got}, not the pinned {SDIST_SHA256[version]}")
    with contextlib.suppress(OSError):  # a cache that cannot be written costs a download next time
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = CACHE / f".{cached.name}.{os.getpid()}"
        shutil.copyfile(archive, tmp)
        os.replace(tmp, cached)
        sidecar.write_text(got + "\n")
    return archive


def timm_tests(dest: Path) -> Path:
    """timm's test files from the sdist of the installed version, extracted under ``dest``."""
    archive = timm_sdist(dest)
    root = dest / "timm"
    with tarfile.open(archive) as tar:
        for name in FILES:
            member = tar.getmember(f"timm-{timm.__version__}/{name}")
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(tar.extractfile(member).read())
    (root / "pytest.ini").write_text("[pytest]\n")  # not this repo's config (its markers, -ra, filters)
    return root


@pytest.mark.slow
def test_timm_model_suite_passes_on_every_registered_model(tmp_path: Path) -> None:
    root = timm_tests(tmp_path)
    report = tmp_path / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    env.pop("GITHUB_ACTIONS", None)  # timm's file shrinks its selection on GitHub's runners
    cmd = [
        sys.executable,
        *"-m pytest -p timm_plugin -p no:cacheprovider -q tests/test_models.py".split(),
        f"--junitxml={report}",
        "--rootdir",
        str(root),
    ]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    outcomes: dict[str, dict[str, str]] = defaultdict(dict)
    for case in ET.parse(report).getroot().iter("testcase"):
        test, _, params = case.get("name").partition("[")
        model = params.rstrip("]").split("-")[-1]
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[test][model] = (
            "failed" if failed else f"skipped: {skipped.get('message')}" if skipped is not None else "passed"
        )
    assert done.returncode == 0, done.stdout[-6000:]
    for test in MUST_PASS:
        once = test in MODULE_TESTS
        skipped = f"skipped: {SAME_MODULES_REASON}"
        want = {m: skipped if once and m in SAME_MODULES else "passed" for m in MODELS}
        assert outcomes[test] == want, (test, outcomes[test])
    for test, reason in SKIPS.items():
        assert set(outcomes[test]) == set(MODELS), test
        assert all(reason in outcome for outcome in outcomes[test].values()), outcomes[test]
    assert set(outcomes) == MUST_PASS | set(SKIPS), sorted(outcomes)


def test_models_said_to_share_modules_build_the_same_modules() -> None:
    """What lets timm's tests of the modules run once for cmhsa_attn, cmhsa5_224 and cmhsa3_224: the same
    modules, parameters and shapes, configs equal but for kernel_size (built on the meta device)."""
    import dataclasses

    import torch

    with torch.device("meta"):
        built = {name: timm.create_model(name) for name in {*SAME_MODULES, *SAME_MODULES.values()}}
    for name, same in SAME_MODULES.items():
        model, other = built[name], built[same]
        assert str(model) == str(other), name
        assert [(k, v.shape) for k, v in model.state_dict().items()] == [
            (k, v.shape) for k, v in other.state_dict().items()
        ], name
        assert dataclasses.replace(model.cfg, kernel_size=other.cfg.kernel_size) == other.cfg, name
        assert model.cfg.kind == "attn", name  # a conv-phase model's kernel_size shapes its layers


def test_readme_lists_every_skip_with_its_reason() -> None:
    readme = README.read_text()
    row = next(line for line in readme.splitlines() if SAME_MODULES_REASON in line.replace("`", ""))
    assert all(f"`{test}`" in row.split("|")[1] for test in MODULE_TESTS), row
    assert all(f"`{model}`" in row.split("|")[1] for model in SAME_MODULES), row
    for test, reason in SKIPS.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{test}`")), None)
        assert row is not None, test
        assert reason.replace("`", "") in row.replace("`", ""), row
