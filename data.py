"""The problem sets: the built-in task, your own files and Hub datasets, as rows
{"problem", "answer"}, the paper's instruction appended to each (`INSTRUCTION`), and the order in
which train.py takes them (docs/paper.md §6: the training data; docs/training.md#your-own-data).
    train_rows, heldout_rows, repeated = load_rows(cfg)
        # train.py --data (and eval.py --run's heldout)
    rows = prompt_indices(step - 1, len(train_rows), cfg)
        # the training rows of a step, every epoch shuffled
    rows, repeated = read_rows("my.jsonl", "question", "gold")  # eval.py --data

Deliberate differences from the paper's veRL setup:
1. The CPU default trains on a built-in task, every one-digit sum (`builtin_task`), chosen by
   measuring SmolLM2-135M-Instruct; the paper trains Qwen3 on DAPO-Math-17k.
2. Rows repeating an earlier row's (problem, answer) are dropped and counted (the Hub DAPO-Math-17k
   repeats each of its problems 100 times); DAPO-Math-17k's own answer-format instructions are
   stripped, since the paper's \boxed{} instruction is appended to every problem (as JustRL does).
3. A held-out set is kept out of --data by default (a tenth of the rows, at most 20;
   `heldout_count`), so every run has a before/after accuracy.
4. A bad row is an error naming the file and its 1-based line (.jsonl) or row, never a silent skip.
Every function here is pure but for reading files; torch and datasets are imported only when needed.
"""
import json
import math
import os
import random


# The built-in task: every one-digit sum "What is a + b?" (100 problems, 20 held out),
# deterministic. Chosen by measuring SmolLM2-135M-Instruct (docs/training.md): with the raw-text
# prompt "...\nThe answer is" it is right on ~12% of them at T = 1.0 (~20% at 0.7; ~2% for word
# problems or a chat prompt with the \boxed{} instruction), so many groups of 8 have mixed rewards.
def builtin_task(split: str) -> list[dict]:
    """The built-in problems of `split` ('train': 80, 'test': 20), each {"problem", "answer"}."""
    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)}
            for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(rows)
    return rows[20:] if split == "train" else rows[:20]


def _at_path(row: dict, key: str):
    """row["a"]["b"] for key "a.b" (None where a part is missing)."""
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


# DAPO-Math-17k wraps each problem in its own instructions ("... of the form Answer: $Answer ...");
# we strip them and append the paper's \boxed{} instruction like JustRL does.
_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
                "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                "answer to the problem.\n\n")
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# The paper's instruction, appended to every problem (rollout.format_prompt; train.py's and
# eval.py's default).
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# --heldout's default: a tenth of the rows of --data, at most this many (none below 10 rows)
HELDOUT_MAX = 20


def heldout_count(n_rows: int, heldout: int | None) -> int:
    """Rows of --data held out of n_rows: --heldout N, or by default (None) n_rows // 10, at most
    HELDOUT_MAX."""
    return min(HELDOUT_MAX, n_rows // 10) if heldout is None else heldout


def problem_seed(seed: int, index: int) -> int:
    """The sampling seed of the generate call that starts at problem `index` (0-based) of an
    evaluated set (train.py's held-out evaluation: one call per problem; eval.py): a function of the
    problem, never of the rank that samples it, so an evaluation on any number of processes samples
    the same (as training seeds by the global prompt index)."""
    return hash((seed, index)) % 2**62


def load_rows(cfg) -> tuple[list[dict], list[dict], int]:
    """(train, held-out) lists of {"problem", "answer"} of a train.py config (its data, prompt_key,
    answer_key, split, heldout and seed), and the number of repeated rows dropped: the rows of
    --data, shuffled by the seed, the first `heldout_count` held out; or the built-in task when
    --data is ''."""
    import torch

    if not cfg.data:
        return builtin_task("train"), builtin_task("test"), 0
    rows, repeated = read_rows(cfg.data, cfg.prompt_key, cfg.answer_key, cfg.split)
    heldout = heldout_count(len(rows), cfg.heldout)
    if heldout >= len(rows):
        raise ValueError(f"--heldout {heldout} leaves no training rows (of the {len(rows)} in "
                         f"{cfg.data})")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    rows = [rows[i] for i in order]
    return rows[heldout:], rows[:heldout], repeated


def prompt_indices(position: int, n_rows: int, cfg) -> list[int]:
    """Training rows of the --prompts-per-step prompts of the step after `position` steps (all
    ranks; a train.py config's prompts_per_step and seed): a fresh permutation of the rows
    every epoch."""
    import torch

    perms, out = {}, []
    for pos in range(position * cfg.prompts_per_step, (position + 1) * cfg.prompts_per_step):
        epoch, i = divmod(pos, n_rows)
        if epoch not in perms:
            seed = (cfg.seed * 100_003 + epoch) % 2**64  # as torch reads it: any 64-bit --seed
            perms[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))
        out.append(int(perms[epoch][i]))
    return out


def rank_slice(n: int, cfg, rank: int, world: int) -> list[int]:
    """Positions (0..n-1 in the step's prompt list) this rank handles: the rank-th slice of every
    mini-batch of --mini-batch-prompts, so a mini-batch is the same set of prompts for any number of
    ranks (D41)."""
    m = cfg.mini_batch_prompts // world
    return [k * cfg.mini_batch_prompts + rank * m + j
            for k in range(n // cfg.mini_batch_prompts) for j in range(m)]


def read_rows(data: str, prompt_key: str, answer_key: str,
              split: str = "train") -> tuple[list[dict], int]:
    """(rows {"problem", "answer", "fields": the row as read, for a reward function that reads it
    (reward.py)} of a local .jsonl/.json/.parquet file or a Hub dataset, in file order; the number
    of rows dropped because they repeat an earlier row's problem and answer (point 2 above)).
    `prompt_key`/`answer_key` are dotted paths; a chat message list gives its last user turn; an
    answer is a string, a finite number or a list of strings (`answer_value`). A bad row raises
    ValueError naming its line (.jsonl) or row (1-based) and what is wrong. train.py's --data and
    eval.py's --data."""
    suffix = next((s for s in (".jsonl", ".json", ".parquet") if data.endswith(s)), None)
    if suffix and not os.path.isfile(data):
        raise FileNotFoundError(f"data file not found: {data}")
    if suffix == ".jsonl":
        numbered = read_jsonl(data)  # plain json lines: no `datasets` needed
    else:
        import datasets

        datasets.disable_progress_bars()
        if suffix:
            # its own error log line: ours is the one line
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)
            try:
                table = datasets.load_dataset("parquet" if suffix == ".parquet" else "json",
                                              data_files=data, split="train")
            except Exception as e:  # noqa: BLE001 - datasets wraps every reason (empty file: StopIteration)
                raise ValueError(f"{data}: not a readable {suffix[1:]} file ({type(e).__name__}: "
                                 f"{(str(e).strip().splitlines() or [''])[0][:200]})") from None
        else:
            table = datasets.load_dataset(data, split=split)
        numbered = [(f"row {i}", row) for i, row in enumerate(table, 1)]
    if not numbered:
        raise ValueError(f"{data}: no rows")
    rows, seen = [], set()
    for where, row in numbered:
        problem, answer = _at_path(row, prompt_key), _at_path(row, answer_key)
        if isinstance(problem, list):  # chat messages: the last user turn
            problem = next((m.get("content") for m in reversed(problem) if isinstance(m, dict)
                            and m.get("role") == "user"), None)
        fields_hint = f"the row's fields: {', '.join(row) or 'none'}"
        if problem is None or problem == "":
            raise ValueError(f"{data} {where}: no prompt in field {prompt_key!r} ({fields_hint}); "
                             f"name the field with --prompt-key")
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{data} {where}: the prompt in field {prompt_key!r} is "
                             f"{describe(problem)}, not text")
        if answer is None or answer == "" or answer == []:
            raise ValueError(f"{data} {where}: no answer in field {answer_key!r} ({fields_hint}); "
                             f"name the field with --answer-key")
        try:
            answer = answer_value(answer)
            check_utf8(problem, "prompt")
        except ValueError as e:
            raise ValueError(f"{data} {where}: {e}") from None
        problem = problem.removeprefix(_DAPO_PREFIX).removesuffix(_DAPO_SUFFIX)
        # DAPO-Math-17k repeats each of its 17k problems 100 times
        if (problem, str(answer)) not in seen:
            seen.add((problem, str(answer)))
            # fields: for a reward function
            rows.append({"problem": problem, "answer": answer, "fields": row})
    return rows, len(numbered) - len(rows)


def repeated_note(data: str, repeated: int, kept: int) -> str:
    """The console note for rows of `data` dropped because they repeat an earlier row (kept: the
    rows left)."""
    return (f"{data}: dropped {repeated:,} of {repeated + kept:,} rows that repeat an earlier "
            f"row's problem and answer; "
            + ("1 row remains" if kept == 1 else f"{kept:,} rows remain"))


def describe(value) -> str:
    """How a JSON value is named in an error: 'a JSON object', 'a boolean', 'the number 3', ..."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, list):
        return "a list"
    return f"the text {value!r}" if isinstance(value, str) else type(value).__name__


def answer_value(value) -> str | list[str]:
    """A gold answer as reward.grade takes it: a string, a finite number as a string
    (27.0 -> "27.0") or a list of strings (several answers). Anything else (a JSON object, a
    boolean, NaN, a list of numbers, an empty or unencodable string) raises ValueError saying
    what it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"the answer is {value}, not a finite number")
        return str(value)
    if isinstance(value, str) and value.strip():
        check_utf8(value, "answer")
        return value
    if isinstance(value, list) and value and all(isinstance(a, str) and a.strip() for a in value):
        for a in value:
            check_utf8(a, "answer")
        return value
    what = ("a list that is not all non-empty strings" if isinstance(value, list)
            else describe(value))
    raise ValueError(f"the answer is {what}; an answer is a string, a finite number "
                     f"or a list of strings")


def check_utf8(text: str, what: str) -> None:
    """Raise ValueError when `text` cannot be written as UTF-8 (a lone surrogate such as \\ud800 is
    valid JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the {what} holds the lone surrogate {text[e.start]!r} at character "
                         f"{e.start + 1}, which is not UTF-8 text") from None


# An error's words for JSON nested deeper than the json module reads (its recursion limit).
TOO_DEEP = "nested too deeply to read (about 1,000 levels at most)"


def parse_json(text: str, where: str, detail=lambda e: f"{e.msg} at character {e.pos + 1}",
               hint: str = ""):
    """json.loads(text); a text that is not JSON raises ValueError `WHERE: not JSON (DETAIL)HINT`
    (detail(e): where it breaks), one nested too deeply ValueError `WHERE: nested too deeply
    ...`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({detail(e)}){hint}") from None
    except RecursionError:
        raise ValueError(f"{where}: {TOO_DEEP}") from None


def read_jsonl(path: str) -> list[tuple[str, dict]]:
    """The rows of a JSON-lines file as ("line N", row), N counted from 1 as an editor does (blank
    lines skipped); a line that is not a UTF-8 JSON object raises ValueError naming the file
    and the line."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {n}: not UTF-8 "
                                 f"({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            row = parse_json(text, f"{path} line {n}")
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: not a JSON object")
            rows.append((f"line {n}", row))
    return rows
