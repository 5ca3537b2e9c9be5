"""A CPU stand-in for the part of Transformer Engine's PyTorch API MegaTier uses, for tests on machines without it.

``install(monkeypatch)`` puts ``transformer_engine``, ``transformer_engine.pytorch`` and
``transformer_engine.common.recipe`` into ``sys.modules`` for one test. The layers follow TE's documented
constructors and parameter names and registration order (``layer_norm_weight``, ``layer_norm_bias``, ``weight``,
``bias``; ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias``; ``<name>_weight`` per entry of
``parameters_split``, whose sizes are the whole layer's and are divided by tp), TE's per-rank shapes under
``tp_size`` (column parallel: output rows / tp, row parallel: input columns / tp), ``normalization`` LayerNorm or
RMSNorm (no ``layer_norm_bias``), ``activation`` gelu (tanh) or swiglu (SiLU of the first half of fc1's output
times the second, fc1 twice as tall), and TE's function at tp 1, reading their parameters by attribute as TE's
forward does. ``autocast`` records the recipe each layer's forward ran under in
``state["fp8_recipes"]`` of the installed ``transformer_engine.pytorch``.
"""
from __future__ import annotations

import contextlib
import enum
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


def _state() -> dict:
    return sys.modules["transformer_engine.pytorch"].state


def _param(*shape, device, dtype, init=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype or torch.get_default_dtype()))
    if init is not None:
        init(p)
    return p


class _Base(nn.Module):
    def __init__(self, tp_size: int, tp_group) -> None:
        super().__init__()
        self.tp_size, self.tp_group = tp_size, tp_group

    def _ran(self) -> None:
        if self.tp_size != 1:
            raise NotImplementedError("the fake TE computes at tp 1 only")
        _state()["fp8_recipes"].append(_state()["recipe"])

    def _norm_parameters(self, size: int, normalization: str, eps: float, device, dtype) -> None:
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {normalization!r}")
        self.eps, self.normalization = eps, normalization
        self.layer_norm_weight = _param(size, device=device, dtype=dtype, init=nn.init.ones_)
        if normalization == "LayerNorm":
            self.layer_norm_bias = _param(size, device=device, dtype=dtype, init=nn.init.zeros_)
        else:
            self.layer_norm_bias = None

    def _ln(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps)


class LayerNormLinear(_Base):
    def __init__(self, in_features, out_features, eps=1e-5, *, tp_group=None, tp_size=1, bias=True,
                 normalization="LayerNorm", parallel_mode=None, parameters_split=None, params_dtype=None,
                 device="cuda", init_method=None):
        super().__init__(tp_size, tp_group)
        self._norm_parameters(in_features, normalization, eps, device, params_dtype)
        splits = dict(parameters_split or {"": out_features})
        if sum(splits.values()) != out_features:
            raise ValueError(f"split sizes {list(splits.values())} do not add up to out_features={out_features}")
        prefixes = [f"{name.rstrip('_')}_" if name else "" for name in splits]
        sizes = [size // tp_size if parallel_mode == "column" else size for size in splits.values()]
        self.weight_names, self.bias_names = [p + "weight" for p in prefixes], [p + "bias" for p in prefixes]
        for name, size in zip(self.weight_names, sizes):  # all weights, then all biases, as TE registers them
            setattr(self, name, _param(size, in_features, device=device, dtype=params_dtype, init=init_method))
        for name, size in zip(self.bias_names, sizes):
            setattr(self, name, _param(size, device=device, dtype=params_dtype, init=nn.init.zeros_) if bias else None)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._ran()
        weight = torch.cat([getattr(self, n) for n in self.weight_names])
        biases = [getattr(self, n) for n in self.bias_names]
        bias = torch.cat(biases) if biases[0] is not None else None
        return F.linear(self._ln(inp), weight, bias)


class Linear(_Base):
    def __init__(self, in_features, out_features, *, tp_group=None, tp_size=1, bias=True, parallel_mode=None,
                 params_dtype=None, device="cuda", init_method=None):
        super().__init__(tp_size, tp_group)
        in_local = in_features // tp_size if parallel_mode == "row" else in_features
        out_local = out_features // tp_size if parallel_mode == "column" else out_features
        self.weight = _param(out_local, in_local, device=device, dtype=params_dtype, init=init_method)
        self.bias = _param(out_features, device=device, dtype=params_dtype, init=nn.init.zeros_) if bias else None

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._ran()
        return F.linear(inp, self.weight, self.bias)


class LayerNormMLP(_Base):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, *, tp_group=None, tp_size=1, bias=True,
                 normalization="LayerNorm", activation="gelu", set_parallel_mode=False, params_dtype=None,
                 device="cuda", init_method=None, output_layer_init_method=None):
        super().__init__(tp_size, tp_group)
        if activation not in ("gelu", "swiglu"):
            raise NotImplementedError(activation)
        self.activation = activation
        ffn = ffn_hidden_size // tp_size if set_parallel_mode else ffn_hidden_size
        fc1 = 2 * ffn if activation == "swiglu" else ffn
        self._norm_parameters(hidden_size, normalization, eps, device, params_dtype)
        self.fc1_weight = _param(fc1, hidden_size, device=device, dtype=params_dtype, init=init_method)
        self.fc1_bias = _param(fc1, device=device, dtype=params_dtype, init=nn.init.zeros_) if bias else None
        self.fc2_weight = _param(hidden_size, ffn, device=device, dtype=params_dtype, init=output_layer_init_method)
        self.fc2_bias = _param(hidden_size, device=device, dtype=params_dtype, init=nn.init.zeros_) if bias else None

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._ran()
        hidden = F.linear(self._ln(inp), self.fc1_weight, self.fc1_bias)
        if self.activation == "swiglu":
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh")  # TE's gelu
        return F.linear(hidden, self.fc2_weight, self.fc2_bias)


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    previous = _state()["recipe"]
    _state()["recipe"] = recipe if enabled else None
    try:
        yield
    finally:
        _state()["recipe"] = previous


def install(monkeypatch, *, version: str = "2.10.0", fp8: tuple[bool, str] = (True, "")) -> types.ModuleType:
    """Put the fake into sys.modules for one test; returns its ``transformer_engine.pytorch``."""
    root, pt = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    common, recipe = types.ModuleType("transformer_engine.common"), types.ModuleType("transformer_engine.common.recipe")
    root.__path__, common.__path__ = [], []
    root.__version__ = version
    root.pytorch, root.common, common.recipe = pt, common, recipe
    pt.LayerNormLinear, pt.Linear, pt.LayerNormMLP, pt.autocast = LayerNormLinear, Linear, LayerNormMLP, autocast
    pt.is_fp8_available = lambda return_reason=False: fp8 if return_reason else fp8[0]
    pt.state = {"recipe": None, "fp8_recipes": []}
    recipe.DelayedScaling, recipe.Format = DelayedScaling, Format
    for module in (root, pt, common, recipe):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return pt
