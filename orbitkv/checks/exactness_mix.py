"""The scripted request mix of ``orbitkv check exactness``: who asks what, in which order.

Prompts are token ids built from 32-token segments (one chunk each, ``text_chunking: fixed``) and a
short question tail. Each request says whether it opted into approximate KV (``is_opted_in``: it
sends ``approximate: true``, under ``approximate_reuse: request``); every other request
must never be served approximate KV, and every request served only exact KV (opted in or not)
must answer as a full prefill does. The kinds:

- ``agent``: a salted agent session sliding a window, reordering and recalling (approximate KV);
- ``exact_only`` / ``reuse_off``: right after each agent turn, the same prompt in the same session
  with ``modes: ["exact"]`` / ``load: false``: vLLM's prefix cache then holds the turn's
  approximate blocks, which these must never read;
- ``not_opted_in``: the same agent in its own salted session, naming approximate modes but not
  opting in (a salt isolates; it does not opt in): exact only;
- ``tenant``: two allowed tenants on one prompt, and one the deployment does not allow;
- ``salt``: three salts on one prompt;
- ``lora``: the base model then an adapter on one prompt, then the adapter again;
- ``prompt_logprobs``: prompts whose chunks are stored (a prefix run and a hole), asked for their
  prompt logprobs;
- ``corrupt``: before the request, the entries of some of its stored chunks are corrupted or cut
  on disk (loads that fail; vLLM recomputes), then the prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHUNK = 32
TAIL = 8
LORA_NAME = "adapter-a"
TENANTS = ("t1", "t2")
# What a request that opts in to approximate KV sends (kv_transfer_params["orbitkv"]).
OPT_IN = {"approximate": True}


@dataclass(frozen=True)
class Ask:
    """One request of the mix."""

    name: str
    kind: str
    ids: tuple[int, ...]
    cache_salt: str | None = None
    params: dict[str, Any] | None = None  # kv_transfer_params["orbitkv"]
    lora: str | None = None
    is_prompt_logprobs: bool = False
    is_opted_in: bool = False
    # Before sending: corrupt ("flip") or truncate ("cut") the stored entries of these chunks
    # (indexes into the prompt's 32-token chunks).
    corrupt: tuple[tuple[int, str], ...] = ()
    # What it must have been served (checked when set): at least these tokens, none at all.
    expect_refused: bool = False
    expect_nothing_served: bool = False
    tags: tuple[str, ...] = field(default=(), compare=False)


def segment(seed: int, num_tokens: int = CHUNK) -> tuple[int, ...]:
    """``num_tokens`` token ids, a function of ``seed`` (ids 10..999 of the tiny vocab)."""
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(num_tokens):
        x = (1103515245 * x + 12345) & 0x7FFFFFFF
        out.append(10 + x % 990)
    return tuple(out)


def _prompt(*seeds: int, tail: int) -> tuple[int, ...]:
    return tuple(t for s in seeds for t in segment(s)) + segment(tail, TAIL)


def _agent_turns(base: int, num_turns: int) -> list[tuple[str, tuple[int, ...]]]:
    """A window of 3 over items base+1..: slides, one reorder, one recall; sys first."""
    sys_ = base
    items = [base + i for i in range(1, 8)]
    windows = [items[0:3], items[1:4], items[2:5], [items[4], items[2], items[3]],
               items[3:6], [items[4], items[5], items[0]]]
    kinds = ["start", "slide", "slide", "reorder", "slide", "recall"]
    out = []
    for turn, (kind, window) in enumerate(zip(kinds, windows, strict=True)):
        if turn >= num_turns:
            break
        out.append((kind, _prompt(sys_, *window, tail=base + 50 + turn)))
    return out


def build_mix(num_agent_turns: int = 6) -> list[Ask]:
    """The mix, in sending order (>= 40 requests at the default size)."""
    asks: list[Ask] = []
    agent = "agent-1"
    for turn, (kind, ids) in enumerate(_agent_turns(1000, num_agent_turns)):
        asks.append(Ask(f"agent {turn} ({kind})", "agent", ids, agent, OPT_IN, is_opted_in=True))
        asks.append(Ask(f"agent {turn} exact-only", "exact_only", ids, agent, {"modes": ["exact"]}))
        asks.append(Ask(f"agent {turn} reuse off", "reuse_off", ids, agent, {"load": False}))
    for turn, (kind, ids) in enumerate(_agent_turns(2000, num_agent_turns)):
        asks.append(Ask(f"not opted in {turn} ({kind})", "not_opted_in", ids, "agent-2",
                        {"modes": ["exact", "survivor", "patched", "orbit"]}))
    shared = _prompt(3001, 3002, 3003, tail=3050)
    asks += [
        Ask("tenant t1", "tenant", shared, params={"tenant": "t1"}),
        Ask("tenant t2 (nothing of t1's)", "tenant", shared, params={"tenant": "t2"},
            expect_nothing_served=True),
        Ask("tenant t1 again", "tenant", shared, params={"tenant": "t1"}),
        Ask("tenant t3 (not allowed)", "tenant", shared, params={"tenant": "t3"},
            expect_refused=True),
        Ask("tenant t2 again", "tenant", shared, params={"tenant": "t2"}),
    ]
    salted = _prompt(3101, 3102, tail=3150)
    asks += [Ask(f"salt {s}", "salt", salted, s, OPT_IN, is_opted_in=True,
                 expect_nothing_served=i > 0)
             for i, s in enumerate(("u1", "u2", "u3"))]
    lora = _prompt(3201, 3202, tail=3250)
    asks += [
        Ask("lora: base", "lora", lora),
        Ask("lora: adapter (nothing of the base's)", "lora", lora, lora=LORA_NAME,
            expect_nothing_served=True),
        Ask("lora: adapter again", "lora", lora, lora=LORA_NAME),
    ]
    holed = _prompt(3301, 3302, 3303, 3304, tail=3350)
    asks += [
        Ask("prompt logprobs: store it", "prompt_logprobs", holed),
        Ask("prompt logprobs: stored prompt", "prompt_logprobs", holed, is_prompt_logprobs=True,
            expect_nothing_served=True),
        Ask("prompt logprobs: other salt", "prompt_logprobs", holed, "u9", OPT_IN, is_prompt_logprobs=True,
            is_opted_in=True, expect_nothing_served=True),
    ]
    broken = _prompt(3401, 3402, 3403, 3404, tail=3450)
    asks += [
        Ask("corrupt: store it", "corrupt", broken),
        Ask("corrupt: second chunk flipped, fourth cut", "corrupt", broken,
            corrupt=((1, "flip"), (3, "cut"))),
        Ask("corrupt: again (re-saved)", "corrupt", broken),
        Ask("corrupt: first chunk flipped", "corrupt", broken, corrupt=((0, "flip"),)),
        Ask("corrupt: again", "corrupt", broken),
    ]
    return asks
