"""A MegaTier export continued in torchtitan, for the tests that compare its next step with MegaTier's.

    job = load_in_torchtitan(folder, 12, m, o, 257, tmp_path)      # CheckpointManager.load of step-12
    loss = step_in_torchtitan(job, step_batches(prefix, cfg, 13))  # the step MegaTier took as its 13th

:func:`step_batches` is the whole global batch of a step, MegaTier's data order at dp=1: the union of every dp
rank's micro-batches, so a job trained at any dp is compared on the samples it took."""
from __future__ import annotations

import torch

from megatier.config import Config, ModelConfig, OptimConfig
from megatier.data.dataset import BatchSource, GPTSamples, ResumableSampler
from megatier.data.megatron_indexed import open_corpus
from tests.torchtitan_llama import TitanJob, build_job, train_step


def load_in_torchtitan(folder: str, step: int, m: ModelConfig, o: OptimConfig, vocab: int, tmp_path,
                       seed: int = 5) -> TitanJob:
    """torchtitan's Llama, AdamW, schedulers and CheckpointManager (a fresh seed's weights), loaded from
    ``folder``/step-``step`` but for the data loader (MegaTier exports none)."""
    job = build_job(m, vocab, o, str(tmp_path / "titan-run"), seed=seed)
    job.checkpointer.folder, job.checkpointer.exclude_from_loading = folder, ["dataloader"]
    assert job.checkpointer.load(step=step) and job.train_state.step == step
    return job


def step_in_torchtitan(job: TitanJob, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The loss of one torchtitan training step on ``batches`` (micro-batches of token and label rows) joined."""
    return train_step(job, torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))


def step_batches(prefix: str, cfg: Config, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches of the corpus at ``prefix`` as a dp=1 job of ``cfg``'s data and batch takes."""
    d, t = cfg.data, cfg.train
    samples = GPTSamples(open_corpus(prefix, d.cache_dir), d.seq_len, d.val_fraction)
    source = BatchSource(samples, ResumableSampler(samples.num_train, d.seed), global_batch_size=t.global_batch_size,
                         micro_batch_size=t.micro_batch_size, dp=1, dp_rank=0, rampup=t.rampup_batch_size)
    return source.train_microbatches(step)
