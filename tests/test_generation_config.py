"""`--generation-config auto|vllm|PATH` (`pdserve.model.generation_config`): which defaults the sampling fields a
request leaves unset take, read from real files; a field the request sets always wins; bad input is one line.
No model load (the end-to-end checks on a real server: tests/test_generation_config_serve.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.core.sampling_params import SamplingDefaults
from pdserve.core.settings import GenerationSettings
from pdserve.errors import InvalidRequestError
from pdserve.model.generation_config import EMBEDDED_MODEL_DEFAULTS, sampling_defaults
from pdserve.model.loader import default_model_path
from pdserve.server.protocol import ChatRequest, CompletionRequest, sampling_params

CARD = {"temperature": 0.2, "top_p": 0.9}  # the SmolLM2-135M-Instruct model card's generate() call
# what a Qwen2.5-Instruct directory ships (its generation_config.json), with the token ids trimmed
QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def _hf_dir(tmp_path, config: dict | None, name: str = "model"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    if config is not None:
        (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_auto_takes_the_embedded_models_card_recommendation():
    for model in (None, str(default_model_path())):
        d = sampling_defaults("auto", model, "/unused")
        assert d.values == CARD == EMBEDDED_MODEL_DEFAULTS and "model card" in d.source
        assert d.in_force() == {**CARD, "top_k": 0, "source": d.source}
    assert "overridden" in d.line() and "temperature=0.2, top_p=0.9" in d.line()


def test_auto_reads_a_hugging_face_directorys_generation_config(tmp_path):
    d = sampling_defaults("auto", str(tmp_path / "model"), _hf_dir(tmp_path, QWEN))
    assert d.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert d.ignored == ("repetition_penalty=1.05",)  # set, not done by pdserve: said, not dropped silently
    assert "repetition_penalty=1.05" in d.line() and "temperature=0.7, top_p=0.8, top_k=20" in d.line()
    # a file that sets no sampling field, and a directory without one: OpenAI's defaults, said so
    for config, why in (({"bos_token_id": 1, "eos_token_id": 2}, "sets none"), (None, "no generation_config.json")):
        d = sampling_defaults("auto", "m", _hf_dir(tmp_path, config, f"m{why[:2]}"))
        assert d.values == {} and why in d.source
        assert d.in_force() == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "source": d.source}
        assert d.line().startswith("Default sampling parameters: OpenAI's")


def test_vllm_takes_nothing_from_the_model(tmp_path):
    for model, model_dir in ((None, "/unused"), ("m", _hf_dir(tmp_path, QWEN))):
        d = sampling_defaults("vllm", model, model_dir)
        assert d.values == {} and d.in_force()["temperature"] == 1.0 and "--generation-config vllm" in d.line()


def test_a_path_is_a_file_or_the_directory_holding_one(tmp_path):
    model_dir = _hf_dir(tmp_path, QWEN)
    for path in (tmp_path / "model", tmp_path / "model" / "generation_config.json"):
        d = sampling_defaults(str(path), None, "/unused")  # the path wins over the embedded model's card
        assert d.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
        assert str(model_dir / "generation_config.json") in d.source


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "is not a JSON object"),
    ('{"temperature": 5}', "temperature must be in [0, 2], got 5"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"top_p": 0}', "top_p must be in (0, 1]"),
    ('{"top_k": -2}', "top_k must be -1, 0 or a positive integer"),
    (b"\xff\xfe", "cannot read"),
])
def test_a_bad_path_or_file_is_one_message_naming_it(tmp_path, content, needle):
    path = tmp_path / "generation_config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(InvalidRequestError) as e:
        sampling_defaults(str(path), None, "/unused")
    assert e.value.message.startswith("--generation-config: ") and needle in e.value.message
    assert str(path) in e.value.message and "\n" not in e.value.message and e.value.param == "generation_config"


def test_a_directory_without_the_file_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="holds no generation_config.json"):
        sampling_defaults(str(tmp_path), None, "/unused")
    with pytest.raises(InvalidRequestError, match="must be auto, vllm or a path"):
        GenerationSettings(generation_config="")


def _params(model, body: dict, defaults: SamplingDefaults):
    """The sampling params a request body (as JSON gives it) gets under `defaults`."""
    req = model.model_validate_json(json.dumps(body))
    return sampling_params(req, 16, None, defaults)


@pytest.mark.parametrize("model,body", [
    (ChatRequest, {"messages": [{"role": "user", "content": "Name three fruits."}]}),
    (CompletionRequest, {"prompt": "Three fruits:"}),
])
def test_a_requests_unset_fields_take_the_defaults_and_its_set_fields_win(model, body):
    card = SamplingDefaults(dict(CARD), "card")
    p = _params(model, body, card)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 0)
    p = _params(model, {**body, "temperature": None, "top_p": None}, card)  # null is unset, as in vLLM
    assert (p.temperature, p.top_p) == (0.2, 0.9)
    p = _params(model, {**body, "temperature": 0}, card)  # set to the neutral-looking value: still set
    assert (p.temperature, p.top_p) == (0.0, 0.9)
    p = _params(model, {**body, "temperature": 1.0, "top_p": 1.0, "top_k": 5}, SamplingDefaults(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20}, "qwen"))
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 5)
    p = _params(model, body, SamplingDefaults())  # vllm: OpenAI's
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return {a.dest: a for a in sub.choices[command]._actions}  # noqa: SLF001


def test_the_flag_is_on_the_commands_that_fill_in_requests_only():
    want = GenerationSettings.__dataclass_fields__["generation_config"]
    for command in ("serve", "generate", "chat"):
        action = _actions(command)["generation_config"]
        assert action.option_strings == ["--generation-config"] and action.default == "auto" == want.default
        assert action.help == want.metadata["help"]
    for command in ("worker", "check-kv", "profile"):  # a worker samples what its gateway filled in
        assert "generation_config" not in _actions(command)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [("generate", "--prompt", "hi"), ("chat", "--message", "hi")],
                         ids=lambda c: c[0])
def test_a_bad_path_is_a_one_line_cli_error_before_the_model_loads(tmp_path, command):
    bad = tmp_path / "generation_config.json"
    bad.write_text('{"temperature": 3}')
    for path, needle in ((tmp_path / "none", "does not exist"), (bad, "temperature must be in [0, 2]")):
        proc = _cli(*command, "--generation-config", str(path))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: --generation-"), \
            proc.stderr
        assert needle in proc.stderr and str(path) in proc.stderr
