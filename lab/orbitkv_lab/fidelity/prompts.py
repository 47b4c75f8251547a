"""Multi-chunk prompts ``[BOS] A1 .. Ak B Q`` and the KV every arm starts from.

Each reused chunk (A1..Ak, B) is cached alone after the anchor, ``[BOS . chunk]``: its canonical
KV ``KV(chunk|anchor)`` (bf16). In the prompt it sits ``delta`` positions later, so

* ``blind``     -- the canonical rows as stored (keys still at their canonical positions);
* ``relocated`` -- the canonical keys rotated exactly by ``delta`` (``kernels.relocate``), the
  position-correct reuse every repair arm is given;
* ``ceiling``   -- a full prefill of the prompt: the conditioned ``KV(chunk|A..)`` and the
  reference next-token logits.

Text arches: the chunks are random token ids (random-weight models: content is irrelevant, fixed
length keeps positions aligned across items). qwen2-vl: the chunks are images (with their vision
start/end markers). binding: the trained model's own items (chunk A = legend, B = image).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from orbitkv.kernels.relocate import relocate

from orbitkv.models import hfrun

from . import partial


@dataclasses.dataclass
class Item:
    prompt: hfrun.Prompt
    chunks: list[tuple[int, int]]  # reused spans in the prompt
    image_rows: torch.Tensor  # [N] bool: image (not text) tokens
    n_prefix: int  # first question token
    deltas: list[int]
    canon: list[list[hfrun.LayerKV]]  # per chunk, canonical bf16 KV
    blind: list[hfrun.LayerKV]  # prefix rows, chunks as stored
    relocated: list[hfrun.LayerKV]  # prefix rows, chunks relocated
    ceiling_kv: list[hfrun.LayerKV]  # prefix rows of the full prefill (bf16)
    ceiling_logits: torch.Tensor
    answer: int | None = None  # ground truth (binding model only)
    qtype: str = ""

    @property
    def chunk_rows(self) -> torch.Tensor:
        rows = torch.zeros(len(self.prompt), dtype=torch.bool)
        for s, e in self.chunks:
            rows[s:e] = True
        return rows


@dataclasses.dataclass
class PromptConfig:
    n_items: int = 8
    n_antecedents: int = 2  # A1..Ak before B
    chunk_len: int = 48  # text chunk tokens
    image_px: int = 128  # qwen2-vl tiny: patch 8, merge 2 -> (px/16)^2 = 64 tokens per image
    question_len: int = 8
    seed: int = 0


def _text_ids(hm: hfrun.HFModel, rng: np.random.Generator, n: int) -> list[int]:
    vocab = int(hm.config.get_text_config().vocab_size)
    special = set(getattr(hm.tokenizer, "all_special_ids", []) or [])
    ids: list[int] = []
    while len(ids) < n:
        t = int(rng.integers(4, vocab))
        if t not in special:
            ids.append(t)
    return ids


def _image(rng: np.random.Generator, px: int) -> Any:
    from PIL import Image

    blocks = rng.random((7, 7, 3))
    b = -(-px // 7)
    arr = np.kron(blocks, np.ones((b, b, 1)))[:px, :px] * 0.7 + rng.random((px, px, 3)) * 0.3
    return Image.fromarray((arr * 255).astype("uint8"))


def _text_prompt(bos: int | None, segments: list[list[int]]) -> hfrun.Prompt:
    ids = [bos] if bos is not None else []
    spans = []
    for seg in segments:
        spans.append((len(ids), len(ids) + len(seg)))
        ids += seg
    t = torch.tensor(ids, dtype=torch.long)
    return hfrun.Prompt(t, torch.arange(len(ids)), {}, spans)


def _round(kv: list[hfrun.LayerKV]) -> list[hfrun.LayerKV]:
    return [
        (k.to(partial.CACHE_DTYPE), None if v is None else v.to(partial.CACHE_DTYPE)) for k, v in kv
    ]


def build_item(
    hm: hfrun.HFModel,
    chunks: list[Any],
    question: Any,
    *,
    bos: int | None,
    answer: int | None = None,
    qtype: str = "",
) -> Item:
    """``chunks``: token-id lists (text) or PIL images; ``question``: token ids or a string."""
    is_text = all(isinstance(c, list) for c in chunks)
    if is_text:
        prompt = _text_prompt(bos, [*chunks, question])
        solos = [_text_prompt(bos, [c]) for c in chunks]
    else:
        prompt = hfrun.build_prompt(hm, [*chunks, question])
        solos = [hfrun.build_prompt(hm, [c]) for c in chunks]
    spans = prompt.spans[: len(chunks)]
    image_rows = torch.zeros(len(prompt), dtype=torch.bool)
    if not is_text:
        image_rows = prompt.input_ids == hm.config.image_token_id
    ceiling_logits, ceiling_kv, _ = partial.forward(hm, prompt)
    n_prefix = spans[-1][1]
    ceiling_kv = hfrun.slice_chunk(ceiling_kv, 0, n_prefix)
    canon, deltas = [], []
    blind = [(k.clone(), None if v is None else v.clone()) for k, v in ceiling_kv]
    relocated = [(k.clone(), None if v is None else v.clone()) for k, v in ceiling_kv]
    for solo, (s, e) in zip(solos, spans, strict=True):
        _, kv, _ = partial.forward(hm, solo)
        cs, ce = solo.spans[0]
        shift = prompt.positions[..., s:e] - solo.positions[..., cs:ce]
        delta = int(shift.flatten()[0])
        if not bool((shift == delta).all()):
            raise AssertionError("chunk does not move uniformly")
        c = _round(hfrun.slice_chunk(kv, cs, ce))
        canon.append(c)
        deltas.append(delta)
        for li, (k, v) in enumerate(c):
            blind[li][0][s:e] = k
            relocated[li][0][s:e] = relocate(k, delta, hm.spec) if delta else k
            if v is not None:
                blind[li][1][s:e] = v
                relocated[li][1][s:e] = v
    return Item(
        prompt,
        spans,
        image_rows,
        n_prefix,
        deltas,
        canon,
        blind,
        relocated,
        ceiling_kv,
        ceiling_logits,
        answer,
        qtype,
    )


def make_items(hm: hfrun.HFModel, cfg: PromptConfig, *, seed_offset: int = 0) -> list[Item]:
    rng = np.random.default_rng([cfg.seed, seed_offset, 0xF1D])
    bos = hm.tokenizer.bos_token_id
    items = []
    for _ in range(cfg.n_items):
        n_chunks = cfg.n_antecedents + 1
        if hm.image_processor is not None:
            chunks = [_image(rng, cfg.image_px) for _ in range(n_chunks)]
            question = hm.tokenizer.decode(_text_ids(hm, rng, cfg.question_len))
        else:
            chunks = [_text_ids(hm, rng, cfg.chunk_len) for _ in range(n_chunks)]
            question = _text_ids(hm, rng, cfg.question_len)
        items.append(build_item(hm, chunks, question, bos=bos))
    return items


def single_chunk_item(hm: hfrun.HFModel, cfg: PromptConfig) -> Item:
    """``[BOS] B Q``: B sits where it was cached, so relocation is the identity."""
    rng = np.random.default_rng([cfg.seed, 99])
    return build_item(
        hm,
        [_text_ids(hm, rng, cfg.chunk_len)],
        _text_ids(hm, rng, cfg.question_len),
        bos=hm.tokenizer.bos_token_id,
    )


def binding_items(hm: hfrun.HFModel, n_per_type: int, seed: int = 0) -> list[Item]:
    """The trained binding model's held-out items: ``[BOS] A B`` then the two question tokens."""
    from orbitkv_lab.binding import task

    out = []
    for it in task.make_eval_set(seed, n_per_type):
        out.append(
            build_item(
                hm,
                [it.a.tolist(), it.b.tolist()],
                it.question.tolist(),
                bos=task.BOS,
                answer=int(it.answer),
                qtype=it.qtype,
            )
        )
    return out
