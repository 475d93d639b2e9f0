"""The pre-registered confirmation of the recipe's guard rule (``--lr-cut-after 1``) at fresh seeds, issue 15.

``results/evidence/confirm_after1/README.md`` wrote the tests down before the runs: the recipe (``hdet train
--lr-sweep 0.2 --alpha 0``, the default ``--lr-cut-after 1``) at GPT seeds 44-59 and Fashion-MNIST seeds 18-20 from
0.1x, 1x and 10x the grid's best (calls 1-3), and its GPT event runs again at their swept peak LR with the rule before
(``recover:0.7:0``) and the default (``recover``, which must repeat its source run to the digit; call 4).

- Test 1 (the rule): the mean over the event runs of (default minus rule before), in % of the grid's best: confirmed
  if below zero by more than one standard error, refuted if above zero, inconclusive otherwise.
- Test 2 (the target): per start, the GPT over the 48 seeds 12-59 (12-43 as ``guard_after_report.py`` puts them)
  within +0.5% of the grid's best, and no fresh 16-seed cell above +1.0%; Fashion-MNIST over seeds 12-20 within 0.2
  point (not below it by more: "within" as the issue means it, a shortfall; the GPT's +0.5% likewise).

    python benchmarks/confirm_after1_report.py --out benchmarks/results/evidence/confirm_after1/report.json
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guard_after_report import fashion_after, replaced  # noqa: E402  (same folder)
from sweep_alpha0_report import BEST, R, acted  # noqa: E402

HERE = R / "confirm_after1"


REGISTERED = {"bytes": range(44, 60), "fashion": range(18, 21)}  # the seeds the test wrote down, from 0.1x, 1x, 10x


def runs(files: list[Path]) -> dict[tuple[float, int], tuple[float, bool]]:
    """Every run in ``files`` (``lr_sweep_cli.py`` JSONs) by (start, seed): its metric and whether the guard acted;
    a run without a metric (crashed or stopped) or twice stops the report."""
    out: dict[tuple[float, int], tuple[float, bool]] = {}
    for f in files:
        for r in json.loads(f.read_text())["runs"]:
            if r.get("metric") is None:
                raise SystemExit(f"{r['name']} in {f} has no metric (crashed or stopped): the test counts every run")
            if (r["start"], r["seed"]) in out:
                raise SystemExit(f"{r['name']} in {f}: a second run of the same start and seed")
            out[(r["start"], r["seed"])] = (r["metric"], acted(r["log_tail"]))
    return out


def fresh(task: str) -> dict[tuple[float, int], tuple[float, bool]]:
    out = runs(sorted(HERE.glob(f"call[123]/lr_sweep_cli_alpha0_{task}_*.json")))
    want = {(s0, sd) for s0 in (0.1, 1.0, 10.0) for sd in REGISTERED[task]}
    if set(out) != want:
        raise SystemExit(f"Expected the registered {task} runs, {len(want)}: missing {sorted(want - set(out))}, "
                         f"not registered {sorted(set(out) - want)}")
    return out


def cell(values: list[float], best: float, relative: bool) -> dict:
    m, se = st.mean(values), st.stdev(values) / len(values) ** 0.5
    if relative:
        return {"n": len(values), "mean": m, "vs_best_pct": 100 * (m / best - 1), "se_pct": 100 * se / best}
    return {"n": len(values), "mean": m, "vs_best_pt": m - best, "se_pt": se}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    best = BEST["bytes"]
    rel = lambda x: 100 * (x / best - 1)  # noqa: E731
    rec: dict = {"command": "python " + " ".join(sys.argv), "grid_best": BEST}

    # Test 1: the fresh runs ran the default; their event runs' reruns under the rule before are the other arm.
    source = fresh("bytes")
    now, before_rule, events = replaced("recover:0.7:0", source, [HERE / "call4" / "guard_events_confirm.json"])
    d = [rel(x) - rel(y) for x, y, *_ in events.values()]  # default minus rule before
    mean, se = st.mean(d), st.stdev(d) / len(d) ** 0.5
    verdict = "confirmed" if mean < -se else "refuted" if mean > 0 else "inconclusive"
    rec["test1"] = {"event_runs": len(d), "of_runs": len(now), "paired_difference_pct": mean, "paired_se_pct": se,
                    "better": sum(x < 0 for x in d), "verdict": verdict,
                    "runs": [{"start": k[0], "seed": k[1], "default": v[0], "rule_before": v[1],
                              "events_default": v[2], "events_rule_before": v[3]} for k, v in sorted(events.items())]}
    print(f"test 1: {len(d)} of {len(now)} fresh GPT runs had an event; default minus rule before {mean:+.2f}% "
          f"(se {se:.2f}%), better in {rec['test1']['better']}: {verdict}")

    # Test 2: the pooled cells and the fresh ones alone.
    _, old_seeds, _ = replaced("recover:0.7:1")  # seeds 12-43 with the default's reruns in place
    fb, fa = fashion_after()
    ffresh = {k: m for k, (m, _) in fresh("fashion").items()}
    rec["test2"], ok = [], True
    for start in sorted({k[0] for k in now}):
        f = [m for (s0, _), m in now.items() if s0 == start]
        pool = f + [m for (s0, _), m in old_seeds.items() if s0 == start]
        g = cell(f, best, True)
        c = {"start": start, "gpt_fresh": g, "gpt_pooled": cell(pool, best, True),
             "gpt_fresh_rule_before": cell([m for (s0, _), m in before_rule.items() if s0 == start], best, True),
             "fashion_fresh": cell([m for (s0, _), m in ffresh.items() if s0 == start], BEST["fashion"], False),
             "fashion_pooled": cell([m for (s0, _), m in {**fa, **ffresh}.items() if s0 == start], BEST["fashion"],
                                    False)}
        c["met"] = (c["gpt_pooled"]["vs_best_pct"] <= 0.5 and g["vs_best_pct"] <= 1.0
                    and c["fashion_pooled"]["vs_best_pt"] >= -0.2)
        ok &= c["met"]
        rec["test2"].append(c)
        print(f"{start:g}x: GPT fresh {g['mean']:.4f} ({g['vs_best_pct']:+.2f}%, se {g['se_pct']:.2f}%; rule before "
              f"{c['gpt_fresh_rule_before']['vs_best_pct']:+.2f}%), pooled {c['gpt_pooled']['n']} seeds "
              f"{c['gpt_pooled']['mean']:.4f} ({c['gpt_pooled']['vs_best_pct']:+.2f}%, se "
              f"{c['gpt_pooled']['se_pct']:.2f}%); Fashion-MNIST fresh {c['fashion_fresh']['mean']:.2f} "
              f"({c['fashion_fresh']['vs_best_pt']:+.2f} pt), pooled {c['fashion_pooled']['n']} seeds "
              f"{c['fashion_pooled']['mean']:.2f} ({c['fashion_pooled']['vs_best_pt']:+.2f} pt): "
              f"{'met' if c['met'] else 'NOT met'}")
    rec["test2_met"] = ok
    rec["resolved_by_the_rule"] = ok and verdict != "refuted"
    rec["fashion_fresh_runs"] = {f"{k[0]:g}x-s{k[1]}": m for k, m in sorted(ffresh.items())}
    print(f"test 2 {'met' if ok else 'NOT met'}; issue 15 resolved by the pre-registered rule: "
          f"{rec['resolved_by_the_rule']}")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
