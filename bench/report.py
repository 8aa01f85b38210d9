"""Write a run's results: results.json (everything), summary.md (ratios vs AR first), plots.png."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from .config import MODES

PLOTS_FILE = "plots.png"


def write_report(results: dict, out_dir: str | pathlib.Path, plots: bool = True) -> list[pathlib.Path]:
    """Write the three files (the plots only when `plots`: a checkpoint mid-run skips them)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "summary.md"]
    paths[0].write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    paths[1].write_text(summary_markdown(results))
    if plots:
        paths.append(out / PLOTS_FILE)
        plot(results["records"], paths[2])
    return paths


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _repeat_range(ratios: list[float | None]) -> str:
    """ " (lowest-highest)" of the ratios repeat by repeat, where there were several and each has one."""
    if len(ratios) < 2 or any(ratio is None for ratio in ratios):
        return ""
    known = [ratio for ratio in ratios if ratio is not None]
    return f" ({min(known):.2f}-{max(known):.2f})"


def _held(record: dict) -> str:
    """Steps held for rounds due back from edges: their share, the mean hold, and the awaited rounds missed."""
    share = record.get("held_steps_fraction")  # absent from records written before holds were scraped
    if share is None:
        return "-"
    if not share:
        return "0%"
    return f"{share:.0%}, {record['hold_ms_per_held_step']:.0f} ms, {record['hold_misses']:.0f} missed"


def _schedule(record: dict) -> str:
    """The best whole-cohort schedule's rate on the run's curve, and the share of it the cell measured."""
    rate = record.get("schedule_tok_s")  # absent from records written before it was computed
    if rate is None:
        return "-"
    return f"{rate:.2f} ({_fmt(record.get('of_schedule'), '.0%')})"


def _ordered(records: Sequence[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["rtt_ms"], r["num_edges"], MODES.index(r["mode"])))


def summary_markdown(results: dict) -> str:
    meta, records = results["meta"], _ordered(results["records"])
    config = meta["config"]
    machine = meta["machine"]
    loads = [r["load_average_1m"] for r in records if r.get("load_average_1m") is not None]
    lines = [
        f"# SpecEdge benchmark: {config['target']} verifying, {config['draft']} drafting ({config['edge_kind']} edges)",
        "",
        f"{meta['started_utc']}; {machine['platform']}, {machine['cpus']} CPUs, torch {machine['torch']}; "
        f"load average {_load(machine['load_average_before'])} before, {_load(machine['load_average_after'])} after"
        + (f", {min(loads):.1f} to {max(loads):.1f} at the end of the cells." if loads else "."),
        f"{len(meta['prompts'])} prompts, up to {config['max_tokens']} tokens, temperature {config['temperature']}, "
        f"draft length {config['num_draft']}{' (server advice followed)' if config['follow_advice'] else ' (fixed)'}, "
        f"jitter {config['jitter_ms']} ms; server billed as {config['pricing']['server_hw']} for wall time, edges as "
        f"{config['pricing']['edge_hw']} for drafting time.",
        "",
        "## Against server-only decoding (AR), same N and RTT",
        "",
        "Throughput is decode throughput: tokens after each request's first, per second while every edge is "
        "mid-stream (ramp-up and drain excluded); *whole run* counts every token over the cell's wall time. "
        "*Ideal* is the best ratio this machine allows, from the server's cost curve measured in this run and "
        "each cell's acceptance, draft length, round trip, the drafting its rounds waited for and the prompts "
        "prefilled in its window (bench/ideal.py, README). With `--repeats`, every cell runs once before any runs "
        "again, and *throughput x* pools the repeats; in brackets, the lowest and highest ratio of one repeat to "
        "AR's repeat beside it.",
        "",
        "| mode | N | RTT ms | throughput x | ideal x | of ideal | whole run x | ITL p50 x | ITL p95 x | "
        "cost efficiency x | acceptance | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["mode"] == "ar" or not r.get("vs_ar"):
            continue
        x = r["vs_ar"]
        lines.append(
            f"| {r['mode']} | {r['num_edges']} | {r['rtt_ms']:g} | {_fmt(x['throughput_x'], '.2f', 'x')}"
            f"{_repeat_range(x.get('throughput_x_per_repeat') or [])} | "
            f"{_fmt(x.get('ideal_throughput_x'), '.2f', 'x')} | {_fmt(x.get('of_ideal'), '.0%')} | "
            f"{_fmt(x.get('run_throughput_x'), '.2f', 'x')} | "
            f"{_fmt(x['itl_p50_x'], '.2f', 'x')} | {_fmt(x['itl_p95_x'], '.2f', 'x')} | "
            f"{_fmt(x['cost_efficiency_x'], '.2f', 'x')} | {_fmt(r['acceptance_rate'])} | "
            f"{r['identical_to_reference'] or '-'} |"
        )
    lines += [
        "",
        "## Every cell",
        "",
        "*Schedule* is the rate of the best round-robin schedule of whole cohorts on the cost curve measured in this "
        "run (bench/ideal.py): a rate a scheduler can reach, not a bound; in brackets, the share of it measured.",
        "",
        "| mode | N | RTT ms | decode tok/s | schedule tok/s | whole-run tok/s | ITL p50 ms | ITL p95 ms | "
        "TTFT p50 ms | acceptance | mean accepted length | proactive hits | server busy | tok/busy-s | "
        "batch rows x tokens | ms/step | held steps | $/Mtok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['mode']} | {r['num_edges']} | {r['rtt_ms']:g} | {_fmt(r['throughput_tok_s'])}"
            f"{'' if r.get('steady', True) else ' (no steady window)'} | {_schedule(r)} | "
            f"{_fmt(r.get('run_throughput_tok_s'))} | "
            f"{_fmt(r['itl_p50_ms'], '.0f')} | {_fmt(r['itl_p95_ms'], '.0f')} | {_fmt(r['ttft_p50_ms'], '.0f')} | "
            f"{_fmt(r['acceptance_rate'])} | {_fmt(r['mean_accepted_length'])} | {_fmt(r['proactive_hit_rate'])} | "
            f"{_fmt(r['server_busy_fraction'], '.0%')} | {_fmt(r['tokens_per_server_busy_s'])} | "
            f"{_fmt(r['mean_batch_size'], '.1f')} x {_fmt(r['mean_batch_tokens'], '.1f')} | "
            f"{_fmt(r['server_ms_per_step'], '.0f')} | {_held(r)} | {_fmt(r['cost_per_mtok_usd'], '.2f')} |"
        )
    categories = sorted({c for r in records for c in r["acceptance_per_category"]})
    if categories:
        lines += [
            "",
            "## Acceptance per prompt category (edge-drafted modes)",
            "",
            "| mode | N | RTT ms | " + " | ".join(categories) + " |",
            "|---|---|---|" + "---|" * len(categories),
        ]
        for r in records:
            if r["acceptance_per_category"]:
                cells = [_fmt(r["acceptance_per_category"].get(c)) for c in categories]
                lines.append(f"| {r['mode']} | {r['num_edges']} | {r['rtt_ms']:g} | " + " | ".join(cells) + " |")
    if meta.get("profile"):
        profile = meta["profile"]
        lines += [
            "",
            f"Simulated edges replay `{profile['path']}` ({profile['draft']} -> {profile['target']}); "
            f"draft latency {profile['draft_s_per_call'] * 1e3:.1f} ms per call + "
            f"{profile['draft_s_per_token'] * 1e3:.1f} ms per token.",
        ]
    if meta.get("cost_curve"):
        points = ", ".join(f"{t:.0f}: {sec * 1e3:.0f}" for t, sec in meta["cost_curve"])
        lines += ["", f"The server's forward cost, measured in this run (tokens per step: ms): {points}."]
    lines += ["", f"Raw measurements: results.json. Plots: {PLOTS_FILE}.", ""]
    return "\n".join(lines)


def _load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def plot(records: Sequence[dict], path: pathlib.Path) -> None:
    """Five panels: throughput vs N, its ratio to AR (measured and ideal), ITL p50/p95 vs N, acceptance per
    category, proactive hit rate vs N."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    records = _ordered(records)
    rtts = sorted({r["rtt_ms"] for r in records})
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    (throughput, ratio, itl), (categories, hits, spare) = axes
    spare.axis("off")
    for mode_index, mode in enumerate(modes):
        color = f"C{mode_index}"
        for rtt_index, rtt in enumerate(rtts):
            rows = [r for r in records if r["mode"] == mode and r["rtt_ms"] == rtt]
            ns = [r["num_edges"] for r in rows]
            style = styles[rtt_index % len(styles)]
            throughput.plot(
                ns, [r["throughput_tok_s"] for r in rows], style, marker="o", color=color, label=f"{mode}, {rtt:g} ms"
            )
            ratios = [(r["num_edges"], r["vs_ar"]) for r in rows if r.get("vs_ar") and mode != "ar"]
            if ratios:
                measured = [x["throughput_x"] for _, x in ratios]
                label = f"{mode}, {rtt:g} ms"
                ratio.plot([n for n, _ in ratios], measured, style, marker="o", color=color, label=f"{label}: measured")
                ideal = [(n, x["ideal_throughput_x"]) for n, x in ratios if x.get("ideal_throughput_x")]
                if ideal:
                    xs, ys = [n for n, _ in ideal], [v for _, v in ideal]
                    ratio.plot(xs, ys, style, color=color, alpha=0.5, linewidth=3, label=f"{label}: ideal")
            if rtt == rtts[-1]:
                itl.plot(ns, [r["itl_p50_ms"] for r in rows], "-", marker="o", color=color, label=f"{mode} p50")
                itl.plot(ns, [r["itl_p95_ms"] for r in rows], ":", marker="x", color=color, label=f"{mode} p95")
            if any(r["proactive_hit_rate"] is not None for r in rows):
                hits.plot(
                    ns,
                    [r["proactive_hit_rate"] for r in rows],
                    style,
                    marker="o",
                    color=color,
                    label=f"{mode}, {rtt:g} ms",
                )
    throughput.set(title="Decode throughput", xlabel="concurrent edges N", ylabel="tokens / second (steady window)")
    ratio.set(title="Throughput against AR, measured and ideal", xlabel="concurrent edges N", ylabel="x AR")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    itl.set(title=f"Inter-token latency at {rtts[-1]:g} ms RTT", xlabel="concurrent edges N", ylabel="ms")
    hits.set(
        title="Proactive hit rate", xlabel="concurrent edges N", ylabel="rounds whose next draft was ready", ylim=(0, 1)
    )
    if not hits.get_legend_handles_labels()[0]:
        hits.text(0.5, 0.5, "no specedge_proactive cells in this run", ha="center", transform=hits.transAxes)
    _category_bars(categories, records)
    for ax in (throughput, ratio, itl, hits):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _category_bars(ax, records: Sequence[dict]) -> None:
    """Edge-side acceptance per category, pooled over every edge-drafted cell of each mode."""
    per_mode: dict[str, dict[str, list[float]]] = {}
    for r in records:
        for category, rate in r["acceptance_per_category"].items():
            per_mode.setdefault(r["mode"], {}).setdefault(category, []).append(rate)
    categories = sorted({c for by in per_mode.values() for c in by})
    width = 0.8 / max(1, len(per_mode))
    for i, (mode, by_category) in enumerate(per_mode.items()):
        values = [sum(by_category.get(c, [0])) / len(by_category.get(c, [0])) for c in categories]
        ax.bar(
            [x + i * width for x in range(len(categories))], values, width, label=mode, color=f"C{MODES.index(mode)}"
        )
    ax.set_xticks([x + width * (len(per_mode) - 1) / 2 for x in range(len(categories))], categories, rotation=20)
    ax.set(title="Acceptance per prompt category", ylabel="accepted / drafted tokens", ylim=(0, 1))
    if per_mode:
        ax.legend(fontsize=7)
