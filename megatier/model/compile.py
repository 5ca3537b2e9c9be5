"""model.compile: ``torch.compile`` of each transformer block (regional compilation, as torchtitan does).

Why the blocks and not the stage: the blocks are where the time goes and they are all alike, so Dynamo traces
one and every other block of the stage runs the same compiled code (the parameters are the graph's inputs);
compile time is one block's, whatever the depth. The embedding, the head and the pipeline's transfers stay
eager, and so does everything between two blocks: the schedules, the hooks, the checkpoint system.

Each block is compiled in place (``nn.Module.compile``), not wrapped (``torch.compile(module)`` would put every
parameter under ``_orig_mod.``): the names the flat buffers, the checkpoints and the canonical digest use are
those of an eager run, so a job may switch compilation on or off at any relaunch (the key is not in the
fingerprint). What stays true under it:
- the gradients still arrive in the parameters' ``.grad`` through the eager autograd engine, so the
  GradBuffer's post-accumulate hooks fold them in as before;
- ``model.recompute=full`` wraps the compiled block in the same eager ``torch.utils.checkpoint``; ``selective``
  checkpoints the attention core inside the block, and the dropout draws from the model's own generators
  (:mod:`.recompute`), which Dynamo does not trace: it runs those parts eagerly (a graph break), so the masks,
  and the recomputed masks, are an eager run's.

Backends: ``inductor`` (torch.compile's default: generated kernels, C++ on a CPU, Triton on a GPU) is the one that
makes a step faster, its fused kernels rounding differently from eager's (fp32 results equal to a tolerance, not
bit for bit); ``aot_eager`` traces forward and backward the same way and runs them as eager ATen ops, so a run
equals the eager run bit for bit: it checks that a model compiles without generating code (the tests use it).
"""
from __future__ import annotations

from torch import nn

from megatier.config.schema import COMPILE_BACKENDS


def compile_blocks(layers: nn.ModuleDict, backend: str) -> None:
    """Compile each block of ``layers`` in place with ``backend`` (one of COMPILE_BACKENDS)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"model.compile_backend={backend!r} must be one of {', '.join(COMPILE_BACKENDS)}")
    for block in layers.values():
        block.compile(backend=backend)
