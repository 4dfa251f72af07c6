"""timm's own model tests (``tests/test_models.py`` from the installed timm's source package on PyPI,
unmodified, fetched at test time and never copied here) on cmhsa's four registered models.

tests/timm_plugin.py picks the models as timm picks its own ViTs and skips what cmhsa does not
support (``SKIPS``, README's "timm's own tests" table). About 3 minutes on 2 cores, most of it
timm's prune contract on the 90M-parameter attention models.

Needs PyPI (pip download): with no registry the test fails, so CI cannot pass without running it;
CMHSA_OFFLINE=1 turns that failure into a skip on a machine that is offline on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest
import timm

from timm_plugin import MODELS, SKIPS

TESTS = Path(__file__).parent
README = TESTS.parent / "README.md"
FILES = ("tests/__init__.py", "tests/conftest.py", "tests/test_models.py")
# What must pass on every model; the rest of the file names other models or is not picked for ViTs
MUST_PASS = {
    "test_model_forward", "test_model_backward", "test_model_default_cfgs_non_std",
    "test_model_forward_intermediates_features", "test_model_forward_intermediates",
    "test_prune_intermediate_layers_contract", "test_model_forward_fx", "test_model_backward_fx",
}  # fmt: skip


def timm_tests(dest: Path) -> Path:
    """timm's test files from the sdist of the installed version, extracted under ``dest``."""
    sdist = dest / "sdist"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
    done = subprocess.run(
        [*pip, f"timm=={timm.__version__}", "-d", str(sdist)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        if os.environ.get("CMHSA_OFFLINE") == "1":
            pytest.skip("CMHSA_OFFLINE=1 and timm's sdist could not be downloaded")
        pytest.fail(f"could not download timm {timm.__version__}'s sdist from PyPI:\n{done.stderr[-2000:]}")
    (archive,) = sdist.glob("timm-*.tar.gz")
    root = dest / "timm"
    with tarfile.open(archive) as tar:
        for name in FILES:
            member = tar.getmember(f"timm-{timm.__version__}/{name}")
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(tar.extractfile(member).read())
    (root / "pytest.ini").write_text("[pytest]\n")  # not this repo's config (its markers, -ra, filters)
    return root


def test_timm_model_suite_passes_on_every_registered_model(tmp_path: Path) -> None:
    root = timm_tests(tmp_path)
    report = tmp_path / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    env.pop("GITHUB_ACTIONS", None)  # timm's file shrinks its selection on GitHub's runners
    cmd = [sys.executable, "-m", "pytest", "-p", "timm_plugin", "-p", "no:cacheprovider", "-q",
           "tests/test_models.py", f"--junitxml={report}", "--rootdir", str(root)]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    outcomes: dict[str, dict[str, str]] = defaultdict(dict)
    for case in ET.parse(report).getroot().iter("testcase"):
        test, _, params = case.get("name").partition("[")
        model = params.rstrip("]").split("-")[-1]
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[test][model] = "failed" if failed else f"skipped: {skipped.get('message')}" if skipped is not None else "passed"  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:]
    for test in MUST_PASS:
        assert outcomes[test] == dict.fromkeys(MODELS, "passed"), (test, outcomes[test])
    for test, reason in SKIPS.items():
        assert set(outcomes[test]) == set(MODELS), test
        assert all(reason in outcome for outcome in outcomes[test].values()), outcomes[test]
    assert set(outcomes) == MUST_PASS | set(SKIPS), sorted(outcomes)


def test_readme_lists_every_skip_with_its_reason() -> None:
    readme = README.read_text()
    for test, reason in SKIPS.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{test}`")), None)
        assert row is not None, test
        assert reason.replace("`", "") in row.replace("`", ""), row
