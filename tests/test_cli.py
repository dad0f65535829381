"""The CLI as a user runs it: real subprocesses, the embedded model, one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_no_blocks_held
from pdserve.errors import ContextLengthExceededError, ModelNotFoundError, UnsupportedModelError


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0]


def write_gguf(path, arch: str) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_generate_and_chat_on_default_model():
    gen = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8")
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in gen.stdout
    chat = run_cli("chat", "--message", "What is the capital of France? Answer in one word.",
                   "--max-tokens", "8")
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    assert "<|im_" not in chat.stdout  # the template's special tokens are not printed


@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "-3"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--max-model-len", "8"], "maximum context length"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--block-size", "0"], "block_size"),
    (["--kv-cache-gb", "-1"], "kv_cache_gb"),
])
def test_bad_input_gives_one_line_error(args, needle):
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    assert_one_line_error(run_cli("generate", "--prompt", prompt, *args), needle)


def test_unsupported_gguf_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "falcon.gguf"
    write_gguf(bad, "falcon")
    assert_one_line_error(run_cli("generate", "--prompt", "hi", "--model", str(bad)), "falcon")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    assert_one_line_error(run_cli("generate", "--prompt", "hi", "--model", str(junk)), "GGUF")


def test_python_api_errors(tmp_path, tiny_llama_dir):
    from pdserve import LLM, SamplingParams
    with pytest.raises(ModelNotFoundError):
        LLM(str(tmp_path))  # a directory without config.json
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModelError):
        LLM(str(tmp_path / "weights.bin"))
    llm = LLM(str(tiny_llama_dir), max_model_len=32)
    with pytest.raises(ContextLengthExceededError):
        llm.generate([list(range(100, 140))], SamplingParams(max_tokens=4))
    # The engine is still usable after a rejected request, and generation stops at the context limit.
    out = llm.generate([list(range(100, 120))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert_no_blocks_held(llm.engine)


def test_unwritable_conversion_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should go")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocker))
    assert_one_line_error(run_cli("generate", "--prompt", "hi"), "PDSERVE_CACHE_DIR")
