"""model_files/names.py: what --model accepts, checked without loading anything; a Hub id not in the
cache is refused at once where the Hub cannot be reached (no network in any test: the one request
is replaced)."""
import huggingface_hub
import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from model_files import names


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hub cache, the Hub allowed, and the one request recorded: it raises `answer`."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    calls = []

    def model_info(self, name, timeout=None):
        calls.append((name, timeout))
        if hub.answer is not None:
            raise hub.answer

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    hub.answer, hub.calls = httpx2.ConnectError("[Errno -2] Name or service not known"), calls
    return hub


def test_known_names_paths_and_malformed_ids_need_no_request(hub, tmp_path):
    names.check_model_name("tiny")
    with pytest.raises(FileNotFoundError, match="model directory not found: ./no/such/model"):
        names.check_model_name("./no/such/model")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        names.check_model_name(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError) as e:
        names.check_model_name("smol m2")
    assert str(e.value) == f"--model 'smol m2' is not {names.ACCEPTS}"
    assert "smollm2, tiny" in names.ACCEPTS and hub.calls == []


def test_hub_id_offline_or_unreachable_is_one_line_at_once(hub, monkeypatch):
    """The typo `smolm2`: offline, no request; online with no network, one request with a timeout
    and no retries; either way one line naming what --model accepts."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        names.check_model_name("smolm2")
    assert hub.calls == [] and "HF_HUB_OFFLINE" in str(e.value) and names.ACCEPTS in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError) as e:
        names.check_model_name("smolm2", "--models")
    assert hub.calls == [("smolm2", names.HUB_TIMEOUT_S)]
    assert str(e.value) == ("--models 'smolm2' is not in the local Hub cache and the Hub cannot be "
                            f"reached ([Errno -2] Name or service not known): give {names.ACCEPTS}")
    assert len(str(e.value).splitlines()) == 1


def test_hub_answers(hub):
    """A model the Hub has (or gates) passes; one it has not is one line."""
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co"))
    hub.answer = RepositoryNotFoundError("404 Client Error", response=response)
    with pytest.raises(ValueError, match="the Hub has no such model"):
        names.check_model_name("org/no-such-model")
    hub.answer = GatedRepoError("403 gated", response=response)
    names.check_model_name("org/gated")
    hub.answer = None
    names.check_model_name("Qwen/Qwen3-1.7B-Base")
    assert len(hub.calls) == 3


def test_cached_hub_id_passes_offline_without_a_request(hub, monkeypatch, tmp_path):
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names.check_model_name("org/cached")
    assert hub.calls == []
