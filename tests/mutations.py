"""Mutations: each breaks one feature by hand (a text replacement in the code), and the tests named
beside it must then fail; a test that stays green under its mutation cannot fail for what its name
says. Not collected by pytest (its name); run it from the repository's root:

    python tests/mutations.py            # every mutation, each against its tests (about 6 minutes)
    python tests/mutations.py --list     # the mutations and their tests
    python tests/mutations.py glance     # those whose name holds "glance"

Each mutation is applied to the working tree, its tests are run in a fresh pytest process, and the
file is restored whatever happens; the script exits 1 if any mutation's tests all passed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    name: str
    file: str  # relative to the repository
    old: str  # the text replaced (it must occur exactly once)
    new: str
    tests: tuple[str, ...]  # pytest node ids or -k expressions' files: any failing is a catch


MUTATIONS = [
    Mutation(
        "the conversion path imports timm",
        "convit_convert/api/__init__.py",
        "from .verify import VerifyReport, verify_files\n",
        "from .verify import VerifyReport, verify_files\nimport timm  # noqa: F401\n",
        ("tests/test_cli.py::test_conversion_path_does_not_import_timm",),
    ),
    Mutation(
        "the glance made a no-op",
        "train/loop.py",
        "    loop.reporter.step(step_line(loop, since, t_last, now, loop.tally.peek()), glance=True)",
        "    pass",
        ("tests/test_progress.py::test_a_glance_reads_the_device_once_and_changes_nothing",),
    ),
    Mutation(
        "a glance that peeks and resets the tally (changes the run's loss)",
        "train/loop.py",
        "loop.tally.peek()), glance=True)",
        "loop.tally.read(max(loop.state.step - since, 1)).loss_sum), glance=True)",
        ("tests/test_progress.py::test_a_glance_reads_the_device_once_and_changes_nothing",),
    ),
    Mutation(
        "every seed of a stack glances",
        "train/loop.py",
        "            glance(lead, since, t_last, now)  # the lead seed's alone: one line, one read",
        "            [glance(loop, since, t_last, now) for loop in loops]",
        ("tests/test_progress.py::test_a_stack_glances_once_for_all_its_seeds",),
    ),
    Mutation(
        "cmhsa's gate gradient made the plain clamp's (the forward unchanged)",
        "convit_convert/attention.py",
        "        return g + (g.clamp(0, 1) - g).detach()",
        "        return g.clamp(0, 1)",
        ("tests/test_hub_code.py::test_the_shipped_model_trains_as_cmhsas",),
    ),
    Mutation(
        "the shipped model without drop path",
        "convit_convert/shipped/modeling_cmhsa.py",
        "        if self.p == 0.0 or not self.training:",
        "        if True:",
        ("tests/test_hub_code.py::test_the_shipped_model_trains_as_cmhsas",),
    ),
    Mutation(
        "the shipped config accepts any pinning",
        "convit_convert/shipped/modeling_cmhsa.py",
        "            if self.pinning not in PINNINGS:",
        "            if False:",
        ("tests/test_hub_code.py::test_a_value_the_model_lacks_is_refused",),
    ),
    Mutation(
        "a folder's config.json not held to its weights",
        "convit_convert/io/timm_folder.py",
        "    check_one_truth(cfg, held, config, weights)\n",
        "",
        ("tests/test_timm_folder_input.py::test_a_hostile_config_is_one_error_or_the_file_s_model",),
    ),
    Mutation(
        "cmhsa refuses what save_pretrained writes",
        "convit_convert/io/timm_folder.py",
        '    "architectures": lambda v: v == ["CmhsaForImageClassification"],\n',
        "",
        ("tests/test_hub_folders.py::test_what_transformers_saves_cmhsa_reads",),
    ),
    Mutation(
        "no note for a changed modeling file",
        "convit_convert/io/timm_folder.py",
        "    if text == SHIPPED.read_bytes():",
        "    if True:",
        ("tests/test_hub_folders.py::test_a_folder_whose_model_code_is_not_cmhsas_is_said_so",),
    ),
    Mutation(
        "base_model from a folder's name",
        "convit_convert/io/hub.py",
        "    try:\n        resolved = huggingface_hub.snapshot_download(",
        "    return hub\n    try:\n        resolved = huggingface_hub.snapshot_download(",
        ("tests/test_timm_folder.py::test_a_fine_tuned_models_card_says_what_it_started_from",),
    ),
    Mutation(
        "a stop during validation waits for its end",
        "train/loop.py",
        "            if stop.signal is not None and ctx.world == 1:\n                raise ValidationCut",
        "            pass",
        ("tests/test_stopping.py",),
    ),
    Mutation(
        "a second Ctrl-C abandons without a word",
        "train/run.py",
        '            say_now(f"second {name}: {self.abandons()}")\n',
        "",
        ("tests/test_stopping.py::test_a_second_ctrl_c_abandons_the_run_and_says_what_it_leaves",),
    ),
    Mutation(
        "the default threads blind to other work",
        "convit_convert/loaders.py",
        "    return cpus() if busy is None else max(1, cpus() - busy)",
        "    return cpus()",
        ("tests/test_train.py::test_default_workers_follow_the_machine",),
    ),
    Mutation(
        "a resume takes this machine's default threads",
        "train/run.py",
        "    if isinstance(last, int) and not isinstance(last, bool) and 1 <= last <= 4 * cpus():",
        "    if False:",
        ("tests/test_machine.py::test_a_resume_keeps_its_runs_threads_and_says_another_processor",),
    ),
    Mutation(
        "the run's estimate without its validations",
        "train/progress.py",
        "            validation if self.evaluates(self.epoch) else 0.0",
        "            0.0",
        (
            "tests/test_progress.py::test_a_step_line_says_the_rest_of_the_epoch_and_of_the_run_validations_included",
        ),
    ),
    Mutation(
        "a terminal's time refreshed only at read-outs",
        "convit_convert/cli/progress.py",
        'self.step_task, completed=done, info="  ".join(t for t in (self.numbers, left) if t)',
        "self.step_task, completed=done",
        ("tests/test_progress.py::test_on_a_terminal_the_bars_keep_their_width_and_refresh_their_time",),
    ),
    Mutation(
        "an ONNX session made before its size is checked",
        "convit_convert/onnx/load.py",
        '    check_fits(need, f"running the graph at batch {batch} (every node\'s outputs together)", '
        "path)\n",
        "",
        ("tests/test_onnx_sizes.py::test_no_onnx_run_without_the_total_size_check",),
    ),
    Mutation(
        "an ONNX file read before its size is held to memory",
        "convit_convert/onnx/load.py",
        "    _check_held(path, path.stat().st_size)\n",
        "",
        ("tests/test_onnx_sizes.py::test_an_onnx_file_s_weights_are_held_to_memory_before_they_are_read",),
    ),
    Mutation(
        "a text's own backslash shown as it is (an escape and a typed name read alike)",
        "convit_convert/text.py",
        '    return escaped(text.replace("\\\\", "\\\\\\\\"))',
        "    return escaped(text)",
        ("tests/test_foreign_text.py::test_names_that_print_alike_are_printed_apart",),
    ),
    Mutation(
        "class names that read alike accepted",
        "convit_convert/labels.py",
        "        check_name(name, i, where)\n    _check_apart(names, where)\n",
        "        check_name(name, i, where)\n",
        ("tests/test_class_names.py::test_names_that_read_alike_are_refused_naming_both",),
    ),
    Mutation(
        "the model card's values as plain text (a URL autolinks)",
        "convit_convert/text.py",
        '    return f"{fence}{pad}{text}{pad}{fence}"',
        "    return text",
        ("tests/test_foreign_text.py::test_the_card_shows_addresses_as_code_never_as_links",),
    ),
    Mutation(
        "onnxruntime's telemetry left on",
        "convit_convert/__init__.py",
        'os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")',
        "pass",
        ("tests/test_threat_model.py::test_onnxruntime_s_telemetry_is_off_unless_the_user_turned_it_on",),
    ),
]


def run(mutation: Mutation) -> bool:
    """Apply ``mutation``, run its tests, restore the file; True if some test failed (caught)."""
    path = ROOT / mutation.file
    text = path.read_text(encoding="utf-8")
    if text.count(mutation.old) != 1:
        raise SystemExit(
            f"{mutation.name}: the text to replace occurs {text.count(mutation.old)} times in {path}"
        )
    try:
        path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "-m",
                "slow or not slow",
                *mutation.tests,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        path.write_text(text, encoding="utf-8")
    return r.returncode != 0


def main() -> None:
    args = sys.argv[1:]
    chosen = [m for m in MUTATIONS if not args or args == ["--list"] or any(a in m.name for a in args)]
    if args == ["--list"]:
        for m in chosen:
            print(f"{m.name}: {', '.join(m.tests)}")
        return
    survived = []
    for m in chosen:
        caught = run(m)
        print(f"{'caught  ' if caught else 'SURVIVED'}  {m.name}", flush=True)
        if not caught:
            survived.append(m.name)
    print(f"\n{len(chosen) - len(survived)} of {len(chosen)} mutations caught")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
