#!/usr/bin/env python3
"""Plots the per-step CSV of examples/update_clipping (columns method, seed, step, loss, v_mean,
update_norm, grad_norm, clipped) into one figure:

    scripts/plot_update_clipping.py <log.csv> [out.png]   # default docs/update_clipping/feedback.png

Three panels over the steps of seed 1, the high-gradient phase shaded: the test loss; the mean
second-moment estimate v^ (log scale); the norm of the parameter step after clipping (log scale,
a 20-step moving average). Needs matplotlib (Debian: python3-matplotlib).
"""
import csv
import os
import sys

PHASE = (1000, 1500)  # examples/update_clipping.cpp's phase_begin, phase_end
STYLE = {
    "adam": ("black", "-"),
    "grad_clip": ("tab:red", "-"),
    "update_rms": ("tab:blue", "--"),
    "update_norm": ("tab:cyan", ":"),
    "stable_adamw": ("tab:green", "--"),
    "adagc": ("tab:orange", "-"),
}


def load(path, seed="1"):
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["seed"] != seed:
                continue
            run = runs.setdefault(row["method"], {"step": [], "v": [], "update": [], "loss_step": [], "loss": []})
            step = int(row["step"])
            run["step"].append(step)
            run["v"].append(float(row["v_mean"]))
            run["update"].append(float(row["update_norm"]))
            if row["loss"]:
                run["loss_step"].append(step)
                run["loss"].append(float(row["loss"]))
    if not runs:
        sys.exit(f"{path}: no rows for seed {seed}")
    return runs


def moving_average(values, width=20):
    out, total = [], 0.0
    for i, x in enumerate(values):
        total += x
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    runs = load(sys.argv[1])
    out = sys.argv[2] if len(sys.argv) == 3 else "docs/update_clipping/feedback.png"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for method, run in runs.items():
        color, line = STYLE.get(method, (None, "-"))
        kw = {"label": method, "color": color, "linestyle": line, "linewidth": 1.2}
        axes[0].plot(run["loss_step"], run["loss"], **kw)
        axes[1].plot(run["step"], run["v"], **kw)
        axes[2].plot(run["step"], moving_average(run["update"]), **kw)
    for ax in axes:
        ax.axvspan(*PHASE, color="0.9", zorder=0)
    axes[0].set_ylabel("test loss")
    axes[0].set_yscale("log")
    axes[0].set_title("MLP with Adam: label noise x100 in steps 1000-1499 (shaded), seed 1")
    axes[1].set_ylabel("mean second moment v^")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("parameter step norm (20-step mean)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step")
    axes[0].legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
