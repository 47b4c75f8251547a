"""The planner tests' store view and prompt helpers (``test_planner*.py``, ``test_recompute.py``)."""

from __future__ import annotations

from orbitkv.connector.chunking import KeyContext, chunk_prompt
from orbitkv.store.keys import antecedent_hash, conditioned_key

CTX = KeyContext("fp", "mha:bfloat16", "")
CS = 4
# A request's approximate policy tag (connector/scheduler/lineage.py); "" plans exact entries only.
P = "a" * 32
Q = "b" * 32


class DictView:
    """Implements the planner's StoreView over plain dicts, counting round trips."""

    def __init__(self) -> None:
        self.tiers: dict[str, str] = {}
        self.antecedents: dict[str, list[tuple[str, ...]]] = {}
        self.num_calls = 0

    @classmethod
    def holding(cls, chunks):
        """A view holding the exact conditioned entry of each of ``chunks``."""
        view = cls()
        for c in chunks:
            view.add_conditioned(c)
        return view

    def add_conditioned(self, chunk, antecedent=None, tier="memory", lineage=""):
        ante = chunk.antecedent if antecedent is None else tuple(antecedent)
        self.tiers[conditioned_key(chunk.cid, antecedent_hash(ante), lineage)] = tier
        self.antecedents.setdefault(chunk.cid, []).append(ante)

    def add(self, key, tier="memory"):
        self.tiers[key] = tier

    def lookup(self, keys):
        self.num_calls += 1
        return [self.tiers.get(k) for k in keys]

    def batch_antecedents(self, cids):
        self.num_calls += 1
        return [list(self.antecedents.get(c, [])) for c in cids]


def mode_summary(plan):
    """Tokens served per mode by ``plan``, its holes included."""
    out: dict[str, int] = {}
    for item in plan.items:
        out[item.mode] = out.get(item.mode, 0) + item.num_tokens
    return out


def make_prompt(*segments):
    return [t for seg in segments for t in [seg] * CS]


def make_chunks(*segments, tail=()):
    return chunk_prompt(make_prompt(*segments) + list(tail), [], CS, CTX, text_chunking="fixed")
