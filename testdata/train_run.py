"""train.py in a fresh process, as the multi-process and signal tests run it (tests/toy_task.py's
`run_train`).

    python testdata/train_run.py [train.py flags]  # one train.main, on the toy task
    python testdata/train_run.py --runs FILE
        # one train.main per argument list of the JSON file FILE,
        # in this process and on one process group
    torchrun --standalone --nproc_per_node=2 testdata/train_run.py [flags]

The toy task (tests/toy_task.py's `patch_toy_task`, here for another process): a tiny random model
whose 14-row vocabulary is the 4 special tokens and the 10 digits, with a reward on the first
character of the response. Environment: TOY_REWARD = even (an even digit: about half right, groups
of mixed rewards) | answer (the sum) | real (no toy task: the model and reward the flags name);
TOY_HEAD_DIM = 16 (vLLM's CPU attention needs 64); TOY_HOOK = a JSON [name, [args]] of a function of
tests/run_hooks.py called before training (a stop signal at a chosen call, a kill inside a
checkpoint write, a log of the micro-batch counts)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model  # noqa: E402
import reward  # noqa: E402
import startup.run  # noqa: E402
import train  # noqa: E402

VOCAB = 14
CHECKS = {"even": lambda response, gold: response.strip()[:1] in ("0", "2", "4", "6", "8"),
          "answer": lambda response, gold: response.strip()[:1] == gold}
task = os.environ.get("TOY_REWARD", "even")
if task != "real":
    reward.reward = lambda response, gold, mode="dapo": \
        1.0 if CHECKS[task](response, gold) else -1.0
    head_dim = int(os.environ.get("TOY_HEAD_DIM", 16))
    # any text (the built-in task's prompts): all 104 characters
    if os.environ.get("TOY_VOCAB") == "full":
        startup.run.load_model = lambda name, **kw: (model.tiny_model(head_dim=head_dim),
                                                     model.tiny_tokenizer())
    else:  # the toy task's digits
        startup.run.lm_vocab_size = lambda tokenizer: VOCAB
        startup.run.load_model = lambda name, **kw: (
            model.tiny_model(vocab_size=VOCAB, head_dim=head_dim), model.tiny_tokenizer())
# a quiet machine: no oversubscription warning in the outputs tests read
os.getloadavg = lambda: (0.0, 0.0, 0.0)
if os.environ.get("TOY_HOOK"):
    from tests import run_hooks

    name, args = json.loads(os.environ["TOY_HOOK"])
    getattr(run_hooks, name)(*args)
runs = json.loads(Path(sys.argv[2]).read_text()) if sys.argv[1:2] == ["--runs"] else [sys.argv[1:]]
# one process group for every run: destroying and re-creating it between runs can hang gloo
if len(runs) > 1:
    group = train.init_distributed()
    train.init_distributed, train.dist.destroy_process_group = \
        lambda timeout_min=60: group, lambda: None
code = 0
for argv in runs:
    code = code or train.main(argv)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # as train.py's __main__ does: no interpreter teardown racing torch's gloo threads
