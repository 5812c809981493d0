"""`python -m tools.bench grader-compare [--against OLD_REWARD_PY]`: reward.grade against
math-verify (and another reward.py) on the labelled cases: the peers' suites and the grader cases
(docs/grader.md)."""
import importlib.metadata
import json
import logging
import time

import reward
from tools.bench.grader import REWARD_DATA, REWARD_FALLBACK
from tools.bench.harness import module_from_file

def _math_verify():
    """math-verify's verdict as a grade(response, gold) function, or None when it is not
    installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # a "Timeout during comparison" warning per late case
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def grade(response, gold):
        if gold is None:
            return False
        gold = ", ".join(gold) if isinstance(gold, list) else gold
        return bool(verify(parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$"),
                           parse(response)))
    return grade


def _verdicts(items, fn):
    """-> [(verdict, seconds)] of `fn` over (response, gold, id, label) items; a grader that raises
    says "no"."""
    out = []
    for response, gold, _, _ in items:
        t = time.perf_counter()
        try:
            verdict = bool(fn(response, gold))
        except Exception:  # noqa: BLE001 - a peer grader that raises gave no verdict: counted "no"
            verdict = False
        out.append((verdict, time.perf_counter() - t))
    return out


def _compare_cells(items, verdicts, disputed):
    """The cells agree / FP / slowest (ms, id) of one grader's verdicts on `items`; FPs on a
    `disputed` id (a label docs/grader.md deliberately disagrees with) are counted apart."""
    right = sum(v == label for (v, _), (*_, label) in zip(verdicts, items))
    fps = [item[2] for (v, _), item in zip(verdicts, items) if v and not item[3]]
    seconds, name = max((t, item[2]) for (_, t), item in zip(verdicts, items))
    argued = sum(i in disputed for i in fps)
    return [f"{right}/{len(items)}", f"{len(fps)}" + (f" ({argued} disputed)" if argued else ""),
            f"{seconds * 1e3:.0f} ({name})"]


def _compare_table(groups, graders, verdicts, disputed=frozenset()):
    """One markdown table: a row per group of (response, gold, id, label) items, each grader's three
    cells."""
    print("| cases | n | labelled wrong | " + " | ".join(f"{g} agree | {g} FP | {g} slowest (ms)"
                                                         for g in graders)
          + " |")
    print("|---|---|---|" + "---|---|---|" * len(graders))
    for name, items in groups.items():
        cells = [c for g in graders
                 for c in _compare_cells(items, [verdicts[g][i[2]] for i in items], disputed)]
        wrong = sum(not label for *_, label in items)
        print(f"| {name} | {len(items)} | {wrong} | " + " | ".join(cells) + " |", flush=True)
    print()


def bench_grader_compare(against: str | None = None):
    """Issues 45 and 53: reward.grade against math-verify (HuggingFace's grader,
    `pip install math-verify`; its columns are left out, with a note, when it is not installed) and,
    with `--against FILE`, another reward.py (the code before a change), on labelled cases: the
    verdicts that agree with the label, the false positives (accepted, labelled wrong) and the
    slowest single case, per group, then every false positive listed.
    1. testdata/peer_cases.jsonl: the peers' own labelled cases, raw completions as their suites
       grade them (label = what the peer's test asserts; sources, commits and the conversion in
       testdata/README.md), per source: the peers' suites (lighteval's extractive-match tests, the
       reward tests of verl, Qwen2.5-Math, SkyRL, TRL, NeMo-RL, AReaL) and the last round's
       (math-verify's tests, NeMo-Skills', MATH's). A case where reward.py disagrees on purpose
       carries its reason (`deliberate_no`, docs/grader.md); its false positives are listed with it.
    2. testdata/grader_cases.jsonl (and ../shared/data/grader_cases.jsonl when it is beside the
       repository), per category, ambiguous cases left out.

    Deliberate choices:
    1. Each grader is called as it is meant to be used: reward.grade(response, gold); math-verify's
       verify(parse(gold), parse(response)) with a bare gold put in $...$ (a gold list joined with
       ", "), its default extraction and comparison options (not each peer test's own options: the
       options are in the `options` column). A grader that raises counts as "no".
    2. One pass (the verdicts are the point; `python -m tools.bench grader` measures speed).
    """
    graders = {"reward.py": reward.grade}
    if against:
        graders["before"] = module_from_file(against).grade
    peer = _math_verify()
    if peer is None:
        print("math-verify is not installed (`pip install math-verify`): "
              "its columns are left out\n")
    else:
        graders["math-verify"] = peer
        print(f"math-verify {importlib.metadata.version('math-verify')}\n")
    for grader in graders.values():
        grader("\\boxed{\\sqrt{2}}", "\\sqrt{2}")  # warm caches and imports
    peers = [json.loads(line)
             for line in (REWARD_FALLBACK / "peer_cases.jsonl").read_text().splitlines() if line]
    groups = {}
    # the peers' suites first, then the last round's
    for c in sorted(peers, key=lambda c: c["suite"] != "peers"):
        groups.setdefault((c["suite"], c["source"]), []).append((c["response"], c["gold"], c["id"],
                                                                 c["correct"]))
    for suite in ("peers", "last round"):
        groups[(suite, "**together**")] = [i for (s, _), items in list(groups.items()) if s == suite
                                           for i in items]
    everything = [i for (_, source), items in groups.items() if source != "**together**"
                  for i in items]
    verdicts = {g: {item[2]: v for item, v in zip(everything, _verdicts(everything, fn))}
                for g, fn in graders.items()}
    deliberate = {c["id"]: c["deliberate_no"] for c in peers}
    print("testdata/peer_cases.jsonl: agree / cases, false positives (accepted, labelled wrong; "
          "disputed: the label is a deliberate \"no\" of docs/grader.md), slowest case\n")
    _compare_table({f"{suite}: {source}": items for (suite, source), items in groups.items()},
                   graders, verdicts, {i for i, why in deliberate.items() if why})
    for g in graders:
        fps = [c for c in peers if verdicts[g][c["id"]][0] and not c["correct"]]
        real = sum(not deliberate[c["id"]] for c in fps)
        print(f"{g}: {len(fps)} false positives, {real} of them on a label docs/grader.md does not "
              "dispute" + (":" if fps else ""))
        for c in fps:
            why = f"disputed: {deliberate[c['id']]}" if deliberate[c["id"]] else "FALSE POSITIVE"
            print(f"- {c['id']}: {c['response'][-70:]!r} for gold {str(c['gold'])[:40]!r} ({why})")
        print()
    for where, path in (("testdata/grader_cases.jsonl", REWARD_FALLBACK / "grader_cases.jsonl"),
                        ("../shared/data/grader_cases.jsonl", REWARD_DATA / "grader_cases.jsonl")):
        if not path.exists():
            print(f"{where} not found: left out\n")
            continue
        by_category = {}
        for c in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
            if not c["ambiguous"]:
                by_category.setdefault(c["category"], []).append((c["response"], c["gold"], c["id"],
                                                                  c["correct"]))
        by_category = dict(sorted(by_category.items()))
        by_category["**all**"] = [item for items in by_category.values() for item in items]
        items = by_category["**all**"]
        verdicts = {g: {item[2]: v for item, v in zip(items, _verdicts(items, fn))}
                    for g, fn in graders.items()}
        print(f"{where}: agree / cases, false positives (of the cases labelled wrong), "
              "slowest case\n")
        _compare_table(by_category, graders, verdicts)
