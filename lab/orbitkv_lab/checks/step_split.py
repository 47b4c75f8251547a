"""``orbitkv check step-split [--model DIR] --json``: does vLLM alone answer a document-agent prompt
the same when its own prefix cache splits the prefill into two steps?

An agent's next request hits a prefix it sent before, so vLLM computes only the rest of the prompt,
in a shorter step than a full prefill. This check sends document-agent chats (a window of text
records with names, places, colours and codes, then a question) to vLLM on the real model
(``orbitkv model smollm2``) three ways, greedy:

- ``full``: one prefill of the whole prompt (vLLM's prefix cache emptied first);
- ``after_first_record``: the prompt up to the first record's last whole block was sent before
  (a 1-token request), so the prefill is a prefix-cache hit plus one step for the rest;
- ``after_records``: the same with every record cached, the question computed alone;
- ``all_but_last_token``: everything cached but the last token (each chat is padded to one token
  past a block boundary): the 1-token last step OrbitKV serves a fully stored prompt with.

Phase ``plain`` runs vLLM with no connector at all and compares the answers (token ids) and each
answer token's top logprobs with ``full``'s. Phase ``kv`` (``--kv``) reads the prompt's KV back from
vLLM's paged cache (through OrbitKV's gather, the connector loaded with load and save off, so vLLM
alone computes everything) and counts the trials whose KV differs from ``full``'s anywhere; then
serves the same head from OrbitKV's store instead of vLLM's prefix cache (exact only) and compares
the KV with the prefix-cache run's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

NAMES = ("Marta Okafor", "Jonas Weber", "Priya Nair", "Tomas Lindqvist", "Aiko Tanaka", "Diego Ruiz",
         "Lena Novak", "Samuel Osei", "Clara Rossi", "Omar Haddad", "Ines Duarte", "Viktor Petrov")
CITIES = ("Valparaiso", "Lisbon", "Oslo", "Nairobi", "Kyoto", "Porto", "Tallinn", "Accra", "Turin",
          "Beirut", "Quito", "Gdansk")
JOBS = ("glassblower", "pilot", "librarian", "chemist", "baker", "surveyor", "violinist", "nurse")
PLACES = ("harbour museum", "old observatory", "city archive", "river clinic", "north depot",
          "botanical garden")
COLOURS = ("teal", "maroon", "amber", "violet", "olive", "crimson", "ivory", "cobalt")
VEHICLES = ("scooter", "van", "bicycle", "sedan", "tram pass", "motorbike")
TOPICS = ("tide tables", "bird songs", "old maps", "bridge designs", "herbal remedies", "star charts")
SPLITS = ("after_first_record", "after_records", "all_but_last_token")
# Appended word by word to the question until the chat is one token past a block boundary, so that
# vLLM's prefix cache can hold all of the prompt but its last token (a 1-token last step, what
# OrbitKV serves a fully stored prompt with).
FILLER = ("Use only the records above and give the exact value that is asked for, with the name of "
          "the person it belongs to, and nothing else at all please, thank you very much for it. If "
          "two records disagree, say which record you read the value from and why it is the right "
          "one.").split()


def record(rng: random.Random, index: int) -> tuple[str, dict[str, str]]:
    """One ~70-token record and its facts."""
    f = {"name": rng.choice(NAMES), "city": rng.choice(CITIES), "job": rng.choice(JOBS),
         "place": rng.choice(PLACES), "colour": rng.choice(COLOURS), "vehicle": rng.choice(VEHICLES),
         "notebook": rng.choice(COLOURS), "pages": str(rng.randrange(100, 999)),
         "topic": rng.choice(TOPICS), "code": str(rng.randrange(100, 999)),
         "visitor": rng.choice(NAMES), "from": rng.choice(CITIES)}
    text = (f"Record {index}. {f['name']} lives in {f['city']} and works as a {f['job']} at the "
            f"{f['place']}. They drive a {f['colour']} {f['vehicle']}, keep a {f['notebook']} "
            f"notebook of {f['pages']} pages about {f['topic']}, and their locker code is "
            f"{f['code']}. {f['visitor']} visits every Sunday from {f['from']}.")
    return text, f


QUESTIONS = (
    ("code", "What is the locker code of the person who lives in {city}?"),
    ("colour", "What colour is {name}'s {vehicle}?"),
    ("city", "Which city does {name} live in?"),
    ("topic", "What is {name}'s notebook about?"),
)


def prompts(num: int, window: int = 4, seed: int = 0) -> list[tuple[str, list[str]]]:
    """``num`` document-agent user turns: (content, the window's record texts). The window slides
    by one record per step; each asks one question about one of its records."""
    rng = random.Random(seed)
    records = [record(rng, i) for i in range(num + window)]
    out = []
    for step in range(num):
        win = records[step : step + window]
        _, facts = win[rng.randrange(window)]
        _, question = QUESTIONS[step % len(QUESTIONS)]
        content = "\n\n".join(t for t, _ in win) + "\n\nQuestion: " + question.format(**facts) + \
            " Answer in one sentence."
        out.append((content, [t for t, _ in win]))
    return out


def prompt_ids(tok: Any, content: str, records: list[str], block_size: int) -> tuple[list[int], dict[str, int]]:
    """The chat's token ids and, per split, the cached prefix (whole blocks, at least one block)."""
    def ids_of(text: str) -> list[int]:
        return list(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"])

    ids = ids_of(content)
    for num_words in range(2 * len(FILLER) + 2):
        # Each word with and without a full stop after it: one of the two lands on every residue.
        ids = ids_of(" ".join([content, *FILLER[: num_words // 2]]) + "." * (num_words % 2))
        if len(ids) % block_size == 1:
            break
    else:
        raise ValueError("no filler length puts the chat one token past a block boundary")
    # A chat holding only the records renders the whole chat's ids up to the records' end.
    ends = {"after_first_record": records[0], "after_records": "\n\n".join(records)}
    cuts = {}
    for split, head in ends.items():
        n = next((i for i, (a, b) in enumerate(zip(ids_of(head), ids, strict=False)) if a != b), 0)
        cuts[split] = max(block_size, n // block_size * block_size)
    cuts["all_but_last_token"] = len(ids) - 1
    return ids, cuts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv check step-split", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: orbitkv model smollm2)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv", action="store_true", help="also compare the prompt's KV bits (a second engine)")
    args = p.parse_args(argv)
    if args.model is None:
        from orbitkv.models.smollm2 import smollm2_checkpoint

        args.model = smollm2_checkpoint()
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else json.dumps(report["summary"]))
    return 0


BLOCK_SIZE = 32


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    cases = [prompt_ids(tok, c, r, BLOCK_SIZE) for c, r in prompts(args.prompts)]
    max_len = max(len(ids) for ids, _ in cases) + args.max_tokens + BLOCK_SIZE
    with plain_llm(args.model, max_model_len=max_len) as llm:
        rows = [_answers(llm, ids, cuts, args.max_tokens) for ids, cuts in cases]
    for row in rows:
        for answer in row["splits"].values():
            answer["text"] = tok.decode(answer.pop("ids"), skip_special_tokens=True)
        row["full"]["text"] = tok.decode(row["full"].pop("ids"), skip_special_tokens=True)
    summary: dict[str, Any] = {
        split: {
            "answers_differing": sum(not r["splits"][split]["same_ids"] for r in rows),
            "first_token_logprobs_differing": sum(r["splits"][split]["first_differing_logprobs"] == 0
                                                  for r in rows),
            "prompts": len(rows),
        }
        for split in SPLITS
    }
    if args.kv:
        for split, counts in _kv_phase(args.model, cases, max_len).items():
            summary[split].update(counts)
    return {
        "model": str(args.model),
        "block_size": BLOCK_SIZE,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "rows": rows,
        "meaning": "vLLM alone (no connector), greedy: each split is the same prompt computed as a "
        "prefix-cache hit of `cached` tokens plus one step for the rest, against one full prefill",
    }


def _answers(llm: Any, ids: list[int], cuts: dict[str, int], max_tokens: int) -> dict[str, Any]:
    full = _generate(llm, ids, max_tokens, cached=0)
    row: dict[str, Any] = {"prompt_tokens": len(ids), "full": full, "splits": {}}
    for split in SPLITS:
        got = _generate(llm, ids, max_tokens, cached=cuts[split])
        num = min(len(got["ids"]), len(full["ids"]))
        first_ids = next((i for i in range(num) if got["ids"][i] != full["ids"][i]), None)
        if first_ids is None and len(got["ids"]) != len(full["ids"]):
            first_ids = num  # one stopped (end of sequence) where the other went on
        first_lp = next((i for i, (a, b) in enumerate(zip(got["logprobs"], full["logprobs"], strict=False))
                         if a != b), None)
        row["splits"][split] = {"cached": got["cached"], "same_ids": first_ids is None,
                                "first_differing_token": first_ids, "first_differing_logprobs": first_lp,
                                "ids": got["ids"]}
    for answer in (full, *row["splits"].values()):
        answer.pop("logprobs", None)
    return row


def _generate(llm: Any, ids: list[int], max_tokens: int, cached: int) -> dict[str, Any]:
    """Greedy answer of ``ids`` with vLLM's prefix cache holding exactly its first ``cached`` tokens."""
    from vllm import SamplingParams

    assert llm.reset_prefix_cache()
    if cached:
        llm.generate([{"prompt_token_ids": ids[:cached]}], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    hit = int(out.num_cached_tokens or 0)
    if hit != cached:
        raise RuntimeError(f"vLLM's prefix cache served {hit} tokens, not the {cached} sent before")
    comp = out.outputs[0]
    logprobs = [sorted((t, lp.logprob) for t, lp in step.items()) for step in comp.logprobs or []]
    return {"cached": hit, "ids": list(comp.token_ids), "logprobs": logprobs,
            "finish_reason": comp.finish_reason}


def plain_llm(model_dir: Path, **kwargs: Any):
    """vLLM in this process with its prefix cache and nothing else (no connector, its own scheduler)."""
    from orbitkv.checks.engine import in_process_llm

    return in_process_llm(str(model_dir), load_format="auto", dtype="bfloat16", block_size=BLOCK_SIZE,
                          enable_prefix_caching=True, enforce_eager=True, max_num_seqs=1, **kwargs)


EXACT = {"orbitkv": {"modes": ["exact"], "save": False}}


def _kv_phase(model_dir: Path, cases: list[tuple[list[int], dict[str, int]]],
              max_len: int) -> dict[str, dict[str, int]]:
    """Per split: trials whose prompt KV differs from a full prefill's with vLLM's prefix cache
    serving the head (``kv_differing``); and, with OrbitKV serving the same head from its store
    instead (exact only; vLLM's prefix cache emptied), trials whose KV or answer differs from the
    prefix-cache run's (``orbitkv_exact_kv_differing_from_prefix_cache``; the tokens it served:
    ``orbitkv_exact_served_tokens``, against ``cached_tokens``)."""
    from orbitkv.checks.engine import OFF, InProcessEngine, orbitkv_llm
    from orbitkv_lab.checks.batch_variance import _generate_keeping_cache, _kv

    keys = ("kv_differing", "orbitkv_exact_kv_differing_from_prefix_cache",
            "orbitkv_exact_kv_differing_from_full", "cached_tokens", "orbitkv_exact_served_tokens")
    out: dict[str, dict[str, Any]] = {split: dict.fromkeys(keys, 0) for split in SPLITS}
    for row in out.values():
        row["kv_differing_tokens_from_the_end"] = []
    extra = {"chunk_size": BLOCK_SIZE, "text_chunking": "fixed", "max_local_cpu_size": 0.2}
    with orbitkv_llm(str(model_dir), extra, max_model_len=max_len, block_size=BLOCK_SIZE) as llm:
        eng = InProcessEngine(llm, block_size=BLOCK_SIZE)
        for ids, cuts in cases:
            want = _kv(eng, eng.generate(ids, OFF).block_ids, len(ids))
            for split in SPLITS:
                eng.generate(ids[: cuts[split]], OFF)  # empties the prefix cache, then caches the head
                apc = _kv(eng, _generate_keeping_cache(eng, ids, OFF), len(ids))
                row = out[split]
                row["cached_tokens"] += cuts[split]
                first = _first_differing_token(apc, want)
                row["kv_differing"] += first is not None
                if first is not None:
                    row["kv_differing_tokens_from_the_end"].append(len(ids) - first)
                # The head saved by a request of its own (a prefill of the same length as the
                # warm-up above), then loaded by OrbitKV into the whole prompt.
                eng.generate(ids[: cuts[split]], {"orbitkv": {"modes": ["exact"], "load": False}})
                eng.flush()
                run = eng.generate(ids, EXACT)
                row["orbitkv_exact_served_tokens"] += run.num_served(0, len(ids))
                got = _kv(eng, run.block_ids, len(ids))
                row["orbitkv_exact_kv_differing_from_prefix_cache"] += _first_differing_token(got, apc) is not None
                row["orbitkv_exact_kv_differing_from_full"] += _first_differing_token(got, want) is not None
    return out


def _first_differing_token(a: list[Any], b: list[Any]) -> int | None:
    """The first token whose K or V differs in any layer (None: all equal)."""
    rows = [int((x != y).flatten(1).any(1).nonzero()[0]) for x, y in zip(a, b, strict=True) if (x != y).any()]
    return min(rows) if rows else None


if __name__ == "__main__":
    sys.exit(main())
