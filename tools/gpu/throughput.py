"""Training throughput of MegaTier's step against a plain PyTorch loop of the same model: tokens/s and MFU.

    python -m tools.gpu.throughput --json out.json                        # gpt2_124m, bf16, seq 1024, on CUDA
    python -m tools.gpu.throughput --model tiny --precision fp32 --seq 64 --batch 4 --steps 3 --warmup 1 \\
        --device cpu --rows megatier,megatier_compile,plain --compile-backend aot_eager       (the dry run's)

Rows (``--rows``):
  megatier          the Trainer on one rank, no checkpointing, ``model.compile=false``
  megatier_compile  the same with ``model.compile=true`` (each block compiled: megatier.model.compile)
  plain             a plain GPT-2 of the same shape and parameter count (nn.Linear, F.scaled_dot_product_attention,
                    tied head) trained by ``torch.optim.AdamW`` (fused on CUDA) under ``torch.autocast`` for bf16
                    and fp16, on random tokens: what a user's own loop would do
  plain_compile     the same model under ``torch.compile``
Each row trains ``--steps`` steps of ``--batch`` sequences; tokens/s is over the steps after ``--warmup`` (the
median of MegaTier's per-step records; the plain loop's total, timed between two device syncs).

MFU = tokens/s x FLOPs per token / the device's peak, FLOPs per token = 6 N + 12 L h s (the forward's 2 N and the
backward's 4 N multiply-adds of the weights, N the parameters less the position embedding, plus the attention's
scores and values: PaLM's appendix B, arXiv:2204.02311). The peak is ``--peak-tflops``, else the dense bf16/fp16
peak of a known GPU (PEAK_TFLOPS); unknown (a CPU): no MFU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROWS = ("megatier", "megatier_compile", "plain", "plain_compile")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16/fp16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlainBlock(nn.Module):
    """GPT-2's pre-LayerNorm block in plain PyTorch."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(h, dim=-1))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(a), p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), p, self.training)


class PlainGPT2(nn.Module):
    """GPT-2 with its head tied to the word embedding; ``forward`` returns the mean cross-entropy."""

    def __init__(self, vocab: int, layers: int, hidden: int, heads: int, ffn: int, positions: int, dropout: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads, ffn, dropout) for _ in range(layers))
        self.ln_f, self.dropout = nn.LayerNorm(hidden), dropout

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def flops_per_token(params: int, position_params: int, layers: int, hidden: int, seq: int) -> float:
    """6 N + 12 L h s (module docstring)."""
    return 6.0 * (params - position_params) + 12.0 * layers * hidden * seq


def peak_flops(device: str, peak_tflops: Optional[float]) -> Optional[float]:
    """The device's dense peak in FLOP/s: ``peak_tflops``, else a known GPU's; None when unknown."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for gpu, tf in PEAK_TFLOPS.items() if gpu in name), None)


def megatier_row(args, compiled: bool, work: str) -> dict:
    """The Trainer on one rank (module docstring); tokens/s, and the model's shape for the plain rows."""
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WANDB_MODE="disabled",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = compose_config([f"model={args.model}", f"train.precision={args.precision}", f"data.seq_len={args.seq}",
                          f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
                          f"train.device={args.device}", f"train.iters={args.steps}", "checkpoint.enabled=false",
                          f"train.eval_interval={10 ** 6}", "logging.progress=false", "logging.wandb.mode=disabled",
                          f"logging.run_dir={work}/run-{int(compiled)}", f"model.compile={str(compiled).lower()}",
                          f"model.compile_backend={args.compile_backend}", *args.overrides])
    trainer = Trainer(cfg)
    records, step = [], trainer.train_step
    trainer.train_step = lambda s: records.append(step(s)) or records[-1]
    trainer.train()
    m = cfg.model
    shape = {"vocab": trainer.model.padded_vocab_size, "layers": m.num_layers, "hidden": m.hidden_size,
             "heads": m.num_heads, "ffn": m.ffn_hidden_size or 4 * m.hidden_size,
             "positions": m.max_position_embeddings, "dropout": m.hidden_dropout,
             "params": sum(p.numel() for p in trainer.model.parameters()),
             "position_params": trainer.model.pos.weight.numel()}
    trainer.close()
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records if r["step"] > args.warmup),
            **shape}


def plain_row(args, shape: dict, compiled: bool) -> dict:
    """The plain loop (module docstring) on random tokens; tokens/s over the steps after the warm-up."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = PlainGPT2(*(shape[k] for k in ("vocab", "layers", "hidden", "heads", "ffn", "positions", "dropout")))
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model, backend=args.compile_backend) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    dtype = DTYPES[args.precision]
    tokens = torch.randint(0, shape["vocab"], (args.batch, args.seq + 1), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.steps):
        if i == args.warmup:
            sync()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": (args.steps - args.warmup) * args.batch * args.seq / elapsed, "params": params,
            "loss": float(loss.detach())}


def measure(args) -> list[dict]:
    """Each row of ``args.rows`` in order, with tokens/s and MFU (None without a known peak). The plain rows take
    the shape of the first MegaTier row (one is run for it when the rows start with a plain one)."""
    peak = peak_flops(args.device, args.peak_tflops)
    rows, shape = [], None
    with tempfile.TemporaryDirectory(prefix="megatier-throughput-") as work:
        for name in args.rows:
            compiled = name.endswith("_compile")
            if name.startswith("megatier"):
                result = megatier_row(args, compiled, work)
                shape = shape or result
            else:
                shape = shape or megatier_row(args, False, work)
                result = plain_row(args, shape, compiled)
            flops = flops_per_token(result["params"], shape["position_params"], shape["layers"], shape["hidden"],
                                    args.seq)
            mfu = result["tokens_per_s"] * flops / peak if peak else None
            rows.append({"row": name, "tokens_per_s": result["tokens_per_s"], "mfu": mfu, "params": result["params"],
                         "flops_per_token": flops})
            print(f"{name}: {result['tokens_per_s']:.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu else ""),
                  file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'row':>17}  {'tokens/s':>10}  {'MFU':>6}  {'parameters':>11}"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"{r['row']:>17}  {r['tokens_per_s']:>10.0f}  {mfu:>6}  {r['params']:>11,}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2_124m")
    p.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (compilation, allocator)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default=",".join(ROWS), type=lambda s: s.split(","))
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak (default: known GPUs)")
    p.add_argument("--json", default=None, help="write the rows here too")
    p.add_argument("overrides", nargs="*", help="after --: MegaTier config overrides")
    args = p.parse_args(argv)
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    rows = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(table(rows))
    return 0 if all(math.isfinite(r["tokens_per_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
