"""What the benchmark prints and draws: the table, headed by what the steps ran on, and the chart (bench.png)."""

from pathlib import Path


def heading(results: dict) -> str:
    """What the steps ran on, at the head of the table and the chart: a GPU figure is never read as a CPU one."""
    return f"{results['accelerator']}: {results['device']}, {results['cores']} CPU cores, torch {results['torch']}"


def spread(r: dict, digits: int = 2) -> str:
    """A ratio as the median of the rounds' ratios, with the lowest and highest round."""
    return f"{r['median']:.3f} ({r['low']:.{digits}f}-{r['high']:.{digits}f})"


def per_row(label: str, rows: list[dict], key: str) -> str:
    """One ratio of every row that has it, with its spread to a tenth of a percent, as the goals of 1% and 3% need:
    ``label: toy 1p 1.012 (0.994-1.031), ...``."""
    return f"{label}: " + ", ".join(f"{r['workload']} {r['processes']}p {spread(r[key], 3)}" for r in rows if key in r)


def table(results: dict) -> str:
    logging, startup, rows = results["logging"], results["startup"], results["steps"]
    logged = f"{logging['processes']} process{'es' if logging['processes'] > 1 else ''}"
    if "cli_help_s" in startup:
        started = (
            f"start-up: cli.py --help {startup['cli_help_s']:.2f} s, import lightning "
            f"{startup['import_lightning_s']:.2f} s ({startup['ratio']:.2f}x); "
        )
    else:  # the short mode leaves the comparison of commands to the CPU benchmark
        started = "start-up: "
    lines = [
        heading(results),
        "step time, median ms     template Lightning    raw   template/raw (rounds)  Lightning/raw  "
        "template/Lightning  max |weight diff|",
        *(
            f"{r['workload']:>8}, {r['processes']} process(es) {r['template_step_ms']:8.2f} "
            f"{r['lightning_step_ms']:8.2f} {r['raw_step_ms']:7.2f}   {spread(r['ratio']):21}  "
            f"{r['lightning_over_raw']['median']:13.3f}  "
            f"{r['template_over_lightning']['median']:18.3f}  {r['max_weight_difference']:.1e}"
            for r in rows
        ),
        results["clock"],
        "",
        "ratios, median of the rounds (lowest-highest round):",
        per_row("  template/Lightning", rows, "template_over_lightning"),
        *(
            [per_row("  template/Lightning, both without logger and progress bar", rows, "quiet_over_lightning")]
            if any("quiet_over_lightning" in r for r in rows)
            else []
        ),
        per_row("  Lightning/raw", rows, "lightning_over_raw"),
        f"data path, us/batch of 128: per-sample collate {results['data_path']['per_sample_us']:.0f}, "
        f"whole-batch index {results['data_path']['whole_batch_us']:.0f} ({results['data_path']['speedup']:.1f}x)",
        "step-time measurement (training.StepTime), cost per row: "
        + ", ".join(
            f"{r['workload']} {r['processes']}p {100 * r['step_time_cost']['median']:+.1f}% "
            f"({100 * r['step_time_cost']['low']:+.1f}% to {100 * r['step_time_cost']['high']:+.1f}%)"
            for r in rows
        ),
        f"logging (toy, {logged}): default {logging['default_step_ms']:.2f} ms/step, no logger and no progress "
        f"bar {logging['quiet_step_ms']:.2f} ms/step, cost {100 * logging['cost']['median']:+.1f}% "
        f"(rounds {100 * logging['cost']['low']:+.1f}% to {100 * logging['cost']['high']:+.1f}%)",
        f"{started}first training step of a {logging['processes']}-process job {startup['first_step_s']:.1f} s "
        "after launch",
        "runs, seconds from launch to exit (median of the rounds): "
        + "; ".join(
            f"{r['workload']} {r['processes']}p " + ", ".join(f"{side} {s:.1f}" for side, s in r["run_s"].items())
            for r in rows
        ),
    ]
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["steps"]
    labels = [f"{r['workload']}\n{r['processes']} proc" for r in rows]
    positions = range(len(rows))
    figure, axes = plt.subplots(figsize=(7, 4))
    for offset, (side, label) in zip(
        (-0.27, 0, 0.27),
        (("template", "template"), ("lightning", "Lightning alone"), ("raw", "raw DDP loop")),
        strict=True,
    ):
        axes.bar([p + offset for p in positions], [r[f"{side}_step_ms"] for r in rows], 0.27, label=label)
    for position, row in zip(positions, rows, strict=True):
        axes.annotate(
            f"{row['ratio']['median']:.2f}x",
            (position, max(row["template_step_ms"], row["lightning_step_ms"], row["raw_step_ms"])),
            ha="center",
            va="bottom",
        )
    axes.set_xticks(list(positions), labels)
    axes.set_ylabel("median step time (ms)")
    axes.set_title(f"step time, {heading(results)}\nlabels: template / raw", fontsize="medium")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
