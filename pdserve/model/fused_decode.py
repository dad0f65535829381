"""A whole decode step on quantized weights in one compiled call (`kernels.c`: pd_qdecode_forward).

Run layer by layer, a decode step makes about ten kernel calls per layer (RMSNorm, four matmuls, rotary + KV
write, attention, SiLU·up, two residual adds), each a ctypes call, a tensor or two allocated and an OpenMP
region opened: at batch 1 on the default model's 30 layers that is a few milliseconds of a ~14 ms step. Here
the decoder layers run in one parallel region with the same kernels and loops (the results are the same bit for
bit, `tests/test_quant_kernels.py`), on scratch rows allocated once per batch size.

It serves a step when the model's every layer is on quantized blocks the kernel serves and the step is decodes
only, on the compiled attention backend, with no KV codec or residual window and no per-layer callback (a
prefill worker's): a decision per step; any other step runs layer by layer (`LlamaModel.forward`).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.model import kernels, quant

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _QLinear(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("fmt", _I), ("n", _I), ("k", _I)]


class _QLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear),
                ("down", _QLinear), ("k_cache", _P), ("v_cache", _P)]


_SCRATCH = ("h", "qkv", "q", "k", "attn", "o", "gu", "act", "dn")


class _QStep(ctypes.Structure):
    _fields_ = [("x", _P), ("cos", _P), ("sin", _P), ("slot_rows", _P), ("rows", _P), ("lens", _P),
                *((name, _P) for name in _SCRATCH), ("qscratch", _P),
                *((name, _I) for name in ("t", "hidden", "hq", "hkv", "d", "inter", "bs", "max_blocks", "i8")),
                ("eps", _F), ("scale", _F)]


def _linear(lin: quant.QuantLinear) -> _QLinear:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return _QLinear(lin.panels.data_ptr(), bias, quant.KINDS[lin.kind], lin.n, lin.k)


class FusedDecode:
    """pd_qdecode_forward for one `LlamaModel`; `build` says whether the model can use it at all."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.model = model
        self.dims = dict(hidden=cfg.hidden_size, hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim,
                         inter=model.layers[0].down.k)
        linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.max_rows = min(lin.max_rows for lin in linears)
        self.i8_rows = quant.i8_rows("q8_0") if any(lin.kind == "q8_0" for lin in linears) else (1, 0)
        self.paths = {i8: _paths(linears, i8) for i8 in (False, True)}
        self.num_layers = len(model.layers)
        self.layers_key: tuple | None = None
        self.layers = None
        self.steps: dict[int, _QStep] = {}
        self.held: list[torch.Tensor] = []  # the scratch rows, for `capacity` rows
        self.capacity = 0

    @staticmethod
    def build(model) -> FusedDecode | None:
        """The fused step for `model`, or None when its layers cannot use it (fp32 or mixed layers, no kernel, the
        torch attention backend): a decision, logged once."""
        linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not linears or model.attention.name != "cpu_kernels" or not kernels.available():
            return None
        if not all(isinstance(lin, quant.QuantLinear) and lin.max_rows > 0 for lin in linears):
            kernels.decide("decode steps layer by layer: not every linear layer is on quantized kernel blocks")
            return None
        kernels.decide("decode steps on quantized weights: one compiled call per step (fused_decode)")
        return FusedDecode(model)

    def serves(self, meta, rows: int, layer_done) -> bool:
        """Whether this step (`rows` tokens) can run fused."""
        return (layer_done is None and not meta.prefills and meta.num_decodes == rows and 0 < rows <= self.max_rows
                and meta.codec is None and meta.residual is None and meta.decode_lens is not None
                and kernels.available())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
            meta) -> None:
        """x: [T, H] (updated in place through every decoder layer); cos, sin: [T, 1, D]; as LlamaModel.forward."""
        t = x.shape[0]
        step, _ = self._step(t)
        hkv = self.dims["hkv"]
        i8 = self.i8_rows[0] <= t <= self.i8_rows[1]
        step.x, step.cos, step.sin = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        step.slot_rows, step.rows, step.lens = (meta.slot_rows.data_ptr(), meta.decode_rows.data_ptr(),
                                                meta.decode_lens.data_ptr())
        step.max_blocks, step.bs, step.i8 = meta.decode_rows.numel() // (hkv * t), kv_caches[0].shape[3], i8
        kernels.qdecode_forward(self._layers(kv_caches), self.num_layers, step)
        for (part, path), calls in self.paths[i8].items():
            kernels.used(part, path, calls)

    def _layers(self, kv_caches: list[torch.Tensor]):
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self.layers_key:
            if not all(c.is_contiguous() and c.dtype is torch.float32 for c in kv_caches):
                raise ValueError("the fused decode step needs contiguous fp32 KV caches")
            layers = (_QLayer * self.num_layers)()
            for out, layer, cache in zip(layers, self.model.layers, kv_caches):
                out.attn_norm, out.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
                out.qkv, out.o = _linear(layer.qkv), _linear(layer.o)
                out.gate_up, out.down = _linear(layer.gate_up), _linear(layer.down)
                out.k_cache, out.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            self.layers, self.layers_key = layers, key
        return self.layers

    def _step(self, t: int) -> tuple[_QStep, list[torch.Tensor]]:
        """The step structure for `t` rows (made once per row count) over one set of scratch rows shared by every
        row count, grown to the most rows seen (the kernel lays out its first `t` rows: a bigger buffer serves)."""
        if t > self.capacity:
            dm = self.dims
            widths = dict(h=dm["hidden"], qkv=(dm["hq"] + 2 * dm["hkv"]) * dm["d"], q=dm["hq"] * dm["d"],
                          k=dm["hkv"] * dm["d"], attn=dm["hq"] * dm["d"], o=dm["hidden"], gu=2 * dm["inter"],
                          act=dm["inter"], dn=dm["hidden"])
            self.held = [torch.empty(t, widths[name]) for name in _SCRATCH]
            self.held.append(kernels.qscratch(t, max(dm["hidden"], dm["inter"], dm["hq"] * dm["d"])))
            self.capacity, self.steps = t, {}  # structures of smaller row counts pointed into the old buffers
        if t not in self.steps:
            dm, cfg = self.dims, self.model.config
            self.steps[t] = _QStep(*([None] * 6), *(h.data_ptr() for h in self.held), t, dm["hidden"], dm["hq"],
                                   dm["hkv"], dm["d"], dm["inter"], 0, 0, 0, cfg.rms_norm_eps, self.model.scale)
        return self.steps[t], self.held


def _paths(linears: list[quant.QuantLinear], i8: bool) -> dict[tuple[str, str], int]:
    """The calls one fused step makes of each part and path (`kernels.paths_used()`), as the layer-by-layer
    step counts them."""
    layers = len(linears) // 4
    paths = {("decode_step", "fused"): 1, ("add_rms_norm", "kernel"): 2 * layers,
             ("rope_write_kv", "kernel"): layers, ("decode_attention", "kernel"): layers,
             ("silu_mul", "kernel"): layers}
    for lin in linears:
        key = ("gemm", lin.path(kernels.FMT_Q8_0_I8 if i8 and lin.kind == "q8_0" else quant.KINDS[lin.kind]))
        paths[key] = paths.get(key, 0) + 1
    return paths
