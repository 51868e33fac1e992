"""Plot a JPS sweep and print its table.

Reads every `<policy>_jps<jps>.json` under `our_experiments/results/<machine>/` and writes
there:
- `jps_sweep.png`: average and P95 job duration vs JPS, one line per policy;
- `jps_sweep_speedup.png`: % improvement over FCFS, (fcfs - other) / fcfs * 100, for the
  average and the P95;
- `per_turn_latency.png`: average latency per turn, bars per policy, one panel per JPS;
- `overload.png` (when the results carry the overload fields): jobs finished inside the
  window and the all-jobs average job time (a lower bound) vs JPS, one line per policy.
It prints (and writes to `table.md`) the policy x JPS table used in docs/experiments.md;
for points behind a router (docs/router.md) also where the turns ran: turns, pins and pin
hits per replica, and the turns that moved to another replica than their job's previous one.

    .venv/bin/python our_experiments/scripts/plot_jps_sweep.py --machine cpu-2core
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Run as a file, this script sees only its own folder; the repository root makes
# `our_experiments` importable (vllm itself is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from our_experiments.scripts.run_sweep import RESULTS, default_machine  # noqa: E402

BASELINE = "fcfs"


def load_results(folder: Path) -> dict[str, dict[float, dict]]:
    """policy -> jps -> result, from every result JSON in ``folder``."""
    out: dict[str, dict[float, dict]] = {}
    for path in sorted(folder.glob("*_jps*.json")):
        r = json.loads(path.read_text())
        if isinstance(r, dict) and "policy" in r and "jps" in r:  # not a sweep config
            out.setdefault(r["policy"], {})[float(r["jps"])] = r
    return out


def improvement(base: float | None, other: float | None) -> float | None:
    """% less time than the baseline (positive: better than FCFS)."""
    if not base or other is None:
        return None
    return (base - other) / base * 100


def table(results: dict[str, dict[float, dict]]) -> str:
    head = (
        "| policy | JPS | jobs (done) | avg s | P90 s | P95 s | vs fcfs avg | vs fcfs P95 "
        "| hit rate | KV max / >90% | preempt | pins / hits |"
    )
    rows = [head, "|" + "---|" * 12]
    base = results.get(BASELINE, {})
    for jps in sorted({j for by in results.values() for j in by}):
        for policy in sorted(results, key=lambda p: (p != BASELINE, p)):
            r = results[policy].get(jps)
            if r is None:
                continue
            b = base.get(jps, {})
            m = r.get("metrics", {})
            imp_avg = improvement(b.get("avg_duration_s"), r["avg_duration_s"])
            imp_p95 = improvement(b.get("p95_duration_s"), r["p95_duration_s"])
            rows.append(
                f"| {policy} | {jps:g} | {r['num_jobs']} ({r['num_completed']}) "
                f"| {_f(r['avg_duration_s'])} | {_f(r['p90_duration_s'])} "
                f"| {_f(r['p95_duration_s'])} "
                f"| {_pct(imp_avg) if policy != BASELINE else '-'} "
                f"| {_pct(imp_p95) if policy != BASELINE else '-'} "
                f"| {_pct(100 * r['prefix_hit_rate'] if r.get('prefix_hit_rate') else None)} "
                f"| {_pct(100 * (r.get('kv_usage_max') or 0))} / "
                f"{_pct(100 * (r.get('kv_usage_frac_above_90') or 0))} "
                f"| {m.get('preemptions', 0):.0f} "
                f"| {m.get('pins', 0):.0f} / {m.get('pin_hits', 0):.0f} |"
            )
    return "\n".join(rows)


def overload_table(results: dict[str, dict[float, dict]]) -> str:
    """Jobs finished in the window, goodput, and job times over all jobs (an unfinished
    job counted until the window's end: lower bounds, marked >=)."""
    head = (
        "| policy | JPS | finished / jobs | goodput /min | avg all s (>=) | P95 all s (>=) "
        "| avg finished s | prompt tokens computed | preempt | pins / hits / forced |"
    )
    rows = [head, "|" + "---|" * 10]
    for jps in sorted({j for by in results.values() for j in by}):
        for policy in sorted(results, key=lambda p: (p != BASELINE, p)):
            r = results[policy].get(jps)
            if r is None or "avg_duration_all_s" not in r:
                continue  # a result written before these fields existed
            m = r.get("metrics", {})
            computed = r.get("prompt_tokens_computed")
            rows.append(
                f"| {policy} | {jps:g} | {r['num_completed']} / {r['num_jobs']} "
                f"| {_f(r.get('goodput_jobs_per_min'), 2)} | {_f(r['avg_duration_all_s'])} "
                f"| {_f(r['p95_duration_all_s'])} | {_f(r['avg_duration_s'])} "
                f"| {'-' if computed is None else f'{computed / 1e3:.0f}k'} "
                f"| {m.get('preemptions', 0):.0f} | {m.get('pins', 0):.0f} / "
                f"{m.get('pin_hits', 0):.0f} / {m.get('pin_forced_releases', 0):.0f} |"
            )
    return "\n".join(rows) if len(rows) > 2 else ""


def routing_table(results: dict[str, dict[float, dict]]) -> str:
    """Points behind a router: per replica (in replica order, "/"-separated) the turns it
    served, its pins and pin hits; the turns that moved replica and the jobs with any."""
    head = (
        "| point | JPS | turns per replica | turn moves (jobs) | pins per replica "
        "| pin hits per replica | preempt per replica |"
    )
    rows = [head, "|" + "---|" * 7]
    for jps in sorted({j for by in results.values() for j in by}):
        for label in sorted(results):
            r = results[label].get(jps)
            if r is None or "replicas" not in r:
                continue  # one server, or a result written before these fields existed

            def each(key: str, r=r) -> str:
                return " / ".join(f"{row[key]:.0f}" for row in r["replicas"])

            rows.append(
                f"| {label} | {jps:g} | {each('turns')} "
                f"| {r.get('turn_moves', '-')} ({r.get('jobs_with_turn_moves', '-')}) "
                f"| {each('pins')} | {each('pin_hits')} | {each('preemptions')} |"
            )
    return "\n".join(rows) if len(rows) > 2 else ""


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%" if x < 0 else f"{x:.1f}%"


def plot(results: dict[str, dict[float, dict]], folder: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(
        axes, ("avg_duration_s", "p95_duration_s"), ("average", "P95"), strict=True
    ):
        for policy, by_jps in sorted(results.items()):
            xs = sorted(j for j in by_jps if by_jps[j][key] is not None)
            ax.plot(xs, [by_jps[j][key] for j in xs], marker="o", label=policy)
        ax.set(xlabel="job arrivals per second (JPS)", ylabel=f"{label} job duration (s)")
        ax.set_title(f"{label} job duration vs load")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    written.append(_save(fig, folder / "jps_sweep.png"))

    others = [p for p in sorted(results) if p != BASELINE]
    if BASELINE in results and others:
        jps_list = sorted(results[BASELINE])
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / (2 * len(others))
        for i, policy in enumerate(others):
            for k, key in enumerate(("avg_duration_s", "p95_duration_s")):
                vals = [
                    improvement(results[BASELINE][j][key], results[policy].get(j, {}).get(key))
                    or 0.0
                    for j in jps_list
                ]
                offs = (2 * i + k - len(others) + 0.5) * width
                xs = [x + offs for x in range(len(jps_list))]
                ax.bar(xs, vals, width, label=f"{policy} ({'avg' if k == 0 else 'P95'})")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(jps_list)), [f"{j:g}" for j in jps_list])
        ax.set(xlabel="JPS", ylabel="% less job time than FCFS")
        ax.set_title(f"Improvement over FCFS (positive = faster) - {title}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(_save(fig, folder / "jps_sweep_speedup.png"))

    jps_all = sorted({j for by in results.values() for j in by})
    fig, axes = plt.subplots(1, len(jps_all), figsize=(4 * len(jps_all), 3.6), squeeze=False)
    for ax, jps in zip(axes[0], jps_all, strict=True):
        policies = [p for p in sorted(results) if jps in results[p]]
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            per_turn = results[policy][jps]["per_turn_avg_latency_ms"]
            turns = sorted(per_turn, key=int)
            xs = [int(t) + (i - (len(policies) - 1) / 2) * width for t in turns]
            ax.bar(xs, [per_turn[t] / 1e3 for t in turns], width, label=policy)
        ax.set(title=f"JPS {jps:g}", xlabel="turn", ylabel="avg latency (s)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Per-turn latency - {title}")
    fig.tight_layout()
    written.append(_save(fig, folder / "per_turn_latency.png"))

    overload = {
        policy: {j: r for j, r in by_jps.items() if "avg_duration_all_s" in r}
        for policy, by_jps in results.items()
    }
    overload = {policy: by_jps for policy, by_jps in overload.items() if by_jps}
    if overload:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for policy, by_jps in sorted(overload.items()):
            xs = sorted(by_jps)
            share = [100 * by_jps[j]["num_completed"] / max(by_jps[j]["num_jobs"], 1) for j in xs]
            axes[0].plot(xs, share, marker="o", label=policy)
            axes[1].plot(xs, [by_jps[j]["avg_duration_all_s"] for j in xs], marker="o",
                         label=policy)  # fmt: skip
        axes[0].set(xlabel="JPS", ylabel="jobs finished in the window (%)", ylim=(0, 105))
        axes[0].set_title("Jobs finished inside the window")
        axes[1].set(xlabel="JPS", ylabel="avg job time, all jobs (s, lower bound)")
        axes[1].set_title("Average job time, all jobs (lower bound)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Overload - {title}")
        fig.tight_layout()
        written.append(_save(fig, folder / "overload.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--machine", default=None, help="results subfolder (default: cpu-<n>core)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    folder = args.results_dir / (args.machine or default_machine())
    results = load_results(folder)
    if not results:
        raise SystemExit(f"error: no result JSONs in {folder}")
    text = table(results)
    overload = overload_table(results)
    if overload:
        text += "\n\nOverload view (unfinished jobs counted until the window's end):\n\n"
        text += overload
    routing = routing_table(results)
    if routing:
        text += "\n\nWhere the turns ran (replicas behind the router):\n\n" + routing
    (folder / "table.md").write_text(text + "\n")
    print(text)
    for path in plot(results, folder, args.title or folder.name):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
