"""Which start, at the paper's depth, with every start's learning rate tuned alike, and what each costs.

    python experiments/tuned_comparison.py [--depth 6] [--epochs 200] [--tune-epochs 50]
                                           [--train-samples 1000]
                                           [--holdout 2000] [--val-samples 2000] [--seeds 0 1]
                                           [--out experiments/out/tuned-d6] [--data-dir DIR]
                                           [--device auto|cpu|cuda] [--loader auto|device|workers]
                                           [--parallel N] [--time-budget SECONDS]
                                           [--record SWEEP.json] [--beyond | --recheck SEED ...]

The model and recipe of init_comparison.py (``--preset cpu``: 28 px, P 4, d 48, K 5, 9 heads) at
``--depth`` blocks, on a seeded subset of ``--train-samples`` Fashion-MNIST training images. The
rule, fixed before any result (EXPERIMENTS.md, "Tuned alike"):

1. **Tune** on seed 0 for ``--tune-epochs`` epochs (warm-up a tenth), every arm over its grid:
   phase 1 only, impulse init and random init over :data:`SCRATCH` (3 rates spanning 10x); two-phase
   gated and two-phase hard (the paper's) over :data:`AFTER` x :data:`MULT` for phase 2 (6 pairs),
   after a phase-1 half at phase 1's chosen rate. Each run is judged on ``--holdout`` training
   images the subset leaves out (``--holdout``, never the validation split): the mean top-1 of its
   last :data:`WINDOW` epochs; the highest wins.
2. **Train** every arm at its chosen values for ``--epochs`` (two-phase: half and half) on every
   seed, evaluated each epoch on the first ``--val-samples`` validation images, then finally on
   all 10k. Plus the compute-matched arm: phase 1 (at its chosen rate) for longer than two-phase's
   half, then a short gated phase 2 (at gated's chosen values) taking about a quarter of the
   multiply-adds, the two together costing what phase 1 alone costs (:func:`matched_epochs`).
   And the restart control: the phase-1 half, then phase 1 again for the other half from it
   (``--init``) at gated two-phase's chosen rate and warm-up, the conversion left out.
3. **Report**: the table (top-1, the plateau gain of the last fifth, CPU seconds and training
   multiply-adds), the sweep, and cost.png (top-1 against CPU seconds and against multiply-adds).

Every run is an arm (convit_convert/train/arms.py): finished ones are skipped, stopped ones resumed,
a stage starts once the one before it is done; exit code 3 until everything is (run the same
command again, in the same or a later session).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from arms_cli import add_arm_flags, chosen_settings, needed, run_or_exit
from fashion_mnist import config, stat
from init_comparison import curve, final_eval, plateau_gain

from convit_convert.train.arms import DONE, Arm

SCRATCH = (6.3e-4, 2e-3, 6.3e-3)  # from scratch: the table's 2e-3 in the middle, sqrt(10) apart
AFTER = (6.3e-5, 2e-4, 6.3e-4)  # phase 2 after conversion: the same, 10x lower (the paper's ratio)
MULT = (1.0, 10.0)  # --attn-lr-mult after conversion: the paper's 1, and cmhsa's default 10
WINDOW = 5  # a tuning run's score: mean held-out top-1 of its last WINDOW epochs
MATCHED_P2_COST = 0.25  # the compute-matched arm's phase 2: a quarter of phase 1 alone's multiply-adds
SETTINGS = [  # (setting, arm whose tuned values it uses, run names it is made of)
    ("phase 1 only", "p1", ("p1",)),
    ("phase 2 only, impulse init", "impulse", ("impulse",)),
    ("phase 2 only, random init", "random", ("random",)),
    ("two-phase, gated pinning", "gated", ("half-p1", "gated")),
    ("two-phase, hard pinning (the paper's)", "hard", ("half-p1", "hard")),
    ("long phase 1, short gated phase 2 (compute-matched)", "gated", ("long-p1", "short-gated")),
    # the restart control: gated's half exactly (epochs, rate, warm-up), the model left a convolution
    ("phase 1, restarted (phase 2's rate and warm-up, no conversion)", "gated", ("half-p1", "p1-restart")),
]


def tag(lr: float, mult: float | None = None) -> str:
    return f"lr{lr:g}" + ("" if mult is None else f"-mult{mult:g}")


def score(arm: Arm) -> float:
    """A tuning run's score: its held-out top-1, mean of the last WINDOW epochs."""
    rows = arm.rows()
    return statistics.mean(r["top1"] for r in rows[-WINDOW:])


def common(args: argparse.Namespace, seed: int, tuning: bool) -> dict:
    samples = dict(holdout=args.holdout) if tuning else dict(val_samples=args.val_samples)
    return dict(
        seed=seed,
        depth=args.depth,
        train_samples=args.train_samples,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        device=args.device,
        loader=args.loader,
        **samples,
    )


def tune_dir(seed: int) -> str:
    """Where a seed's tuning runs go: the sweep's (seed 0) in tune/, a --recheck seed's apart."""
    return "tune" if seed == 0 else f"recheck-seed{seed}"


def tuning_arm(
    args: argparse.Namespace,
    name: str,
    epochs: int,
    after: tuple[str, ...] = (),
    seed: int = 0,
    top: str = "",
    **flags,
) -> Arm:
    """One tuning run (seed 0: the sweep's), judged on held-out training images, in
    ``--out``/``top`` (default :func:`tune_dir`)/``name``."""
    top = top or tune_dir(seed)
    kw = common(args, seed, tuning=True)
    cfg = config(args.out / top / name, epochs=epochs, warmup_epochs=epochs // 10, **kw, **flags)
    return Arm(f"{top}/{name}", cfg, tuple(f"{top}/{a}" for a in after))


def two_phase_arm(
    args: argparse.Namespace, name: str, pinning: str, lr: float, mult: float, seed: int = 0, top: str = ""
) -> Arm:
    """A two-phase tuning run's phase 2: from the tuning phase-1 half's model, the other half of the
    epochs."""
    top = top or tune_dir(seed)
    e, conv = args.tune_epochs, str(args.out / top / "half-p1" / "conv.safetensors")
    flags = dict(phase="phase2", init=conv, pinning=pinning, lr=lr, attn_lr_mult=mult)
    return tuning_arm(args, name, e - e // 2, ("half-p1",), seed, top, **flags)


def half_p1_arm(args: argparse.Namespace, chosen: dict[str, dict], seed: int = 0, top: str = "") -> Arm:
    """The two-phase tuning runs' phase-1 half: half the tuning epochs at phase 1's chosen rate."""
    return tuning_arm(
        args, "half-p1", args.tune_epochs // 2, (), seed, top, phase="phase1", lr=chosen["p1"]["lr"]
    )


def tuning_arms(args: argparse.Namespace, chosen: dict[str, dict]) -> list[Arm]:
    """Stage 1's runs (phase 1, impulse, random), and stage 2's (two-phase) once phase 1's rate is chosen."""
    e = args.tune_epochs
    arms = [tuning_arm(args, f"p1/{tag(lr)}", e, phase="phase1", lr=lr) for lr in SCRATCH]
    for start in ("impulse", "random"):  # phase 1 first: the two-phase grids wait for its choice
        arms += [
            tuning_arm(args, f"{start}/{tag(lr)}", e, phase="phase2", init=start, lr=lr) for lr in SCRATCH
        ]
    if "p1" in chosen:
        arms.append(half_p1_arm(args, chosen))
        for pinning in ("gated", "hard"):
            for lr in AFTER:
                arms += [two_phase_arm(args, f"{pinning}/{tag(lr, m)}", pinning, lr, m) for m in MULT]
    return arms


def step_beyond(grid: tuple[float, ...]) -> float:
    """The value one step past a geometric grid's top (its ratio once more, 2 significant digits)."""
    return float(f"{grid[-1] ** 2 / grid[-2]:.2g}")


def beyond_arms(args: argparse.Namespace, chosen: dict[str, dict]) -> list[Arm]:
    """The supplementary check, outside the rule (it never changes a choice): for each arm whose
    chosen rate is its grid's top, one tuning run a grid step past it (tune/beyond/...), at the
    chosen multiplier, scored alike. The two-phase ones start from the sweep's phase-1 half, made
    again where its folder is gone, and the chosen gated point runs again beside them: its score
    against the recorded one shows whether the remade half reproduces the sweep's (at depth 6 on a
    new machine it did not: 73.87 against 75.00, EXPERIMENTS.md)."""
    e, arms = args.tune_epochs, []
    for kind, flags in (
        ("p1", {"phase": "phase1"}),
        ("impulse", {"phase": "phase2", "init": "impulse"}),
        ("random", {"phase": "phase2", "init": "random"}),
    ):
        if chosen[kind]["lr"] == SCRATCH[-1]:
            lr = step_beyond(SCRATCH)
            arms.append(tuning_arm(args, f"beyond/{kind}/{tag(lr)}", e, lr=lr, **flags))
    two_phase = [kind for kind in ("gated", "hard") if chosen[kind]["lr"] == AFTER[-1]]
    if two_phase:
        g = chosen["gated"]
        arms.append(half_p1_arm(args, chosen))
        arms.append(
            two_phase_arm(
                args, f"gated/{tag(g['lr'], g['attn_lr_mult'])}", "gated", g["lr"], g["attn_lr_mult"]
            )
        )
    for kind in two_phase:
        lr, mult = step_beyond(AFTER), chosen[kind]["attn_lr_mult"]
        arms.append(two_phase_arm(args, f"beyond/{kind}/{tag(lr, mult)}", kind, lr, mult))
    return arms


def beyond(args: argparse.Namespace) -> None:
    """Run :func:`beyond_arms` (the sweep must be complete), print its table, write its record."""
    _, chosen, _ = stages(args)
    if not {"p1", "impulse", "random", "gated", "hard"} <= chosen.keys():
        raise SystemExit("error: --beyond needs the complete sweep; run without --beyond first")
    arms = beyond_arms(args, chosen)
    run_or_exit(arms, args)
    rows = []
    for arm in arms:
        if arm.name != "tune/half-p1":
            kind = arm.name.removeprefix("tune/").removeprefix("beyond/").partition("/")[0]
            r = arm.config.recipe
            rows.append(
                {
                    "run": arm.name,
                    "kind": kind,
                    "lr": r.lr,
                    "attn_lr_mult": r.attn_lr_mult,
                    "score": score(arm),
                    "chosen": chosen[kind],
                    "environments": arm.environments(),
                }
            )
    path = record_path(args).with_name(f"tuned_comparison_d{args.depth}_beyond.json")
    path.write_text(json.dumps({"settings": settings(args), "rows": rows}, indent=1) + "\n")
    print(f"\nBeyond the grid's top (seed 0, {args.tune_epochs} epochs, held-out top-1 as in the sweep)\n")
    print("| arm | run | value | held-out top-1 % | chosen value's, recorded |\n|---|---|---|---:|---:|")
    for row in rows:
        what = "one step past the top" if "/beyond/" in row["run"] else "the chosen value again"
        print(
            f"| {row['kind']} | {what} | {value_text(row)} | {row['score']:.2f} | "
            f"{row['chosen']['score']:.2f} |"
        )
    print(f"\nwrote {path}")


# the sweep's decisive two-phase points (EXPERIMENTS.md): gated's multiplier (1 against 10 at
# 6.3e-4) and the rate past the grid's top (2e-3, --beyond) against the chosen 6.3e-4
RECHECK = (
    ("gated", 6.3e-4, 1.0),
    ("gated", 6.3e-4, 10.0),
    ("gated", 2e-3, 10.0),
    ("hard", 6.3e-4, 1.0),
    ("hard", 2e-3, 1.0),
)


def recheck(args: argparse.Namespace) -> None:
    """The decisive points again, each ``--recheck`` seed with its own phase-1 half (seed 0: the
    sweep's seed, remade at the fixed thread count), scored as the sweep scores; beside the scores
    the sweep and --beyond recorded. Never changes a choice."""
    _, chosen, _ = stages(args)
    if "p1" not in chosen:
        raise SystemExit("error: --recheck needs phase 1's choice from the sweep; run the sweep first")
    arms = []
    for seed in args.recheck:
        top = f"recheck-seed{seed}"
        arms.append(half_p1_arm(args, chosen, seed, top))
        arms += [two_phase_arm(args, f"{k}/{tag(lr, m)}", k, lr, m, seed, top) for k, lr, m in RECHECK]
    run_or_exit(arms, args)
    recorded = {}
    for name in (f"tuned_comparison_d{args.depth}_sweep.json", f"tuned_comparison_d{args.depth}_beyond.json"):
        path = record_path(args).with_name(name)
        if path.is_file():
            doc = json.loads(path.read_text())
            runs = [r for rs in doc.get("grid", {}).values() for r in rs] + doc.get("rows", [])
            recorded |= {
                r["run"].replace("beyond/", ""): r["score"]
                for r in runs
                if "beyond/" in r["run"] or "grid" in doc
            }
    rows = []
    for kind, lr, mult in RECHECK:
        name = f"{kind}/{tag(lr, mult)}"
        row = {"arm": kind, "lr": lr, "attn_lr_mult": mult, "seed0_recorded": recorded.get(f"tune/{name}")}
        for seed in args.recheck:
            arm = next(a for a in arms if a.name == f"recheck-seed{seed}/{name}")
            row[f"seed{seed}"] = score(arm)
            row[f"seed{seed}_environments"] = arm.environments()
        rows.append(row)
    path = record_path(args).with_name(f"tuned_comparison_d{args.depth}_recheck.json")
    path.write_text(
        json.dumps({"settings": settings(args), "seeds": args.recheck, "rows": rows}, indent=1) + "\n"
    )
    seeds = " | ".join(f"seed {s} (this run)" for s in args.recheck)
    print(
        f"\nThe decisive points again ({args.tune_epochs} epochs, held-out top-1 "
        "as in the sweep, 1 thread each)\n"
    )
    print(f"| arm | value | seed 0, recorded | {seeds} |\n|---|---|---:|{'---:|' * len(args.recheck)}")
    for row in rows:
        rec = "" if row["seed0_recorded"] is None else f"{row['seed0_recorded']:.2f}"
        vals = " | ".join(f"{row[f'seed{s}']:.2f}" for s in args.recheck)
        print(f"| {row['arm']} | {value_text(row | {'lr': row['lr']})} | {rec} | {vals} |")
    print(f"\nwrote {path}")


def value_text(run: dict) -> str:
    """A grid point's values as the tables write them: 'lr 2e-4, attn-lr-mult 10'."""
    return tag(run["lr"], run["attn_lr_mult"]).replace("lr", "lr ").replace("-mult", ", attn-lr-mult ")


def choices(arms: list[Arm], recorded: dict[str, float]) -> tuple[dict[str, dict], dict[str, list]]:
    """Each arm's chosen values, for the arms whose whole grid is scored; and every grid run's
    score: its own (a finished run here), else ``recorded``'s (a run a session before finished)."""
    grid: dict[str, list] = {}
    for arm in arms:
        kind, _, name = arm.name.removeprefix("tune/").partition("/")
        if name:
            r = arm.config.recipe
            done = score(arm) if arm.status == DONE else recorded.get(arm.name)
            run = {"lr": r.lr, "attn_lr_mult": r.attn_lr_mult, "run": arm.name, "score": done}
            if envs := arm.environments():  # where it ran, if it ran here (a recorded score has none)
                run["environments"] = envs
            grid.setdefault(kind, []).append(run)
    chosen = {
        kind: max(runs, key=lambda run: run["score"])
        for kind, runs in grid.items()
        if all(run["score"] is not None for run in runs)
    }
    return chosen, grid


def macs_per_image(phase: str, args: argparse.Namespace) -> float:
    """Multiply-adds of one training image (forward and backward: 3x the forward's), counted by
    torch's FlopCounterMode on the arm's model (2 FLOPs per multiply-add)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from convit_convert.model import VisionTransformer
    from convit_convert.train.phases import flag_config

    cfg = config(
        Path("unused"), phase=phase, depth=args.depth, init="impulse" if phase == "phase2" else "random"
    )
    mcfg = flag_config(cfg, 10)
    if phase == "phase2":
        mcfg = mcfg.with_attention(9, sink=True, pinning="gated")
    model = VisionTransformer(mcfg)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, mcfg.in_chans, *mcfg.img_size))
    return 3 * counter.get_total_flops() / 2


def matched_epochs(args: argparse.Namespace) -> tuple[int, int]:
    """(phase-1 epochs, phase-2 epochs) of the compute-matched arm: phase 2 about a quarter of what
    phase 1 alone costs in multiply-adds, phase 1 the epochs that leave the total at most that."""
    ratio = macs_per_image("phase2", args) / macs_per_image("phase1", args)
    p2 = max(1, round(args.epochs * MATCHED_P2_COST / ratio))
    return args.epochs - math.ceil(p2 * ratio), p2


def full_arms(args: argparse.Namespace, chosen: dict[str, dict]) -> list[Arm]:
    """Stage 3: every setting at its chosen values, every seed (those whose values are chosen)."""
    if not {"p1", "impulse", "random", "gated", "hard"} <= chosen.keys():
        return []
    e, half = args.epochs, args.epochs // 2
    long_p1, short_p2 = matched_epochs(args)
    arms = []
    for seed in args.seeds:
        d, kw = args.out / f"seed{seed}", common(args, seed, tuning=False)

        def add(name: str, epochs: int, after: tuple[str, ...] = (), **flags) -> None:
            cfg = config(d / name, epochs=epochs, warmup_epochs=epochs // 10, **kw, **flags)  # noqa: B023
            arms.append(Arm(f"seed{seed}/{name}", cfg, tuple(f"seed{seed}/{a}" for a in after)))  # noqa: B023

        def after(kind: str, p1: str) -> dict:
            c = chosen[kind]
            return dict(
                phase="phase2",
                init=str(d / p1 / "conv.safetensors"),  # noqa: B023
                lr=c["lr"],
                attn_lr_mult=c["attn_lr_mult"],
            )

        p1_lr = chosen["p1"]["lr"]
        add("half-p1", half, phase="phase1", lr=p1_lr)
        if long_p1 >= 1:  # too few --epochs leave nothing to match (tiny test runs)
            add("long-p1", long_p1, phase="phase1", lr=p1_lr)
        add("gated", e - half, ("half-p1",), pinning="gated", **after("gated", "half-p1"))
        add("hard", e - half, ("half-p1",), pinning="hard", **after("hard", "half-p1"))
        if long_p1 >= 1:
            add("short-gated", short_p2, ("long-p1",), pinning="gated", **after("gated", "long-p1"))
        restart = dict(init=str(d / "half-p1" / "conv.safetensors"), lr=chosen["gated"]["lr"])
        add("p1-restart", e - half, ("half-p1",), phase="phase1", **restart)
        add("p1", e, phase="phase1", lr=p1_lr)
        add("impulse", e, phase="phase2", init="impulse", lr=chosen["impulse"]["lr"])
        add("random", e, phase="phase2", init="random", lr=chosen["random"]["lr"])
    return arms


def settings(args: argparse.Namespace) -> dict:
    """What a sweep's choices depend on: a recorded sweep is reused only for the same."""
    keys = ("depth", "tune_epochs", "train_samples", "holdout", "batch_size")
    return {
        **{k: getattr(args, k) for k in keys},
        "scratch": SCRATCH,
        "after": AFTER,
        "mult": MULT,
        "window": WINDOW,
    }


def record_path(args: argparse.Namespace) -> Path:
    """The sweep's record, committed (experiments/results/): a later session, on a new machine,
    trains the chosen values without the tuning runs' folders."""
    default = Path(__file__).resolve().parent / "results" / f"tuned_comparison_d{args.depth}_sweep.json"
    return args.record or default


def stages(args: argparse.Namespace) -> tuple[list[Arm], dict[str, dict], dict[str, list]]:
    """Every run whose settings are known now (stages 2 and 3 appear as the stages before them
    finish), each arm's chosen values and the sweep. Every score is recorded as it comes in, and
    read back: a tuning run scored there is not run again, wherever its folder is."""
    path, recorded = record_path(args), {}
    if path.is_file():
        record = json.loads(path.read_text())
        if record["settings"] == json.loads(json.dumps(settings(args))):
            recorded = {
                run["run"]: run["score"]
                for runs in record["grid"].values()
                for run in runs
                if run["score"] is not None
            }
        else:
            print(f"note: {path} is another sweep's (its settings differ); tuning again")
    chosen: dict[str, dict] = {}
    for _ in range(2):  # phase 1's choice makes the two-phase grids known
        arms = tuning_arms(args, chosen)
        for arm in arms:
            arm.status = DONE if arm.model.is_file() else arm.status
        chosen, grid = choices(arms, recorded)
    if any(run["score"] is not None for runs in grid.values() for run in runs):
        path.write_text(
            json.dumps({"settings": settings(args), "chosen": chosen, "grid": grid}, indent=1) + "\n"
        )
    full = full_arms(args, chosen)
    if full:  # the sweep is over: the phase-1 half it tuned two-phase on is not needed again
        return needed(full, chosen_settings(SETTINGS, args)), chosen, grid
    return [a for a in arms if a.status == DONE or a.name not in recorded], chosen, grid


def print_sweep(args: argparse.Namespace, chosen: dict[str, dict], grid: dict[str, list]) -> None:
    """The sweep's table: every grid point and its score, the chosen ones in bold."""
    print(
        f"\nSweep (seed 0, {args.tune_epochs} epochs, held-out top-1: "
        f"{args.holdout} training images outside the "
        f"subset, mean of the last {WINDOW} epochs; chosen in bold)\n"
    )
    print("| arm | value | held-out top-1 % |\n|---|---|---:|")
    for kind, runs in grid.items():
        for run in runs:
            value = value_text(run)
            best = chosen.get(kind, {}).get("run") == run["run"]
            s = "" if run["score"] is None else f"{run['score']:.2f}"
            print(f"| {kind} | {'**' + value + '**' if best else value} | {'**' + s + '**' if best else s} |")


def report(args: argparse.Namespace, arms: list[Arm], chosen: dict[str, dict], grid: dict[str, list]) -> None:
    by_name = {a.name: a for a in arms}
    macs = {phase: macs_per_image(phase, args) for phase in ("phase1", "phase2")}
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "chosen": chosen,
        "grid": grid,
        "macs_per_train_image": macs,
        "runs": {},
    }
    e, fifth = args.epochs, max(1, args.epochs // 5)
    print_sweep(args, chosen, grid)
    print(
        f"\nFashion-MNIST, {args.train_samples} training images, depth "
        f"{args.depth}; {e} epochs in all; seeds "
        f"{' '.join(map(str, args.seeds))} (mean ± half-range); top-1 of the "
        "final model on the 10k validation "
        f"images; gain: top-1 on the first {args.val_samples} over the last "
        "fifth; MACs: training multiply-adds "
        f"(per image x images seen), both halves for two-phase\n"
    )
    print("| setting | top-1 % | gain, last fifth | CPU s | training MACs |\n|---|---:|---:|---:|---:|")
    points = []
    for setting, _, names in chosen_settings(SETTINGS, args):
        if any(f"seed{s}/{n}" not in by_name for s in args.seeds for n in names):
            continue
        per_seed = [[by_name[f"seed{s}/{n}"] for n in names] for s in args.seeds]
        top1 = []
        for runs in per_seed:
            for run in runs:
                results["runs"][run.name] = {
                    "rows": run.rows(),
                    "final": final_eval(run, args),
                    "cpu_seconds": run.cpu_seconds(),
                    "environments": run.environments(),
                }
            top1.append(results["runs"][runs[-1].name]["final"]["top1"])
        gains = [plateau_gain(ys, fifth) for _, ys in (curve(runs) for runs in per_seed) if len(ys) > fifth]
        seconds = statistics.mean(sum(r.cpu_seconds() for r in runs) for runs in per_seed)
        cost = sum(macs[r.config.phase] * args.train_samples * r.config.recipe.epochs for r in per_seed[0])
        print(f"| {setting} | {stat(top1)} | {stat(gains)} | {seconds:.0f} | {cost:.3g} |")
        points.append((setting, seconds, cost, top1))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot_cost(
        points, args.out / "cost.png", f"Fashion-MNIST, {args.train_samples} images, depth {args.depth}"
    )
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'cost.png'}")


def plot_cost(points: list, path: Path, title: str) -> None:
    """Top-1 (mean, seeds as a bar) against CPU seconds and against training multiply-adds."""
    from convit_convert.train.plot import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    for n, (setting, seconds, cost, top1) in enumerate(points):
        mean, lo, hi = statistics.mean(top1), min(top1), max(top1)
        for ax, x in zip(axes, (seconds, cost), strict=True):
            ax.errorbar(
                [x], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", color=f"C{n}", capsize=3, label=setting
            )
    axes[0].set(xlabel="CPU seconds (training, both halves)", ylabel="top-1 % (10k validation)")
    axes[1].set(xlabel="training multiply-adds", xscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="center left")  # the lower right holds random init at depth 6
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=200, help="total epochs per setting")
    ap.add_argument("--tune-epochs", type=int, default=50, help="epochs of a tuning run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--train-samples", type=int, default=1000)
    ap.add_argument(
        "--holdout", type=int, default=2000, help="training images outside the subset that judge tuning"
    )
    ap.add_argument("--val-samples", type=int, default=2000, help="per-epoch validation images (the curves)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("experiments/out/tuned-d6"))
    ap.add_argument("--data-dir", default=None, help="Folder of the four IDX .gz files (default: Debian's).")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument(
        "--record",
        type=Path,
        default=None,
        help="the sweep's record (default: experiments/results/tuned_comparison_dDEPTH_sweep.json)",
    )
    ap.add_argument("--compile", action="store_true", help="unused; init_comparison's final_eval reads args")
    ap.add_argument(
        "--beyond",
        action="store_true",
        help="only the supplementary check: one tuning run past the grid's top for each arm that chose it",
    )
    ap.add_argument(
        "--sweep-only", action="store_true", help="stop once the sweep is complete: its table only"
    )
    ap.add_argument(
        "--recheck",
        type=int,
        nargs="+",
        default=None,
        metavar="SEED",
        help="only the decisive two-phase points (RECHECK) again on these seeds, each "
        "with its own phase-1 half",
    )
    add_arm_flags(ap)
    args = ap.parse_args()
    if args.beyond:
        return beyond(args)
    if args.recheck:
        return recheck(args)
    deadline = None if args.time_budget is None else time.time() + args.time_budget
    while True:  # each pass runs what is known; a finished stage makes the next one known
        arms, chosen, grid = stages(args)
        if args.sweep_only and not any(a.name.startswith("tune/") for a in arms):
            return print_sweep(args, chosen, grid)  # the sweep is complete: its choices are known
        if deadline is not None:
            args.time_budget = deadline - time.time()
            if args.time_budget < 60:  # too little left to start the next stage's runs
                print("time budget spent; run the same command again to continue")
                raise SystemExit(3)
        try:  # each run's score is recorded as it ends (stages writes the record): a machine
            run_or_exit(arms, args, on_end=lambda _: stages(args))  # lost mid-stage loses no score
        finally:
            arms, chosen, grid = stages(args)
        if all(arm.model.is_file() for arm in arms):
            break
    report(args, [a for a in arms if not a.name.startswith("tune/")], chosen, grid)


if __name__ == "__main__":
    main()
