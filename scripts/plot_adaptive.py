#!/usr/bin/env python3
"""Plots the per-step CSV of examples/adaptive_clipping (columns method, step, loss, norm, threshold,
clipped, skipped) into docs/adaptive/:

    scripts/plot_adaptive.py <log.csv> [out_dir]   # loss.png and thresholds.png

loss.png: the population loss of every method against the step, on a log scale. thresholds.png: the
gradient norm of the zclip run with the thresholds zclip and autoclip applied, and the steps that
spike_skip skipped. Needs matplotlib (Debian: python3-matplotlib).
"""
import csv
import math
import os
import sys


def load(path):
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            run = runs.setdefault(row["method"], {"step": [], "loss": [], "norm": [], "threshold": [], "skipped": []})
            run["step"].append(int(row["step"]))
            run["loss"].append(float(row["loss"]))
            run["norm"].append(float(row["norm"]))
            run["threshold"].append(float(row["threshold"]))
            run["skipped"].append(row["skipped"] == "1")
    if not runs:
        sys.exit(f"{path}: no rows")
    return runs


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    runs = load(sys.argv[1])
    out_dir = sys.argv[2] if len(sys.argv) == 3 else "docs/adaptive"
    os.makedirs(out_dir, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for method, run in runs.items():
        adaptive = not method.startswith("fixed")
        ax.plot(run["step"], run["loss"], label=method, linewidth=1.8 if adaptive else 0.9,
                linestyle="-" if adaptive else "--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("population loss")
    ax.set_title("Linear regression, FP16 gradients, 2 % corrupted batches from step 200")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(9, 5))
    base = runs["zclip"]
    ax.plot(base["step"], base["norm"], color="0.6", linewidth=0.7, label="norm (zclip run)")
    # autoclip has a threshold at every step; zclip (uncapped) only at the outliers it clips.
    auto = runs["autoclip"]
    ax.plot(auto["step"], [t if math.isfinite(t) else float("nan") for t in auto["threshold"]], color="tab:orange",
            linewidth=1.2, label="autoclip threshold")
    clipped = [(s, t) for s, t in zip(base["step"], base["threshold"]) if math.isfinite(t)]
    ax.scatter([s for s, _ in clipped], [t for _, t in clipped], marker="o", s=14, color="tab:blue",
               label="zclip threshold (outliers)", zorder=3)
    skip = runs.get("spike_skip")
    if skip:
        steps = [s for s, k in zip(skip["step"], skip["skipped"]) if k]
        norms = [n for n, k in zip(skip["norm"], skip["skipped"]) if k]
        ax.scatter(steps, norms, marker="x", color="tab:red", label="spike_skip: skipped", zorder=3)
    ax.axhline(65504, color="k", linestyle=":", linewidth=0.8, label="FP16 max (65504)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_title("Norms and the thresholds the controllers set")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "thresholds.png"), dpi=110)


if __name__ == "__main__":
    main()
