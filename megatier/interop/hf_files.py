"""What every Hugging Face model directory MegaTier reads or writes has in common: config.json, the weights
(model.safetensors, a sharded index, or the older pytorch_model.bin), the tokenizer files, and the one error
they all raise (one line naming the directory, what is wrong and the fix)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from megatier.config import ModelConfig
from megatier.data.tokenizer import EOD_TOKEN, load_tokenizer
from megatier.model.params import canonical_shapes


class HFFormatError(ValueError):
    """A directory that is not a model MegaTier can load, or a state that does not fit the model."""


def read_config(path: str, model_type: str, saved_by: str) -> dict:
    """The config.json of directory ``path``; refuses a missing directory, file, or another model_type.
    ``saved_by`` names what writes such directories (for the fix)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise HFFormatError(f"{path} is not a directory; give a directory written by {saved_by}")
    if not os.path.isfile(config_path):
        raise HFFormatError(f"{path} has no config.json, so it is not a Hugging Face model directory; give a "
                            f"directory written by {saved_by}")
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise HFFormatError(f"{config_path} is not valid JSON ({e}); re-export the model") from None
    kind = config.get("model_type")
    if kind != model_type:
        raise HFFormatError(f"{config_path} describes model_type={kind!r}, not {model_type!r}; set model.arch to the "
                            f"architecture of the directory, or give a {model_type} directory")
    return config


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory: model.safetensors, its sharded index, or pytorch_model.bin."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}
    legacy = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise HFFormatError(f"{path} has no model.safetensors (or pytorch_model.bin); save the model with "
                        f"save_pretrained or megatier-convert export")


def check_state(state: dict[str, torch.Tensor], m: ModelConfig) -> int:
    """The vocabulary of a canonical state that fits model config ``m`` (any arch); one clear error otherwise."""
    if "word.weight" not in state:
        raise HFFormatError("the state has no word.weight; give the canonical state (full tensors by name)")
    vocab = state["word.weight"].shape[0]
    expected = canonical_shapes(m, vocab)
    if state.keys() != expected.keys():
        extra, missing = sorted(state.keys() - expected.keys()), sorted(expected.keys() - state.keys())
        raise HFFormatError(f"the state's names do not match the model config: missing {missing[:3]}, "
                            f"unexpected {extra[:3]}; gather every pp stage's tensors (GPT-2: without head_weight)")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise HFFormatError(f"state tensor {name} has shape {tuple(state[name].shape)} but the model config "
                                  f"needs {shape}; export with the config the state was trained with")
    return vocab


def prepare_out_dir(out_dir: str) -> None:
    """Refuse a non-empty ``out_dir``; create it otherwise."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise HFFormatError(f"{out_dir} exists and is not empty; export into a new or empty directory")
    os.makedirs(out_dir, exist_ok=True)


def write_model(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """model.safetensors (written whole, then renamed) and config.json."""
    tmp = os.path.join(out_dir, f"model.safetensors.tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # readable like config.json (save_file's temporary file is private, 0600)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def write_tokenizer(out_dir: str, spec: Optional[dict], max_length: int) -> Optional[int]:
    """Write the tokenizer files of dataset tokenizer ``spec`` (none for byte or None); returns its eod id."""
    if spec is None:
        return None
    tok = load_tokenizer(spec)
    if spec["type"] == "bpe":
        shutil.copyfile(tok.path, os.path.join(out_dir, "tokenizer.json"))
        meta = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
                "unk_token": EOD_TOKEN, "model_max_length": max_length, "add_prefix_space": False}
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(meta, f, indent=2)
    return tok.eod_id
