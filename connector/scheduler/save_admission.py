"""Which computed chunks are worth a save (``save_admission``).

A save costs the step a gather per layer and the background writer an encode, a hash and the
tiers' writes, on the same cores as the forward. Most chunks a request computes never come back
in the same place: the step's fresh tail (the question, the tool output), and, while vLLM's own
prefix cache keeps up, everything it already holds. ``recurring`` saves a computed chunk when:

- its key was seen computed before (its KV recurs and vLLM's prefix cache did not keep it: that is
  when a copy of it pays), or its item is registered (a canonical of it is stored: the client said
  it will come back);
- or its request's lineage recurs beyond vLLM's cache (an earlier chunk of the same request, wholly
  past vLLM's prefix-cache hit and reaching a whole block past it, was served by OrbitKV or seen
  computed before: a session coming back after vLLM evicted it) and it is not the prompt's last
  chunk (the question at the end, which the session's next prompt does not repeat). So a growing
  session is saved from its second computed turn on, and its new turns from then on, not one turn
  late. A short chunk in the partial block right after vLLM's hit (a chat template's turn marker)
  is computed again on every request, whatever vLLM holds: it is saved when seen again, but it
  says nothing of the lineage.

For a request that accepts approximate KV the chunk's content is what recurs (survivor and
transfer serve it behind any antecedent), so its cid is what is remembered. ``all`` saves every
computed chunk on first sight.

Remembered keys are bounded (``save_admission_keys``, least recently seen forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict


class SaveAdmission:
    __slots__ = ("_is_all", "_max_keys", "_seen", "num_admitted", "num_declined")

    def __init__(self, policy: str, max_keys: int) -> None:
        if policy not in ("all", "recurring"):
            raise ValueError(f"save_admission: {policy!r} is not one of 'all', 'recurring'")
        self._is_all = policy == "all"
        self._max_keys = max_keys
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.num_admitted = 0
        self.num_declined = 0

    def remember(self, seen_key: str) -> bool:
        """Whether ``seen_key`` was seen computed before; remembers it either way."""
        if seen_key in self._seen:
            self._seen.move_to_end(seen_key)
            return True
        self._seen[seen_key] = None
        if len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        return False

    def admit(self, has_reason: bool) -> bool:
        """Whether a computed chunk is saved, given whether it has a reason to (see the module
        doc); counted."""
        if self._is_all or has_reason:
            self.num_admitted += 1
            return True
        self.num_declined += 1
        return False

    def take_counts(self) -> tuple[int, int]:
        """(admitted, declined) since the last call."""
        counts = (self.num_admitted, self.num_declined)
        self.num_admitted = self.num_declined = 0
        return counts
