"""results.json, report.md and the summary lines of a bench run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moestream.bench.compare import compare_runs, load_baseline
from moestream.bench.fit import LineFit, cv, fit_line, mean

if TYPE_CHECKING:
    from moestream.bench.client import RequestResult
    from moestream.bench.config import BenchConfig

GiB, MiB = 1 << 30, 1 << 20
RESULTS_VERSION = 1


def summarise(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Means and coefficients of variation across requests, totals of time, tokens and bytes."""
    decode = [r["decode_tok_s"] for r in requests]
    prefill = [r["prefill_tok_s"] for r in requests]
    counted = [r for r in requests if r.get("device_bytes") is not None]
    return {
        "requests": len(requests),
        "decode_tok_s_mean": mean(decode),
        "decode_tok_s_cv": cv(decode),
        "decode_tok_s_min": min(decode, default=None),
        "decode_tok_s_max": max(decode, default=None),
        "prefill_tok_s_mean": mean(prefill),
        "prefill_tok_s_cv": cv(prefill),
        "prompt_s_total": sum(r["prompt_ms"] for r in requests) / 1000,
        "prompt_s_mean": (mean([r["prompt_ms"] for r in requests]) or 0) / 1000,
        "generated_tokens": sum(r["predicted_n"] for r in requests),
        "ms_per_token_mean": mean([r["ms_per_token"] for r in requests]),
        "device_bytes": sum(r["device_bytes"] for r in counted) if counted else None,
        "device_gib": sum(r["device_bytes"] for r in counted) / GiB if counted else None,
        "mib_per_token_mean": mean([r["mib_per_token"] for r in counted]) if counted else None,
    }


def fit_points(runs: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(run label, MiB/token, ms/token) of every request whose reads were counted."""
    return [
        (run.get("label") or f"run {i + 1}", r["mib_per_token"], r["ms_per_token"])
        for i, run in enumerate(runs)
        for r in run["requests"]
        if r.get("mib_per_token") is not None
    ]


MIN_SPREAD = 0.1  # the read volumes must span at least 10% of the largest one for a meaningful slope


def fit_runs(runs: list[dict[str, Any]]) -> tuple[LineFit | None, list[tuple[str, float, float]]]:
    """The line through every counted request of `runs`; None when the MiB/token values barely differ
    (one run at one top-k: the slope would be fitted to noise), or when nothing was read."""
    points = fit_points(runs)
    xs = [p[1] for p in points]
    if not xs or max(xs) <= 0 or max(xs) - min(xs) < MIN_SPREAD * max(xs):
        return None, points
    return fit_line(xs, [p[2] for p in points]), points


def build_results(
    config: BenchConfig,
    requests: list[RequestResult],
    telemetry: dict[str, Any],
    mode_line: str | None,
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The whole run as one JSON-able object (the format `--baseline` and `--fit-with` read back)."""
    from moestream.bench.client import request_dict

    rows = [request_dict(r) for r in requests]
    server = "moestream" if any(r.moe is not None for r in requests) else config.server_name
    model = Path(config.disk_of).name if config.disk_of else (config.target or "")
    results: dict[str, Any] = {
        "version": RESULTS_VERSION,
        "label": config.label or server,
        "server": server,
        "model": model,
        "mode_line": mode_line,
        "lossy": bool(mode_line and "LOSSY" in mode_line),
        "command": sys.argv,
        "machine": machine,
        "settings": {
            "prompts": config.prompts,
            "max_tokens": config.max_tokens,
            "ignore_eos": config.ignore_eos,
            "greedy": True,
            "prompt_cache": False,
            "memory_limit": config.memory_limit,
            "readahead_kb": config.readahead_kb,
            "server_argv": config.server_argv,
            "target": config.target,
        },
        "requests": rows,
        "summary": summarise(rows),
        "telemetry": telemetry,
    }
    if config.baseline:
        diffs = compare_runs(rows, load_baseline(config.baseline))
        results["baseline"] = {
            "path": config.baseline,
            "identical": sum(d.identical for d in diffs),
            "of": len(diffs),
            "diffs": [d.to_dict() for d in diffs],
        }
    others = [load_run(p) for p in config.fit_with]
    fit, _ = fit_runs([results, *others])
    results["fit"] = fit.to_dict() if fit is not None else None
    results["fit_runs"] = [results["label"], *[o.get("label", "") for o in others]]
    return results


def load_run(path: str | Path) -> dict[str, Any]:
    """Another run's results.json (or its directory), for `--fit-with`."""
    return load_baseline(path)


def write_outputs(config: BenchConfig, results: dict[str, Any]) -> None:
    """results.json, report.md and (unless turned off) the two PNG plots, into `config.out`."""
    out = config.out
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "report.md").write_text(markdown(results), encoding="utf-8")
    if config.plots:
        from moestream.bench.plots import plot_decode, plot_fit, run_title

        plot_decode(results, out / "decode.png")
        others = [load_run(p) for p in config.fit_with]
        fit, points = fit_runs([results, *others])
        if points:
            plot_fit(points, fit, out / "fit.png", run_title(results, others))


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    """The Markdown report: settings, one row per request, the summary, baseline and fit lines."""
    m = results["machine"]
    lines = [
        f"# bench: {results['label']}",
        "",
        f"- date {m['date']}, {m['cpu']}, {m['cores']} cores",
        f"- mode: `{results['mode_line'] or results['server']}`",
        f"- device {m['device'] or 'not counted'}, readahead {m['readahead_kb']} KiB, memory limit "
        f"{m.get('cgroup', {}).get('limit_text', 'none')}, max tokens {results['settings']['max_tokens']}",
        "",
        "| # | lang | prompt tok | gen tok | prefill tok/s | decode tok/s | ms/token | MiB read prefill |"
        " MiB read decode | MiB/token | text equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    diffs = {d["index"]: d for d in results.get("baseline", {}).get("diffs", [])}
    for r in results["requests"]:
        d = diffs.get(r["index"])
        equal = "-" if d is None else ("yes" if d["identical"] else f"no (char {d['first_diff']})")
        pre = None if r["device_bytes_prefill"] is None else r["device_bytes_prefill"] / MiB
        dec = None if r["device_bytes_decode"] is None else r["device_bytes_decode"] / MiB
        lines.append(
            f"| {r['index'] + 1} | {r['lang']} | {r['prompt_n']} | {r['predicted_n']} | "
            f"{r['prefill_tok_s']:.2f} | {r['decode_tok_s']:.2f} | {r['ms_per_token']:.0f} | "
            f"{_num(pre, '.0f')} | {_num(dec, '.0f')} | {_num(r['mib_per_token'], '.1f')} | {equal} |"
        )
    lines += ["", *summary_lines(results)]
    return "\n".join(lines) + "\n"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The few lines printed at the end of a run (also the tail of report.md)."""
    s, t = results["summary"], results.get("telemetry") or {}
    cv_text = f"{100 * s['decode_tok_s_cv']:.1f}%" if s["decode_tok_s_cv"] is not None else "-"
    lines = [
        f"decode {_num(s['decode_tok_s_mean'])} tok/s mean (CV {cv_text}, min {_num(s['decode_tok_s_min'])}, "
        f"max {_num(s['decode_tok_s_max'])}) | prefill {_num(s['prefill_tok_s_mean'])} tok/s mean, "
        f"{s['prompt_s_total']:.1f} s in all | read {_num(s['device_gib'], '.1f')} GiB from the disk "
        f"({_num(s['mib_per_token_mean'], '.0f')} MiB/token decoding) | {s['generated_tokens']} tokens"
    ]
    if "baseline" in results:
        b = results["baseline"]
        lines.append(
            f"text identical to the baseline for {b['identical']} of {b['of']} prompts ({b['path']})"
        )
    fit = results.get("fit")
    lines.append(
        "fit: "
        + (
            LineFit(
                **{
                    k: fit.get(k)
                    for k in ("fixed_ms", "ms_per_mib", "r2", "points", "x_min", "x_max", "y_min")
                }
            ).line()
            if fit
            else "not enough spread in MiB/token (add a run at another read volume with --fit-with)"
        )
        + f" over {', '.join(results['fit_runs'])}"
    )
    if t.get("power_mean_w") is not None or t.get("gpu_clock_mean_mhz") is not None:
        lines.append(
            f"telemetry: power {_num(t.get('power_mean_w'))} W, energy "
            f"{_num(t.get('energy_per_token_j'), '.3f')}"
            f" J/token, GPU load {_num(t.get('gpu_load_mean_pct'), '.1f')}%, GPU clock "
            f"{_num(t.get('gpu_clock_mean_mhz'), '.0f')} MHz mean, histogram {t.get('gpu_clock_hist_mhz')}"
        )
    elif t.get("cpu_clock_mean_mhz") is not None:
        lines.append(
            f"telemetry: CPU clock {t['cpu_clock_mean_mhz']:.0f} MHz mean; no GPU or power sensors here"
        )
    if results.get("lossy"):
        lines.append("LOSSY run: fewer experts per token than the model's; not a valid speed comparison")
    return lines
