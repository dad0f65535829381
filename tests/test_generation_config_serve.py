"""A first answer worth reading (`--generation-config`, issue 44 item 5), end to end: real `pdserve serve`
processes, the official `openai` SDK as the client.

A chat request with no sampling fields takes the model's defaults (the embedded SmolLM2: its card's temperature 0.2,
top_p 0.9) and names fruits; the defaults in force are said at start and shown in /v1/models; a field the request
sets wins and only the unset ones take the defaults (seeded samples of two servers compared token for token);
`--generation-config vllm` restores OpenAI's 1.0; a Hugging Face directory's generation_config.json is used; a bad
path is a one-line error.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from pdserve.bench.server_proc import free_port
from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FRUITS = ("apple", "banana", "orange", "grape", "strawberr", "mango", "pear", "cherr", "pineapple", "lemon", "peach",
          "kiwi", "watermelon", "blueberr", "plum", "lime")
ASK = [{"role": "user", "content": "Name three fruits."}]
LIGHT = ("--mode", "colocated", "--kv-cache-gb", "0.25", "--kv-host-gb", "0", "--num-threads", "1")
SEEDS = (0, 1, 2)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def chat(server: Server, max_tokens: int = 24, top_k: int | None = None, **fields) -> str:
    """The reply to "Name three fruits." with only `fields` set (no sampling field unless given)."""
    extra = {"extra_body": {"top_k": top_k}} if top_k is not None else {}
    resp = client(server).chat.completions.create(model=server.model, messages=ASK, max_tokens=max_tokens, **fields,
                                                  **extra)
    return resp.choices[0].message.content


def defaults_shown(server: Server) -> dict:
    return client(server).models.list().data[0].model_extra["sampling_defaults"]


def fruits_named(text: str) -> set[str]:
    return {f for f in FRUITS if f in text.lower()}


@pytest.fixture(scope="module")
def auto_server():
    server = Server(*LIGHT)  # --generation-config auto, the default
    server.model = MODEL
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server():
    server = Server(*LIGHT, "--generation-config", "vllm")
    server.model = MODEL
    yield server
    server.stop()


def test_a_first_answer_names_fruits_with_the_models_own_defaults(auto_server):
    card = "the SmolLM2-135M-Instruct model card's recommendation"
    assert (f"Default sampling parameters have been overridden by {card}: temperature=0.2, top_p=0.9"
            in auto_server.output())
    assert defaults_shown(auto_server) == {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "source": card}
    for seed in SEEDS:  # sampled at 0.2 (seeded: the same samples every run), each answer, not one lucky one
        reply = chat(auto_server, seed=seed)
        assert len(fruits_named(reply)) >= 2, reply


def test_set_fields_win_and_only_unset_fields_take_the_defaults(auto_server, vllm_server):
    assert "OpenAI's (temperature 1.0, top_p 1.0)" in vllm_server.output()
    assert defaults_shown(vllm_server) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                           "source": "none from the model (--generation-config vllm)"}
    greedy = chat(vllm_server, temperature=0)
    assert chat(auto_server, temperature=0) == greedy  # temperature 0 set: greedy, not 0.2
    for seed in SEEDS:  # a seeded sample is the same on both servers when both sample alike
        # vllm: nothing set is 1.0 / 1.0; auto with both set to that is not overridden
        assert chat(auto_server, temperature=1.0, top_p=1.0, seed=seed) == chat(vllm_server, seed=seed)
        # auto with temperature set and top_p unset: the model's top_p 0.9
        assert chat(auto_server, temperature=1.0, seed=seed) == chat(vllm_server, temperature=1.0, top_p=0.9,
                                                                     seed=seed)
        # nothing set: the card's 0.2 / 0.9
        assert chat(auto_server, seed=seed) == chat(vllm_server, temperature=0.2, top_p=0.9, seed=seed)
    # (the comparisons above tell the settings apart: OpenAI's 1.0 samples other answers than 0.2 does)
    assert [chat(vllm_server, seed=s) for s in SEEDS] != [chat(auto_server, seed=s) for s in SEEDS]


def _export(tmp_path) -> str:
    out = tmp_path / "smollm2-hf"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "export-hf", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return str(out)


def test_a_hugging_face_directorys_generation_config_is_used(tmp_path):
    model = _export(tmp_path)
    path = f"{model}/generation_config.json"
    with open(path) as f:
        config = json.load(f)
    # top_k 1: whatever the temperature, the greedy token, so the answer shows the file was used
    with open(path, "w") as f:
        json.dump({**config, "temperature": 0.7, "top_k": 1, "repetition_penalty": 1.1}, f)
    server = Server(*LIGHT, "--model", model)
    server.model = "smollm2-hf"
    try:
        line = next(x for x in server.output().splitlines() if x.startswith("Default sampling parameters"))
        assert line.startswith(f"Default sampling parameters have been overridden by the generation config {path!r}: "
                               "temperature=0.7, top_k=1"), line
        assert "not applied (pdserve does not do them): repetition_penalty=1.1" in line
        assert defaults_shown(server) == {"temperature": 0.7, "top_p": 1.0, "top_k": 1,
                                          "source": f"the generation config {path!r}"}
        greedy = chat(server, temperature=0)
        assert [chat(server, seed=s) for s in SEEDS] == [greedy] * len(SEEDS)
        # top_k set: 0.7 over the whole vocabulary
        assert [chat(server, seed=s, top_k=0) for s in SEEDS] != [greedy] * len(SEEDS)
    finally:
        server.stop()


def test_a_bad_path_is_a_one_line_error(tmp_path):
    bad = tmp_path / "generation_config.json"
    bad.write_text("{not json")
    for path, needle in ((tmp_path / "absent", "does not exist"), (bad, "is not JSON")):
        proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--generation-config", str(path),
                               "--port", str(free_port())], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith(f"error: --generation-config: {str(path)!r}") and needle in proc.stderr


def _cli_chat(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "chat", "--message", ASK[0]["content"], "--max-tokens",
                           "24", "--num-threads", "1", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_pdserve_chat_takes_the_same_defaults(tmp_path):
    reply = _cli_chat()  # the card's 0.2 / 0.9
    assert len(fruits_named(reply)) >= 2, reply
    # a flag not given takes the file's value: temperature 2 from the file samples as --temperature 2 does
    path = tmp_path / "generation_config.json"
    path.write_text('{"temperature": 2.0}')
    hot = _cli_chat("--generation-config", str(path), "--seed", "4")
    assert hot == _cli_chat("--temperature", "2", "--top-p", "1", "--seed", "4")
    assert hot != _cli_chat("--generation-config", "vllm")  # (greedy: this command's own default)
