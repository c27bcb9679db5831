#!/usr/bin/env python3
"""Plots for gradclip's docs, one subcommand per kind of data.

    scripts/plot.py training <log.csv> <out.png>   # loss, clip fraction and loss scale against step
    scripts/plot.py report <report.csv> <out.png>  # per-tensor norm and FP16 underflow, and the loss scale
    scripts/plot.py bench <native.json> <out.md> <out.png> [--default json] [--torch json]
    scripts/plot.py quick <sizes.json> <paired.json> <out.md> <out.png> [--torch json]   # bench.sh --quick

Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import csv
import sys


def machine_name(context):
    """The CPU as lscpu names it (bench/cpu_context.cpp), with the host name beside it."""
    model = context.get("cpu_model")
    host = context.get("host_name", "?")
    return f"{model} (host {host})" if model else host


def load_matplotlib():
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def training(args):
    """The training log of examples/mixed_precision_rnn (columns run, step, loss, loss_scale,
    clip_fraction, nonfinite_steps, ...): loss on a log scale, clip fraction and loss scale, one colour per run."""
    runs = {}
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            runs.setdefault(row["run"], []).append(row)
    if not runs:
        sys.exit(f"{args.csv}: no rows")

    plt = load_matplotlib()
    fig, (loss_ax, clip_ax, scale_ax) = plt.subplots(3, 1, sharex=True, figsize=(7, 7.5))
    for name, rows in runs.items():
        step = [int(r["step"]) for r in rows]
        loss = [float(r["loss"]) for r in rows]
        clip = [float(r["clip_fraction"]) for r in rows]
        scale = [float(r["loss_scale"]) for r in rows]
        (line,) = loss_ax.plot(step, loss, marker="o", markersize=3, label=name)
        clip_ax.plot(step, clip, marker="o", markersize=3, label=f"{name}: clipped")
        scale_ax.plot(step, scale, marker="o", markersize=3, label=name)
        # Steps whose norm was not finite are no clipping decision: skipped steps, or for naive FP16 overflows
        # of its sum of squares, which zero the gradient. Shown dashed when there are any.
        nonfinite = [int(r["nonfinite_steps"]) for r in rows]
        if any(nonfinite):
            interval = [b - a for a, b in zip([0] + step, step)]
            fraction = [n / i for n, i in zip(nonfinite, interval)]
            clip_ax.plot(step, fraction, linestyle="--", color=line.get_color(), label=f"{name}: norm not finite")
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss (mean per interval)")
    loss_ax.legend()
    clip_ax.set_ylabel("fraction of steps")
    clip_ax.legend(fontsize="small")
    clip_ax.set_ylim(-0.05, 1.05)
    save_over_loss_scale(fig, (loss_ax, clip_ax), scale_ax, args)


def save_over_loss_scale(fig, axes, scale_ax, args):
    """Labels the bottom axes as the loss scale per step, grids every panel, and writes args.png."""
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("loss scale S")
    scale_ax.set_xlabel("step")
    for ax in (*axes, scale_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    print(f"wrote {args.png}")


def report(args):
    """Every step's options::report, one row per tensor (examples/loss_scale_underflow --csv: step,
    loss_scale, tensor, size, norm, zeros, subnormals, ...): each tensor's norm and the fraction of its FP16
    elements that were zero or subnormal, one colour per tensor, above the loss scale."""
    tensors, scale = {}, {}
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            tensors.setdefault(row["tensor"], []).append(
                (step, float(row["norm"]), (int(row["zeros"]) + int(row["subnormals"])) / int(row["size"])))
            scale[step] = float(row["loss_scale"])
    if not tensors:
        sys.exit(f"{args.csv}: no rows")

    plt = load_matplotlib()
    fig, (norm_ax, underflow_ax, scale_ax) = plt.subplots(
        3, 1, sharex=True, figsize=(7, 7.5), gridspec_kw={"height_ratios": [3, 3, 2]})
    for name, rows in tensors.items():
        step, norm, underflow = zip(*rows)
        (line,) = norm_ax.plot(step, norm, linewidth=1, label=name)
        underflow_ax.plot(step, [100 * u for u in underflow], linewidth=1, color=line.get_color(), label=name)
    steps = sorted(scale)
    scale_ax.step(steps, [scale[s] for s in steps], where="post", color="black")
    norm_ax.set_yscale("log")
    norm_ax.set_ylabel("norm of the unscaled gradient")
    norm_ax.legend(ncol=3, fontsize="small")
    underflow_ax.set_ylabel("zero or subnormal in FP16 (%)")
    underflow_ax.set_ylim(-3, 103)
    underflow_ax.legend(ncol=3, fontsize="small")
    save_over_loss_scale(fig, (norm_ax, underflow_ax), scale_ax, args)


# Keys of a Google Benchmark JSON entry that are not user counters.
NOT_COUNTERS = {"name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
                "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit",
                "bytes_per_second", "items_per_second", "aggregate_name", "aggregate_unit", "label",
                "error_occurred", "error_message"}


def load_runs(path):
    """{name: median entry} from Google Benchmark's JSON, run with --benchmark_repetitions and
    --benchmark_report_aggregates_only (single runs are used when alone), and the run's context."""
    import json

    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        # Drop the suffixes Google Benchmark appends (min_time:..., real_time, repeats:...).
        parts = b.get("run_name", b["name"]).split("/")
        name = "/".join(x for x in parts if not x.startswith(("min_time:", "real_time", "repeats:", "threads:")))
        if b.get("run_type") == "aggregate" or name not in out:
            out[name] = b
    return out, data.get("context", {})


def load_benchmarks(path):
    """{name: (median real time in seconds, bytes per second)} and the context; see load_runs."""
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    runs, context = load_runs(path)
    return {name: (b["real_time"] * scale[b["time_unit"]], b.get("bytes_per_second", 0.0))
            for name, b in runs.items()}, context


def load_counters(path, prefix):
    """{name: {counter: median}} of the cases whose name starts with prefix (the paired cases)."""
    runs, _ = load_runs(path)
    return {name: {k: v for k, v in b.items() if k not in NOT_COUNTERS}
            for name, b in runs.items() if name.startswith(prefix)}


BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def case_time(runs, op, policy, dtype, n):
    """The median time of case op/policy/dtype/n (seconds), None when it was not run."""
    return runs.get(f"{op}/{policy}/{dtype}/{n}", (None, None))[0]


def gbs(runs, op, policy, dtype, n):
    time = case_time(runs, op, policy, dtype, n)
    return BYTES[dtype] * n / time / 1e9 if time else None


def fastest(runs, op, dtype, n):
    """The faster of the 256- and 512-bit baselines (read, rewrite, group_read)."""
    times = [x for x in (case_time(runs, op, w, dtype, n) for w in ("256", "512")) if x]
    return min(times) if times else None


def roofline(runs, op, dtype, n, group=False):
    """The read (norm, clip that does not bind) or read + rewrite (clip that binds) roofline time."""
    read = fastest(runs, "group_read" if group else "read", dtype, n)
    if op.endswith("clip_binds"):
        rewrite = fastest(runs, "group_rewrite" if group else "rewrite", dtype, n)
        return read + rewrite if read and rewrite else None
    return read


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def figure(x):  # three digits below 10, so that a value shown as the target is not taken for it
    return fmt(x, 3 if x is not None and x < 10 else 2)


def ratio(a, b):
    return a / b if a and b else None


def counter(table, name, key):
    return table.get(name, {}).get(key)


def sizes_of(runs):
    """The sizes of the single-buffer cases (op/policy/dtype/elements)."""
    return sorted({int(n.split("/")[3]) for n in runs if n.count("/") == 3 and not n.startswith(("group", "paired"))})


def bench(args):
    """Ratio tables (markdown) and a throughput plot from bench_clip's JSON (op/policy/dtype/elements),
    optionally a default-flags run of the same binary and bench_torch's JSON."""
    native, context = load_benchmarks(args.native)
    default = load_benchmarks(args.default)[0] if args.default else {}
    torch = load_benchmarks(args.torch)[0] if args.torch else {}
    paired = load_counters(args.native, "paired/")
    torch_paired = load_counters(args.torch, "paired<") if args.torch else {}
    dtypes = ["f16", "bf16", "f32", "f64"]
    policies = ["robust", "max_scale", "promote", "naive"]
    sizes = sizes_of(native)
    big = [n for n in sizes if n >= 16 << 20]

    lines = [f"# gradclip benchmarks", ""]
    lines.append(
        f"Machine: {machine_name(context)}, {context.get('num_cpus', '?')} CPUs at "
        f"{context.get('mhz_per_cpu', '?')} MHz; kernels: {context.get('gradclip_isa', '?')} "
        f"({context.get('gradclip_build', '?')}); one thread; medians of the repetitions; "
        f"roofline = the faster of a 256-bit and a 512-bit plain vectorized read (norm, clip that does not bind), "
        f"or that plus the faster in-place rewrite (clip that binds), of the same bytes, measured in the same run "
        f"with the cases in random order. `x roofline` is roofline time / case time."
    )
    lines.append("")
    lines.append("## Every policy, out-of-cache sizes")
    lines.append("")
    header = "| dtype | elements | op | policy | GB/s | x roofline | x naive Eigen |"
    sep = "|---|---|---|---|---|---|---|"
    if default:
        header += " default flags / -march=native |"
        sep += "---|"
    lines += [header, sep]
    for dtype in dtypes:
        for n in big:
            for op in ["norm", "clip_binds", "clip_nobind"]:
                for policy in policies:
                    time = case_time(native, op, policy, dtype, n)
                    if time is None:
                        continue
                    eigen = case_time(native, "eigen_naive_clip" if op == "clip_binds" else "eigen_naive_norm", "-", dtype, n)
                    row = (
                        f"| {dtype} | {n >> 20} Mi | {op} | {policy} | {fmt(gbs(native, op, policy, dtype, n), 1)} | "
                        f"{fmt(ratio(roofline(native, op, dtype, n), time))} | {fmt(ratio(eigen, time), 1)} |"
                    )
                    if default:
                        row += f" {fmt(ratio(time, case_time(default, op, policy, dtype, n)))} |"
                    lines.append(row)
    lines.append("")

    lines.append("## Baselines (GB/s of gradient bytes)")
    lines.append("")
    base_ops = [("read", "256"), ("read", "512"), ("rewrite", "256"), ("rewrite", "512"), ("read_2threads", "-"),
                ("eigen_norm", "-"), ("eigen_stable_norm", "-"), ("eigen_blue_norm", "-"), ("eigen_half_norm", "-"),
                ("eigen_naive_norm", "-"), ("eigen_naive_clip", "-")]
    lines.append("| dtype | elements | " + " | ".join(op if w == "-" else f"{op} {w}-bit" for op, w in base_ops) + " |")
    lines.append("|---|---|" + "---|" * len(base_ops))
    for dtype in dtypes:
        for n in sizes:
            lines.append(f"| {dtype} | {n} | " + " | ".join(fmt(gbs(native, op, w, dtype, n), 1) for op, w in base_ops) + " |")
    lines.append("")

    lines.append(f"## Groups: 256 tensors of 16 Ki elements")
    lines.append("")
    lines.append("| dtype | op | policy | GB/s | x roofline |")
    lines.append("|---|---|---|---|---|")
    group_n = 256 * 16 * 1024
    for dtype in dtypes:
        for op in ["group_norm", "group_clip_binds"]:
            for policy in policies:
                time = case_time(native, op, policy, dtype, group_n)
                if time:
                    lines.append(
                        f"| {dtype} | {op} | {policy} | {fmt(gbs(native, op, policy, dtype, group_n), 1)} | "
                        f"{fmt(ratio(roofline(native, op, dtype, group_n, group=True), time))} |"
                    )
    lines.append("")

    lines.append("## Two threads (`options::threads = 2`, robust)")
    lines.append("")
    lines.append("| dtype | elements | norm GB/s, 1 thread | 2 threads | speedup | read GB/s, 2 threads | clip that binds, speedup |")
    lines.append("|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for n in big:
            one, two = case_time(native, "norm", "robust", dtype, n), case_time(native, "norm_2threads", "robust", dtype, n)
            clip_one = case_time(native, "clip_binds", "robust", dtype, n)
            clip_two = case_time(native, "clip_binds_2threads", "robust", dtype, n)
            if two:
                lines.append(
                    f"| {dtype} | {n >> 20} Mi | {fmt(gbs(native, 'norm', 'robust', dtype, n), 1)} | "
                    f"{fmt(gbs(native, 'norm_2threads', 'robust', dtype, n), 1)} | {fmt(ratio(one, two))} | "
                    f"{fmt(gbs(native, 'read_2threads', '-', dtype, n), 1)} | {fmt(ratio(clip_one, clip_two))} |"
                )
    lines.append("")

    if paired:
        lines.append("## Paired: ratios measured inside one loop")
        lines.append("")
        lines.append(
            "Each iteration times the roofline (reads and, for a clip that binds, rewrites of both widths) and the "
            "three policies on the same buffers, in rotating order, so this machine's drift reaches every part alike; "
            "a ratio is of the parts' total times, its median over the repetitions. Groups are 256 tensors of 16 Ki "
            "elements (in cache: the last-level cache holds them), with group reads and rewrites as the roofline."
        )
        lines.append("")
        lines.append("| op | dtype | elements | robust x roofline | max_scale x roofline | promote x roofline | "
                     "robust / promote time | max_scale / promote time |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, c in sorted(paired.items(), key=lambda kv: (dtypes.index(kv[0].split("/")[2]), kv[0].split("/")[1],
                                                               int(kv[0].split("/")[3]))):
            _, op, dtype, elements = name.split("/")
            size = f"{int(elements) >> 20} Mi" if int(elements) >= 1 << 20 else elements
            lines.append(
                f"| {op} | {dtype} | {size} | {fmt(c.get('robust_x_roofline'))} | {fmt(c.get('max_scale_x_roofline'))} | "
                f"{fmt(c.get('promote_x_roofline'))} | {fmt(c.get('robust_per_promote'))} | "
                f"{fmt(c.get('max_scale_per_promote'))} |"
            )
        lines.append("")

    # The figures, from the largest size: paired where a paired case measures them, else from the
    # separate cases; `met` judges the paired value when there is one.
    n = max(big) if big else max(sizes)
    checks = []
    for dtype in ["f16", "bf16", "f32"]:
        checks.append((f"robust norm {dtype} x read roofline", counter(paired, f"paired/norm/{dtype}/{n}", "robust_x_roofline"),
                       ratio(roofline(native, "norm", dtype, n), case_time(native, "norm", "robust", dtype, n)), ">=", 0.9))
        checks.append((f"robust clip that binds {dtype} x (read + rewrite) roofline",
                       counter(paired, f"paired/clip_binds/{dtype}/{n}", "robust_x_roofline"),
                       ratio(roofline(native, "clip_binds", dtype, n), case_time(native, "clip_binds", "robust", dtype, n)), ">=", 0.85))
    for dtype in dtypes:
        promote = case_time(native, "norm", "promote", dtype, n)
        checks.append((f"max_scale / promote time, norm {dtype}", counter(paired, f"paired/norm/{dtype}/{n}", "max_scale_per_promote"),
                       ratio(case_time(native, "norm", "max_scale", dtype, n), promote), "<=", 1.15))
        checks.append((f"robust / promote time, norm {dtype}", counter(paired, f"paired/norm/{dtype}/{n}", "robust_per_promote"),
                       ratio(case_time(native, "norm", "robust", dtype, n), promote), "<=", 1.1))
    checks.append(("FP16 clip that binds: naive Eigen time / robust time", None,
                   ratio(case_time(native, "eigen_naive_clip", "-", "f16", n), case_time(native, "clip_binds", "robust", "f16", n)), ">=", 20))
    if default:
        for op in ["norm", "clip_binds"]:
            checks.append((f"FP16 robust {op}: default-flags speed / -march=native speed", None,
                           ratio(case_time(native, op, "robust", "f16", n), case_time(default, op, "robust", "f16", n)), ">=", 0.7))
    if torch:
        for tensors, elements, mine in [(1, 64 << 20, "clip_binds"), (256, 16 << 10, "group_clip_binds")]:
            key = f"libtorch_clip_grad_norm_<float32>/tensors:{tensors}/elements:{elements}"
            ours = case_time(native, mine, "robust", "f32", tensors * elements)
            if key in torch and ours:
                checks.append((f"FP32 clip, {tensors} x {elements}: libtorch clip_grad_norm_ time / gradclip",
                               counter(torch_paired, f"paired<float32>/tensors:{tensors}/elements:{elements}", "libtorch_per_gradclip"),
                               torch[key][0] / ours, ">=", 1.3 if tensors == 1 else 3))
        key = f"libtorch_cast_float<float16>/tensors:1/elements:{64 << 20}"
        ours = case_time(native, "clip_binds", "robust", "f16", 64 << 20)
        if key in torch and ours:
            checks.append(("FP16 clip: libtorch cast-to-float time / gradclip",
                           counter(torch_paired, f"paired<float16>/tensors:1/elements:{64 << 20}", "libtorch_per_gradclip"),
                           torch[key][0] / ours, ">=", 20))
    lines.append(f"## The issue's figures ({n >> 20} Mi elements)")
    lines.append("")
    lines.append("| figure | paired | separate cases | target | met |")
    lines.append("|---|---|---|---|---|")
    for label, pair, value, op, target in checks:
        judged = pair if pair is not None else value
        met = judged is not None and (judged >= target if op == ">=" else judged <= target)
        lines.append(f"| {label} | {figure(pair)} | {figure(value)} | {op} {target} | {'yes' if met else 'no'} |")
    lines.append("")

    if torch:
        lines.append("## libtorch (bench_torch, same machine, one thread)")
        lines.append("")
        lines.append("| case | ms | GB/s |")
        lines.append("|---|---|---|")
        for name, (time, bps) in sorted(torch.items()):
            if not name.startswith("paired<"):
                lines.append(f"| `{name}` | {time * 1e3:.2f} | {bps / 1e9:.1f} |")
        lines.append("")

    with open(args.markdown, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.markdown}")

    throughput_plot(native, context, args.png)


def throughput_plot(runs, context, png):
    """GB/s against size, one panel per element type: the rooflines, the policies' norms, the robust clip
    and Eigen's norms, from whichever of those cases were run."""
    sizes = sizes_of(runs)
    plt = load_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    series = [
        ("norm", "robust", "robust norm", "-"),
        ("norm", "max_scale", "max_scale norm", "-"),
        ("norm", "promote", "promote norm", "-"),
        ("clip_binds", "robust", "robust clip (binds)", "-"),
        ("eigen_naive_norm", "-", "naive Eigen norm", ":"),
        ("eigen_norm", "-", "Eigen norm()", ":"),
        ("eigen_stable_norm", "-", "Eigen stableNorm()", ":"),
    ]
    for ax, dtype in zip(axes.flat, ["f16", "bf16", "f32", "f64"]):
        size_bytes = [BYTES[dtype] * n for n in sizes]
        roof = [b / roofline(runs, "norm", dtype, n) / 1e9 if roofline(runs, "norm", dtype, n) else None
                for n, b in zip(sizes, size_bytes)]
        ax.plot(sizes, roof, color="black", linewidth=2.5, label="roofline: plain read")
        both = [b / roofline(runs, "clip_binds", dtype, n) / 1e9 if roofline(runs, "clip_binds", dtype, n) else None
                for n, b in zip(sizes, size_bytes)]
        ax.plot(sizes, both, color="gray", linewidth=2.5, linestyle="--", label="roofline: read + rewrite")
        for op, policy, label, style in series:
            values = [gbs(runs, op, policy, dtype, n) for n in sizes]
            if any(values):
                ax.plot(sizes, values, marker="o", markersize=3, linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(dtype)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s of gradient")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(f"gradclip throughput vs size ({context.get('gradclip_isa', '?')} kernels, one thread)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def quick(args):
    """The headline figures of scripts/bench.sh --quick (markdown, also printed) and the throughput plot:
    the paired ratios at the largest size, naive Eigen and libtorch against gradclip."""
    sized, context = load_benchmarks(args.sizes)
    paired = load_counters(args.paired, "paired/")
    torch_paired = load_counters(args.torch, "paired<") if args.torch else {}
    dtypes = ["f16", "bf16", "f32", "f64"]
    n = max(int(name.split("/")[3]) for name in paired)

    def paired_row(label, op, key, target):
        return label, [counter(paired, f"paired/{op}/{d}/{n}", key) for d in dtypes], target

    def torch_row(label, tensors, elements, target):  # bench_torch's layouts
        return label, [counter(torch_paired, f"paired<{t}>/tensors:{tensors}/elements:{elements}", "libtorch_per_gradclip")
                       if t else None for t in ("float16", None, "float32", None)], target

    rows = [
        paired_row("robust norm, × plain-read roofline", "norm", "robust_x_roofline", "≥ 0.9"),
        paired_row("max_scale norm, × plain-read roofline", "norm", "max_scale_x_roofline", "–"),
        paired_row("promote norm (the plainest kernel), × plain-read roofline", "norm", "promote_x_roofline", "–"),
        paired_row("robust clip that binds, × (read + rewrite) roofline", "clip_binds", "robust_x_roofline", "≥ 0.85"),
        paired_row("max_scale time / promote time (norm)", "norm", "max_scale_per_promote", "≤ 1.15"),
        paired_row("robust time / promote time (norm)", "norm", "robust_per_promote", "≤ 1.1"),
        ("robust clip that binds, × faster than naive Eigen (separate cases)",
         [ratio(case_time(sized, "eigen_naive_clip", "-", d, n), case_time(sized, "clip_binds", "robust", d, n))
          for d in dtypes], "FP16 ≥ 20"),
    ]
    if torch_paired:
        rows.append(torch_row("libtorch time / gradclip, clip that binds (FP16: libtorch's cast-to-float code)", 1,
                              64 << 20, "FP16 ≥ 20, FP32 ≥ 1.3"))
        rows.append(torch_row("the same on 256 tensors of 16 Ki", 256, 16 << 10, "FP32 ≥ 3"))

    lines = [
        f"Machine: {machine_name(context)}, {context.get('num_cpus', '?')} CPUs at "
        f"{context.get('mhz_per_cpu', '?')} MHz; kernels: {context.get('gradclip_isa', '?')} "
        f"({context.get('gradclip_build', '?')}); one thread; paired ratios are medians of "
        f"{args.repetitions} repetitions, the other cases single runs.",
        "",
        f"| figure ({n >> 20} Mi elements, paired) | FP16 | BF16 | FP32 | FP64 | target |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {label} | " + " | ".join(figure(v) for v in values) + f" | {target} |" for label, values, target in rows]
    if not torch_paired:
        lines += ["", "libtorch rows: bench_torch was not built (libtorch not found)."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.markdown, "w") as f:
        f.write(text)
    print(f"wrote {args.markdown}")
    throughput_plot(sized, context, args.png)


def sizes(args):
    """Speed at every size (issue 16): the paired figures of bench_clip at 128 Ki (in cache) and 64 Mi,
    bench_sizes (small tensors, GPT-2 small, threads) and bench_torch on GPT-2 small, each beside its
    target (markdown), and a chart of the ratios against their targets."""
    inside = load_counters(args.in_cache, "paired/")
    outside = load_counters(args.out_of_cache, "paired/")
    sized = load_counters(args.sizes, "sizes/")
    torch_paired = load_counters(args.torch, "paired<") if args.torch else {}
    _, context = load_runs(args.in_cache)
    names = {"f16": "FP16", "bf16": "BF16", "f32": "FP32", "f64": "FP64"}

    def of(table, case, key):
        return table.get(case, {}).get(key)

    rows = []  # (figure, value, comparison, target, note)
    for what, key in (("norm", "norm_per_loop"), ("binding clip", "clip_per_loop")):
        ns = of(sized, "sizes/tensors/float32/2000x4", "norm_ns_per_tensor" if what == "norm" else "clip_ns_per_tensor")
        rows.append((f"2000 × 4 FP32, {what}: time / a scalar double loop's", of(sized, "sizes/tensors/float32/2000x4", key),
                     "<=", 3, f"{fmt(ns, 1)} ns per tensor"))
        ns = of(sized, "sizes/tensors/float32/1000x1024", "norm_ns_per_tensor" if what == "norm" else "clip_ns_per_tensor")
        rows.append((f"1000 × 1 Ki FP32, {what}: time / the loop's", of(sized, "sizes/tensors/float32/1000x1024", key),
                     None, None, f"{fmt(ns, 1)} ns per tensor"))
    for d in ("f16", "bf16", "f32", "f64"):
        rows.append((f"in cache (128 Ki), robust norm {names[d]} × plain read",
                     of(inside, f"paired/norm/{d}/131072", "robust_x_roofline"), ">=", 0.7 if d == "f64" else 0.5, ""))
    for d in ("f16", "bf16", "f32", "f64"):
        rows.append((f"in cache (128 Ki), robust binding clip {names[d]} × (read + rewrite)",
                     of(inside, f"paired/clip_binds/{d}/131072", "robust_x_roofline"), ">=", 0.4, ""))
    for d in ("f16", "bf16", "f32", "f64"):
        rows.append((f"out of cache (64 Mi), robust norm {names[d]} × plain read",
                     of(outside, f"paired/norm/{d}/67108864", "robust_x_roofline"), ">=",
                     0.93 if d in ("f16", "bf16") else 0.9, ""))
    for t in ("float16", "float32"):
        rows.append((f"2 threads' gain / 2 plain reads' gain, 64 Mi {t}", of(sized, f"sizes/threads/{t}", "gain_2_per_read_gain"),
                     ">=", 0.85, f"norm gain {fmt(of(sized, f'sizes/threads/{t}', 'norm_gain_2'))}, "
                                 f"read gain {fmt(of(sized, f'sizes/threads/{t}', 'read_gain_2'))}"))
    for t in ("float32", "bfloat16"):
        rows.append((f"GPT-2 small (148 tensors, 124 M), {t} norm × plain read", of(sized, f"sizes/gpt2_small/{t}", "norm_x_read"),
                     None, None, ""))
        if torch_paired:
            rows.append((f"GPT-2 small, {t}: libtorch clip_grad_norm_ time / gradclip's (clip that binds)",
                         of(torch_paired, f"paired<{t}>/gpt2_small", "libtorch_per_gradclip"), None, None, ""))

    def met(value, comparison, target):
        if comparison is None or value is None:
            return "–"
        return "yes" if (value <= target if comparison == "<=" else value >= target) else "**no**"

    lines = [
        "## Speed at every size (issue 16)",
        "",
        f"`scripts/bench.sh --sizes`: machine {machine_name(context)}, {context.get('num_cpus', '?')} CPUs at "
        f"{context.get('mhz_per_cpu', '?')} MHz, kernels {context.get('gradclip_isa', '?')}; every figure a paired "
        "ratio (the parts timed in one loop, in rotating order), median of the repetitions.",
        "",
        "| figure | measured | target | met | |",
        "|---|---|---|---|---|",
    ]
    for label, value, comparison, target, note in rows:
        shown = "–" if comparison is None else ("≤ " if comparison == "<=" else "≥ ") + f"{target:g}"
        lines.append(f"| {label} | {figure(value)} | {shown} | {met(value, comparison, target)} | {note} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.markdown, "w") as f:
        f.write(text)
    print(f"wrote {args.markdown}")

    plt = load_matplotlib()
    judged = [(label, value / target if comparison == ">=" else target / value)
              for label, value, comparison, target, _ in rows if comparison and value]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(judged) + 1.2))
    ax.barh(range(len(judged)), [v for _, v in judged],
            color=["tab:green" if v >= 1 else "tab:red" for _, v in judged])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(judged)), [label for label, _ in judged], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / target (≥ 1: met)")
    ax.set_title("gradclip at every size: each paired figure against its target")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("training", help="loss, clip fraction and loss scale of a training log")
    p.add_argument("csv", help="CSV written by examples/mixed_precision_rnn")
    p.add_argument("png", help="output image")
    p.add_argument("--title", default="Mixed-precision Elman RNN: FP16 gradients, dynamic loss scaling, clipping")
    p.set_defaults(run=training)

    p = commands.add_parser("report", help="per-tensor norm and FP16 underflow of options::report over steps")
    p.add_argument("csv", help="CSV written by examples/loss_scale_underflow --csv")
    p.add_argument("png", help="output image")
    p.add_argument("--title", default="Per-tensor report with a loss scale that starts at 1: FP16 gradients")
    p.set_defaults(run=report)

    p = commands.add_parser("bench", help="ratio tables and throughput plot of bench_clip")
    p.add_argument("native", help="bench_clip JSON of the -march=native build")
    p.add_argument("markdown", help="output table (markdown)")
    p.add_argument("png", help="output plot")
    p.add_argument("--default", help="bench_clip JSON of the default-flags build")
    p.add_argument("--torch", help="bench_torch JSON")
    p.set_defaults(run=bench)

    p = commands.add_parser("quick", help="headline table and throughput plot of scripts/bench.sh --quick")
    p.add_argument("sizes", help="bench_clip JSON of the cases at every size (single runs)")
    p.add_argument("paired", help="bench_clip JSON of the paired cases")
    p.add_argument("markdown", help="output table (markdown)")
    p.add_argument("png", help="output plot")
    p.add_argument("--torch", help="bench_torch JSON of its paired cases")
    p.add_argument("--repetitions", type=int, default=3, help="repetitions of the paired cases")
    p.set_defaults(run=quick)

    p = commands.add_parser("sizes", help="speed at every size (scripts/bench.sh --sizes)")
    p.add_argument("in_cache", help="bench_clip JSON of the paired cases at 128 Ki elements")
    p.add_argument("out_of_cache", help="bench_clip JSON of the paired norms at 64 Mi elements")
    p.add_argument("sizes", help="bench_sizes JSON")
    p.add_argument("markdown", help="output section (markdown)")
    p.add_argument("png", help="output chart")
    p.add_argument("--torch", help="bench_torch JSON of its GPT-2 small paired cases")
    p.set_defaults(run=sizes)

    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
