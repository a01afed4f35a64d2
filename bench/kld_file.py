"""llama-perplexity's file of a base model's log-probabilities (`--kl-divergence-base`), read and
written, so that baton and llama.cpp can each be scored against the other's float model.

The layout (llama.cpp's tools/perplexity/perplexity.cpp): b"_logits_", n_ctx (uint32), n_vocab and
n_chunk (int32), the text's n_chunk * n_ctx token ids (int32, as tokenized: BOS is put in at each
chunk's start when evaluated, not stored), then for every chunk the n_ctx - 1 - n_ctx // 2 scored
positions, each as 2 * ((n_vocab + 1) // 2) + 4 uint16: float32 scale and min log-prob, then each
log-prob's offset from that min in steps of scale (log-probs more than 16 below the top are 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"_logits_"
CLIP = 16.0  # log-probs this far below a row's top are stored as the row's min, and not counted


@dataclass
class KldBase:
    n_ctx: int
    tokens: list[int]  # n_chunk * n_ctx, as tokenized
    logprobs: torch.Tensor  # [n_chunk * scored positions, n_vocab] float32, decoded

    @property
    def n_chunk(self) -> int:
        return len(self.tokens) // self.n_ctx


def _row_len(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def read(path: Path) -> KldBase:
    raw = path.read_bytes()
    if raw[:8] != MAGIC:
        raise ValueError(f"{path}: not a llama-perplexity log-prob file (no {MAGIC!r})")
    n_ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw, np.int32, 2, 12))
    tokens = np.frombuffer(raw, np.int32, n_ctx * n_chunk, 20)
    rows = n_chunk * (n_ctx - 1 - n_ctx // 2)
    body = np.frombuffer(raw, np.uint16, rows * _row_len(n_vocab), 20 + 4 * tokens.size)
    body = body.reshape(rows, _row_len(n_vocab))
    head = torch.from_numpy(body[:, :4].copy().view(np.float32))  # [rows, 2]: scale, min log-prob
    q = torch.from_numpy(body[:, 4 : 4 + n_vocab].astype(np.float32))
    logprobs = q * head[:, :1] + head[:, 1:2]
    return KldBase(n_ctx, tokens.tolist(), logprobs)


def write(path: Path, n_ctx: int, tokens: list[int], logprobs: torch.Tensor) -> None:
    """`logprobs` [n_chunk * scored positions, n_vocab] encoded as llama-perplexity encodes logits
    (log-probs are logits whose log-sum-exp is 0)."""
    n_vocab = logprobs.shape[1]
    top = logprobs.max(-1, keepdim=True).values.double()
    low = torch.maximum(logprobs.min(-1, keepdim=True).values.double(), top - CLIP)
    lse = (logprobs.double() - top).exp().sum(-1, keepdim=True).log()
    scale = ((top - low) / 65535.0).float()
    min_logprob = (low - top - lse).float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.where(logprobs > low.float(), torch.round(inv * (logprobs - low.float())), torch.zeros_like(logprobs))
    body = np.zeros((logprobs.shape[0], _row_len(n_vocab)), np.uint16)
    body[:, :4] = torch.cat([scale, min_logprob], 1).numpy().view(np.uint16)
    body[:, 4 : 4 + n_vocab] = q.clamp(0, 65535).numpy().astype(np.uint16)
    header = MAGIC + np.array([n_ctx], np.uint32).tobytes()
    header += np.array([n_vocab, len(tokens) // n_ctx], np.int32).tobytes()
    path.write_bytes(header + np.asarray(tokens, np.int32).tobytes() + body.tobytes())


def mean_kl(base: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """KL(base || test) per row as llama-perplexity sums it: only base log-probs above -16 count."""
    keep = base > -CLIP
    return torch.where(keep, base.exp() * (base - test), torch.zeros_like(base)).sum(-1)
