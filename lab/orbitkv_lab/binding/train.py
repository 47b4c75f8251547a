"""Train the tiny Llama-style binding model from scratch on CPU, deterministically from a seed.

    python -m orbitkv_lab.binding.train --out lab/orbitkv_lab/assets/binding --seed 0

Writes ``model.safetensors`` + ``config.json`` (an HF ``LlamaForCausalLM`` checkpoint, loadable
with ``LlamaForCausalLM.from_pretrained(out)``), ``vocab.json`` and ``train_log.json``.

Model: 4 layers, hidden 64, 4 query heads x head_dim 32, 2 KV heads (GQA), RoPE theta 1e4,
SwiGLU 192, tied embeddings (~0.25M parameters, ~1 MB fp32).

Loss: cross-entropy on the answer slot of each of the four questions in a training sequence
(``task.train_batch``) plus, weight ``--aux-weight``, on B's patch positions, whose target is the
attribute of that patch's entity (deep supervision of the binding; it is never evaluated).
Init: ``initializer_range`` 0.125 (about 1/sqrt(hidden)) and swatch embeddings started at
entity + attribute; with the default 0.02 init the legend lookup sat on a plateau (aux loss stuck
at ln 4) for the 800 steps we could afford.

Threads: ``--threads 1`` by default. On the shared 2-core machine this was measured about 10x
faster per step than 2 intra-op threads (5.2 s vs 0.5 s per step under load); pass
``--threads 2`` on an idle machine. The result is deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from . import task

MODEL_KW = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def make_config(**over):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=task.VOCAB_SIZE,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=task.BOS,
        eos_token_id=task.SEP,
        pad_token_id=task.PAD,
        attention_dropout=0.0,
        initializer_range=0.125,
        **MODEL_KW,
    )
    kw.update(over)
    return LlamaConfig(**kw)


@torch.no_grad()
def factorized_init(model) -> None:
    """Start each legend swatch token (entity e, attribute c) at the sum of the entity's and the
    attribute's embeddings: the swatch *names* the entity it defines, as a patch code would. This
    is only an initialisation (all embeddings stay free), it shortens the plateau before the
    legend lookup is learned."""
    emb = model.get_input_embeddings().weight
    for e in range(task.N_ENT):
        for c in range(task.N_ATTR):
            emb[task.SWATCH0 + e * task.N_ATTR + c] = (
                emb[task.ENT0 + e] + emb[task.ATTR0 + c]
            ) / 2**0.5


def losses(model, toks: torch.Tensor, tgt: torch.Tensor, aux: torch.Tensor):
    """Cross-entropy on the answer slots and on the aux (binding) slots; LM head only there."""
    h = model.model(input_ids=toks).last_hidden_state
    ce = torch.nn.functional.cross_entropy
    m, ma = tgt >= 0, aux >= 0
    l_ans = ce(model.lm_head(h[m]), tgt[m])
    l_aux = ce(model.lm_head(h[ma]), aux[ma]) if bool(ma.any()) else l_ans.new_zeros(())
    return l_ans, l_aux


@torch.no_grad()
def quick_eval(model, items) -> dict[str, float]:
    """Full-prefill (ceiling) accuracy per question type."""
    toks = torch.tensor(
        np.stack([np.concatenate([[task.BOS], it.a, it.b, it.question]) for it in items])
    )
    logits = model(input_ids=toks).logits[:, -1]
    pred = logits.argmax(-1).numpy()
    out = {}
    for qt in task.QTYPES:
        idx = [i for i, it in enumerate(items) if it.qtype == qt]
        out[qt] = float(np.mean([pred[i] == items[i].answer for i in idx]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from transformers import LlamaForCausalLM

    config = make_config()
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).float()
    factorized_init(model)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    rng = np.random.default_rng([args.seed, 0x7A1])
    held = task.make_eval_set(args.seed + 1000, 100)
    log = []
    t0 = time.time()
    run_loss = run_aux = 0.0
    for step in range(args.steps):
        toks, tgt, aux = (torch.from_numpy(x) for x in task.train_batch(rng, args.batch))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        l_ans, l_aux = losses(model, toks, tgt, aux)
        loss = l_ans + args.aux_weight * l_aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss += float(l_ans.detach())
        run_aux += float(l_aux.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            model.eval()
            acc = quick_eval(model, held)
            model.train()
            n = (step % args.log_every) + 1
            rec = dict(
                step=step + 1,
                loss=run_loss / n,
                aux=run_aux / n,
                acc=acc,
                t=round(time.time() - t0, 1),
            )
            run_loss = run_aux = 0.0
            log.append(rec)
            print(json.dumps(rec), flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "vocab.json"), "w") as f:
        json.dump({tok: i for i, tok in enumerate(task.VOCAB)}, f, indent=0)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(
            dict(args=vars(args), model=MODEL_KW, log=log, train_seconds=time.time() - t0),
            f,
            indent=1,
        )
    print(f"saved to {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
