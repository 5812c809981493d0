"""A GGUF file loaded as a plain Hugging Face model (docs/paper.md §2 and "Deliberate differences":
D19; docs/model.md#loading): de-quantized to float32 and rebuilt, so that it trains and saves
like any other, its EOS read from the file, and converted once: the HF folder is cached by the
file's content and the converter's versions, and written into place by one rename
(`gguf_cache_dir`). model.py's `load_model` reads "smollm2" and every .gguf file through
`load_gguf`.
"""
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_gguf(path):  # D19
    """A GGUF file -> a plain (unquantized, savable) HF model and its tokenizer, converted once: the
    HF folder is kept in the cache (`gguf_cache_dir`) and read from there afterwards (SmolLM2-135M:
    ~45 s of GGUF parsing the first time, ~2 s from the cache)."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ImportError(f"loading a GGUF file needs {' and '.join(missing)}: "
                          f"pip install {' '.join(missing)}")
    cached = gguf_cache_dir(path)
    if os.path.isfile(os.path.join(cached, "config.json")):
        return (AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32),
                AutoTokenizer.from_pretrained(cached))
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # EOS from the file's metadata: transformers 5.17 makes SmolLM2's BOS (<|im_start|>) its EOS
    import gguf
    field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.eos_token_id")
    if field is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))
    gguf_lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers won't save GGUF models (marked quantized): rebuild a plain one from the weights.
    config = gguf_lm.config
    del config.quantization_config
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.load_state_dict(gguf_lm.state_dict())
    _save_into_place(cached, lm, tokenizer)
    return lm, tokenizer


def _save_into_place(folder: str, *parts) -> bool:
    """`save_pretrained` each of `parts` into a private folder, then rename it to `folder`: a reader
    never sees half a folder, and of concurrent writers the first rename wins. False (and nothing
    left behind) when the cache is read-only or another process's folder is already there."""
    partial = f"{folder}.partial-{os.getpid()}"
    try:
        for part in parts:
            part.save_pretrained(partial)
        os.replace(partial, folder)
        return True
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        return False


def gguf_cache_dir(path: str) -> str:
    """Where the HF folder converted from the GGUF file `path` is cached: $STAPO_CACHE (default
    ~/.cache/stapo), one folder per file content (its SHA-256: every copy of the file, e.g. the one
    each virtual environment installs, shares one folder whatever its path or modification time) and
    converter (the transformers and gguf versions that read it: another version may convert
    differently)."""
    import transformers

    root = os.environ.get("STAPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stapo")
    st = os.stat(path)
    digest = _file_sha256(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    return os.path.join(root, f"{os.path.basename(path)}-{digest[:16]}-"
                              f"transformers{transformers.__version__}-"
                              f"gguf{importlib.metadata.version('gguf')}")


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file (~0.1 s for SmolLM2's 98 MB), once per process for the same path, size and
    mtime."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
