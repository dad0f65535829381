"""Convert a GGUF file into a Hugging Face model directory (fp32 safetensors + tokenizer.json + config).

Done once per file and cached under `$PDSERVE_CACHE_DIR` (default `~/.cache/pdserve`), keyed by the file's
path, size and mtime. The result is a plain HF directory: pdserve loads it like any other, and peers such
as vLLM or transformers can serve exactly the same weights from it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import xxhash
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pdserve.errors import PdserveError, UnsupportedModelError
from pdserve.model.gguf_tokenizer import build_tokenizer

CONVERTER_VERSION = "1"
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def convert_gguf_cached(path: Path, in_child: bool = False) -> Path:
    """The converted directory of GGUF `path`, converting it first if no earlier run did. `in_child`: convert
    in a child process, so a long-lived caller (the server's gateway) does not keep the ~400 MB the
    conversion leaves in its heap."""
    path = path.resolve()
    st = path.stat()
    key = xxhash.xxh64(f"{path}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()
    out = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    if in_child:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(convert_gguf_cached, path).result()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    except OSError as e:
        raise _unwritable(out, e) from None
    try:
        convert_gguf(path, tmp)
        # mkdtemp and safetensors make private files; peers running as other users read them too
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        os.replace(tmp, out)  # atomic: a concurrent start sees either nothing or a whole directory
    except OSError as e:
        if not (out / "config.json").is_file():  # else a concurrent start won the race: use its result
            raise _unwritable(out, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unwritable(out: Path, e: OSError) -> PdserveError:
    return PdserveError(f"cannot write the converted model to {str(out)!r} ({e.strerror or e}); "
                        "set PDSERVE_CACHE_DIR to a writable directory")


def convert_gguf(path: Path, out_dir: Path) -> None:
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueErrors/struct errors on junk
        raise UnsupportedModelError(f"{str(path)!r} is not a readable GGUF file: {e}") from None
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})")
    config = _hf_config(meta, arch, {t.name for t in reader.tensors})
    tensors = _hf_tensors(reader, arch, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer, tokenizer_config = build_tokenizer(meta, config["max_position_embeddings"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


class _Metadata:
    def __init__(self, reader: GGUFReader) -> None:
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()


def _hf_config(meta: _Metadata, arch: str, tensor_names: set[str]) -> dict:
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError("GGUF with rope_freqs (Llama-3.1 rope scaling) is not supported; "
                                    "use the Hugging Face directory of the model instead")
    heads = meta.get(f"{arch}.attention.head_count")
    hidden = meta.get(f"{arch}.embedding_length")
    config = {
        "architectures": [_ARCHS[arch][0]], "model_type": _ARCHS[arch][1], "hidden_act": "silu",
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens")),
        "hidden_size": hidden, "intermediate_size": meta.get(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.get(f"{arch}.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"), "torch_dtype": "float32",
    }
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.get(f"{arch}.rope.scaling.factor"))}
    return config


def _hf_tensors(reader: GGUFReader, arch: str, config: dict) -> dict[str, np.ndarray]:
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)]) if data.ndim != len(t.shape) else data
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp interleaves q/k rows for its rope layout; undo it for the half-split (HF) layout.
            n = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            data = _unpermute(data, n)
        tensors[name] = np.ascontiguousarray(data)
    return tensors


def raw_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """The file's tensors as stored (HF name -> (GGUF type name, uint8 rows [n, bytes per row])), q/k rows in
    the HF order as `convert_gguf` writes them (quantized weights keep the file's blocks: `pdserve.model.quant`)."""
    reader = GGUFReader(str(path))
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    heads = meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    out = {}
    for t in reader.tensors:
        name, data = _hf_name(t.name), t.data
        if data.dtype == np.uint8 and data.ndim == 2:
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                data = _unpermute(data, heads if "q_proj" in name else kv_heads)
            out[name] = (t.tensor_type.name, data)
    return out


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
