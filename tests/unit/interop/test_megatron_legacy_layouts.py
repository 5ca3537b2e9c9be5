"""MegaTier -> Megatron-LM legacy -> MegaTier at every layout the export writes (tp x pp, one bucket or many):
the job comes back bitwise, in Megatron's rank directories, and a weights-only copy of it (no distrib_optim.pt)
still reads at pp > 1 (the last stage's tied output_layer copy is dropped), unless the arguments untie it."""
from __future__ import annotations

import os

import pytest
import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobFormatError, JobState
from megatier.interop.megatron_legacy import export_megatron_legacy, load_megatron_legacy
from megatier.model.params import canonical_shapes

VOCAB = 250  # padded to 256 (tp=1) or 512 (tp=2) rows; the import drops the padding
MODEL = ModelConfig(name="mc", num_layers=4, hidden_size=32, num_heads=4, max_position_embeddings=32)


def _job() -> JobState:
    g = torch.Generator().manual_seed(0)
    canonical = {n: {"master": torch.randn(s, generator=g), "exp_avg": torch.randn(s, generator=g),
                     "exp_avg_sq": torch.rand(s, generator=g)} for n, s in canonical_shapes(MODEL, VOCAB).items()}
    return JobState(canonical, iteration=7, adam_steps=6, consumed_samples=56)


@pytest.mark.parametrize("tp,pp,bucket", [(2, 2, 2000), (1, 4, None), (2, 1, 5000)])
def test_every_layout_round_trips_bitwise(tmp_path, tp, pp, bucket):
    job = _job()
    where = export_megatron_legacy(job, MODEL, OptimConfig(), str(tmp_path), lr=1e-3, tp=tp, pp=pp,
                                   bucket_size=bucket)
    names = [f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") for t in range(tp) for s in range(pp)]
    assert sorted(os.listdir(where)) == sorted(names)
    back = load_megatron_legacy(str(tmp_path), MODEL, VOCAB, OptimConfig())
    assert (back.iteration, back.adam_steps, back.consumed_samples) == (7, 6, 56)
    for name, kinds in job.canonical.items():
        assert all(torch.equal(v, back.canonical[name][k]) for k, v in kinds.items()), name
    last = torch.load(os.path.join(where, names[-1], "model_optim_rng.pt"), weights_only=False)
    assert ("output_layer.weight" in last["model"]) == (pp > 1)
    assert list(last["model"])[0] == ("decoder.layers.0.input_layernorm.weight" if pp > 1
                                      else "embedding.word_embeddings.weight")  # local layer numbers per stage
    for name in names:
        os.remove(os.path.join(where, name, "distrib_optim.pt"))
    weights = load_megatron_legacy(str(tmp_path), MODEL, VOCAB)
    assert any("moments start at zero" in line for line in weights.notes)
    assert all(torch.equal(kinds["master"], weights.canonical[n]["master"]) for n, kinds in job.canonical.items())
    if pp > 1:  # the same output_layer under arguments that untie it is a head MegaTier's GPT-2 does not have
        for name in names:
            path = os.path.join(where, name, "model_optim_rng.pt")
            ckpt = torch.load(path, weights_only=False)
            ckpt["args"].untie_embeddings_and_output_weights = True
            torch.save(ckpt, path)
        with pytest.raises(JobFormatError, match="output_layer.weight is an untied head"):
            load_megatron_legacy(str(tmp_path), MODEL, VOCAB)
