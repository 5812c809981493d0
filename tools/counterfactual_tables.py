"""The counterfactual's statistics and tables (RQ2, docs/paper.md §8; docs/experiments.md, "The
counterfactual estimator"): means and Newcombe's interval of one token's effect and contrast, Wilson
intervals, intervals and differences that resample whole responses (the tokens of one response are
one cluster), and the tables `python -m tools.counterfactual` prints for one run or for runs pooled
per algorithm."""
from __future__ import annotations

import math

import numpy as np

from reports.summary import step_spans


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def variance(xs: list[float]) -> float:
    """Unbiased sample variance."""
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def newcombe(keep: int, exclude: int, k: int, z: float = 1.96) -> tuple[float, float]:  # D62
    """Newcombe's hybrid score interval (1998, method 10) of p1 - p2 for p1 = keep / k,
    p2 = exclude / k, from the two Wilson intervals (l_i, u_i):
    (d - sqrt((p1 - l1)^2 + (u2 - p2)^2), d + sqrt((u1 - p1)^2 + (p2 - l2)^2))."""
    p1, p2 = keep / k, exclude / k
    (l1, u1), (l2, u2) = wilson(keep, k, z), wilson(exclude, k, z)
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))



KINDS = ("silenced", "candidate", "other")  # the tokens a step is analysed for


# -------------------------------------------------------------------------------------- the summary
# the token sits in the graded part of its response, or in the text after the answer
PARTS = ("graded", "after")
HEAD = ("tokens (responses) | mean effect (95% CI) | mean contrast (95% CI) | "
        "negligible (95% CI) | effect <= 0 | outcome settled | success kept / redrawn / without |")


def summary(lines: list[dict]) -> str:
    """The table printed at the end: one row per kind and part of the response (`summary_row`)."""
    rows = [(kind, part, [x for x in lines if (x["kind"], x["part"]) == (kind, part)])
            for kind in KINDS for part in PARTS]
    return "\n".join(["| kind | " + HEAD, "|---" * (HEAD.count("|") + 1) + "|",
                      *(f"| {kind}, {part} | {summary_row(group)}" for kind, part, group in rows)])


def summary_row(lines: list[dict]) -> str:
    """The cells of one group of tokens: its count (and its responses'), the mean effect and the
    mean contrast with 95% intervals that resample whole responses (`cluster_interval`), the share
    negligible by the equivalence test (the contrast's Newcombe interval inside +-delta; the paper's
    "negligible contribution", the S2T rule's precision when the group is what it silenced) with its
    clustered interval, the share of effects <= 0, the share whose outcome was settled before the
    token (all 2K continuations agree: the answer was already written, or already missed), and the
    mean success rates with the token kept, redrawn, and redrawn without it."""
    n = len(lines)
    if not n:
        return "0 | - | - | - | - | - | - |"
    clusters = [(x.get("algo"), x.get("seed"), x.get("step"), x.get("row")) for x in lines]

    def cell(values, fmt):
        lo, hi = cluster_interval(values, clusters)
        return f"{fmt.format(mean(values))} ({fmt.format(lo)}, {fmt.format(hi)})"

    settled = sum(x["keep"] == x["resample"] == x["exclude"] and x["keep"] in (0.0, 1.0)
                  for x in lines)
    return (f"{n} ({len(set(clusters))}) | {cell([x['effect'] for x in lines], '{:+.3f}')} | "
            f"{cell([x['contrast'] for x in lines], '{:+.3f}')} | "
            f"{cell([float(x['negligible']) for x in lines], '{:.0%}')} "
            f"(delta {lines[0]['delta']:g}) | "
            f"{sum(x['effect'] <= 0 for x in lines) / n:.0%} | {settled / n:.0%} | "
            f"{mean([x['keep'] for x in lines]):.2f} / "
            f"{mean([x['resample'] for x in lines]):.2f} / "
            f"{mean([x['exclude'] for x in lines]):.2f} |")


def cluster_interval(values: list[float], clusters: list, n: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` resampling whole clusters (the tokens
    of one response) with replacement: the mean of a replicate is over all tokens of its drawn
    clusters. One cluster: (mean, mean)."""
    keys = list(dict.fromkeys(clusters))
    index = {key: i for i, key in enumerate(keys)}
    sums, counts = np.zeros(len(keys)), np.zeros(len(keys))
    for v, c in zip(values, clusters):
        sums[index[c]] += v
        counts[index[c]] += 1
    draw = np.random.default_rng(seed).integers(len(keys), size=(n, len(keys)))  # (n, clusters)
    stats = sums[draw].sum(1) / counts[draw].sum(1)  # (n,)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def cluster_difference(a: list[float], a_clusters: list, b: list[float], b_clusters: list,
                       n: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its percentile bootstrap interval resampling whole clusters (responses)
    of both groups at once: a drawn response brings its tokens of each group, so tokens of one
    response, in one group or in both, are never counted as independent. Replicates that draw no
    token of a group are dropped. (nan, nan, nan) when a group is empty."""
    if not a or not b:
        return math.nan, math.nan, math.nan
    keys = list(dict.fromkeys([*a_clusters, *b_clusters]))
    index = {key: i for i, key in enumerate(keys)}
    sums, counts = np.zeros((2, len(keys))), np.zeros((2, len(keys)))  # (group, clusters)
    for g, (values, clusters) in enumerate(((a, a_clusters), (b, b_clusters))):
        for v, c in zip(values, clusters):
            sums[g, index[c]] += v
            counts[g, index[c]] += 1
    draw = np.random.default_rng(seed).integers(len(keys), size=(n, len(keys)))  # (n, clusters)
    s, c = sums[:, draw].sum(2), counts[:, draw].sum(2)  # (group, n)
    ok = (c > 0).all(0)  # (n,)
    stats = s[0, ok] / c[0, ok] - s[1, ok] / c[1, ok]
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return mean(a) - mean(b), float(lo), float(hi)


def difference_row(a: list[dict], b: list[dict]) -> str:
    """The cells of group a minus group b (token lines): the counts, and the differences of the mean
    effect, the mean contrast and the share negligible with 95% intervals resampling responses
    (`cluster_difference`)."""
    if not a or not b:
        return f"{len(a)} - {len(b)} | - | - | - | - | - | - |"

    def key(x):
        return x.get("algo"), x.get("seed"), x.get("step"), x.get("row")

    def cell(field, fmt):
        d, lo, hi = cluster_difference([float(x[field]) for x in a], [key(x) for x in a],
                                       [float(x[field]) for x in b], [key(x) for x in b])
        return f"{fmt.format(d)} ({fmt.format(lo)}, {fmt.format(hi)})"

    responses = len({key(x) for x in a + b})
    return (f"{len(a)} - {len(b)} ({responses}) | {cell('effect', '{:+.3f}')} | "
            f"{cell('contrast', '{:+.3f}')} | {cell('negligible', '{:+.2f}')} | - | - | - |")


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion successes / n (95% at z = 1.96):
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n); it stays inside [0, 1] and is not
    empty at 0 or n successes."""
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def pooled_groups(lines: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """{algorithm (its seeds and steps): {group: lines}} of many runs' lines: per algorithm the
    three kinds, then its candidates (A > 0, p < tau_p) split by the S2T rule (`s2t_rule`: what
    STAPO's mask silences in that mini-batch, whatever the run's algorithm), i.e. the rule's
    precision against the candidates it keeps, on the same tokens."""
    out = {}
    for algo in dict.fromkeys(x["algo"] for x in lines):
        mine = [x for x in lines if x["algo"] == algo]
        steps = step_spans(sorted({x["step"] for x in mine}))
        name = f"{algo} ({len({x['seed'] for x in mine})} seeds, steps {steps})"
        out[name] = {f"{kind}, {part}": [x for x in mine if x["kind"] == kind and x["part"] == part]
                     for kind in KINDS for part in PARTS}
        out[name] |= {f"candidates the S2T rule {verb}":
                      [x for x in mine if x["candidate"] and x["s2t_rule"] == rule]
                      for verb, rule in (("silences", True), ("keeps", False))}
    return out


def pooled_summary(lines: list[dict]) -> str:
    """RQ2 over many runs (`python -m tools.counterfactual --table RUN ...`): a `summary_row` per
    group of `pooled_groups`, then per algorithm the candidates the S2T rule silences minus those it
    keeps (`difference_row`), in the graded part, after it and in both: the entropy condition's
    effect, within a part (the part alone decides much of a token's effect), with intervals over
    responses."""
    rows = []
    for name, groups in pooled_groups(lines).items():
        rows += [f"| {name if i == 0 else ''} | {group} | {summary_row(g)}"
                 for i, (group, g) in enumerate(groups.items())]
        silences, keeps = \
            groups["candidates the S2T rule silences"], groups["candidates the S2T rule keeps"]
        for part in (*PARTS, None):
            a, b = ([x for x in g if part in (None, x["part"])] for g in (silences, keeps))
            rows.append(f"|  | S2T rule, silences - keeps, {part or 'both'} | "
                        f"{difference_row(a, b)}")
    return "\n".join(["| algorithm | which tokens | " + HEAD, "|---" * (HEAD.count("|") + 2) + "|",
                      *rows])
