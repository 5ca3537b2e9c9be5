"""GPU fast paths in the config: asked for and missing is one ConfigError naming the package and its install, before
any work; never a silent fallback. This machine has a CPU torch, no Transformer Engine and no apex; stand-ins of
those modules (tests/unit/model/fake_te.py for Transformer Engine) check the rules past the import."""
from __future__ import annotations

import sys
import types

import pytest

from megatier import fastpaths
from megatier.config import Config, ConfigError, validate
from megatier.config.fast_path_validation import check_fast_path_config
from tests.unit.model import fake_te


def _cfg(**sections) -> Config:
    cfg = Config()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.fixture
def cuda_here(monkeypatch):
    """Pretend CUDA is usable, to reach the library checks."""
    monkeypatch.setattr(fastpaths, "cuda_missing", lambda: None)


def _modules(monkeypatch, *names: str) -> list[types.ModuleType]:
    mods = [types.ModuleType(name) for name in names]
    for mod in mods:
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mods


def test_the_defaults_check_nothing(monkeypatch):
    def probe():
        raise AssertionError("a default config probed a fast path")

    for name in ("cuda_missing", "transformer_engine_missing", "fp8_missing", "apex_layernorm_missing",
                 "apex_grad_norm_missing"):
        monkeypatch.setattr(fastpaths, name, probe)
    validate(Config())


@pytest.mark.parametrize("section,key,value", [("model", "impl", "megatron"), ("model", "layernorm_impl", "fused"),
                                               ("optim", "grad_norm_impl", "cuda")])
def test_unknown_choices_name_the_key_and_the_choices(section, key, value):
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}='{value}' must be one of native, "):
        validate(_cfg(**{section: {key: value}}))


@pytest.mark.parametrize("section,key,value", [("model", "impl", "te"), ("model", "layernorm_impl", "apex"),
                                               ("optim", "grad_norm_impl", "apex")])
def test_cuda_paths_on_this_cpu_torch(section, key, value):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**{section: {key: value}}))
    message = str(err.value)
    assert message.startswith(f"{section}.{key}={value} needs CUDA, but this torch (") and "CPU build" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}={value} runs on CUDA only but train.device=cpu"):
        validate(_cfg(train={"device": "cpu"}, **{section: {key: value}}))


def test_te_missing_names_the_package_and_its_install(cuda_here):
    with pytest.raises(ConfigError) as err:
        check_fast_path_config(_cfg(model={"impl": "te"}), tp=1)
    assert str(err.value).startswith("model.impl=te needs Transformer Engine: Transformer Engine cannot be imported "
                                     "(ModuleNotFoundError: No module named 'transformer_engine')")
    assert "pip install --no-build-isolation 'transformer-engine[pytorch]'" in str(err.value)


def test_te_older_than_its_autocast_api(cuda_here, monkeypatch):
    fake_te.install(monkeypatch, version="2.8.0")
    with pytest.raises(ConfigError, match=r"Transformer Engine 2\.8\.0 is older than 2\.9; install it"):
        check_fast_path_config(_cfg(model={"impl": "te"}), tp=1)
    fake_te.install(monkeypatch, version="2.10.0+cu13")
    check_fast_path_config(_cfg(model={"impl": "te"}), tp=1)


def test_fp8_needs_te_layers_a_gpu_with_fp8_and_shapes_its_gemms_take(cuda_here, monkeypatch):
    with pytest.raises(ConfigError, match=r"^train.precision=fp8 runs the GEMMs of Transformer Engine's layers in fp8 "
                                          r"and needs model.impl=te"):
        validate(_cfg(train={"precision": "fp8"}))
    fake_te.install(monkeypatch, fp8=(False, "Device compute capability 8.9 or higher required for FP8 execution."))
    fp8 = {"model": {"impl": "te"}, "train": {"precision": "fp8"}}
    with pytest.raises(ConfigError, match=r"^train.precision=fp8: Transformer Engine reports no fp8 support on this "
                                          r"GPU \(Device compute capability 8.9"):
        check_fast_path_config(_cfg(**fp8), tp=1)
    fake_te.install(monkeypatch)
    check_fast_path_config(_cfg(**fp8), tp=1)  # tiny: hidden 64, 4 x 128 tokens
    with pytest.raises(ConfigError, match=r"3 x model.hidden_size / parallel.tp = 24 is not a multiple of 16"):
        check_fast_path_config(_cfg(**fp8), tp=8)
    with pytest.raises(ConfigError, match=r"= 15 tokens per micro-batch is not a multiple of 8"):
        check_fast_path_config(_cfg(model={"impl": "te"}, train={"precision": "fp8", "micro_batch_size": 1},
                                    data={"seq_len": 15}), tp=1)
    with pytest.raises(ConfigError, match=r"the FFN size / parallel.tp = 136 is not a multiple of 16"):
        check_fast_path_config(_cfg(model={"impl": "te", "ffn_hidden_size": 272}, train={"precision": "fp8"}), tp=2)
    llama = {"impl": "te", "arch": "llama", "num_heads": 4, "num_query_groups": 1}  # q 64 + k 16 + v 16 rows
    check_fast_path_config(_cfg(model=llama, train={"precision": "fp8"}), tp=2)
    with pytest.raises(ConfigError, match=r"\(model.num_heads \+ 2 x model.num_query_groups\) x head size / "
                                          r"parallel.tp = 24 is not a multiple of 16"):
        check_fast_path_config(_cfg(model=llama, train={"precision": "fp8"}), tp=4)


def test_apex_missing_or_not_nvidias(cuda_here, monkeypatch):
    cfg = _cfg(model={"layernorm_impl": "apex"})
    with pytest.raises(ConfigError) as err:
        check_fast_path_config(cfg, tp=1)
    assert str(err.value).startswith("model.layernorm_impl=apex needs NVIDIA apex: NVIDIA apex cannot be imported "
                                     "(ModuleNotFoundError: No module named 'apex')")
    assert "git+https://github.com/NVIDIA/apex" in str(err.value) and "PyPI package named apex is unrelated" in \
        str(err.value)
    _modules(monkeypatch, "apex")  # the unrelated web toolkit of that name: no CUDA extensions
    with pytest.raises(ConfigError, match=r"the installed apex is not NVIDIA's with its CUDA extensions "
                                          r"\(fused_layer_norm_cuda: ModuleNotFoundError"):
        check_fast_path_config(cfg, tp=1)
    with pytest.raises(ConfigError, match=r"^optim.grad_norm_impl=apex needs NVIDIA apex: the installed apex is not "
                                          r"NVIDIA's with its CUDA extensions \(amp_C: "):
        check_fast_path_config(_cfg(optim={"grad_norm_impl": "apex"}), tp=1)


def test_nvidia_apex_passes(cuda_here, monkeypatch):
    apex, *_ = _modules(monkeypatch, "apex", "apex.normalization", "apex.multi_tensor_apply", "fused_layer_norm_cuda",
                        "amp_C")
    apex.__path__ = []  # a package
    check_fast_path_config(_cfg(model={"layernorm_impl": "apex"}, optim={"grad_norm_impl": "apex"}), tp=1)
