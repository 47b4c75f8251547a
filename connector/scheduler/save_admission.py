"""Which computed chunks are worth a save (``save_admission``).

A save costs the step a gather per layer and the background writer an encode, a hash and the
tiers' writes, on the same cores as the forward. Most chunks a request computes never come back
in the same place: the step's fresh tail (the question, the tool output), and, while vLLM's own
prefix cache keeps up, everything it already holds. ``recurring`` saves a chunk only once it is
seen computed a second time under the same key (its KV recurs and vLLM's prefix cache did not
keep it: that is when a copy of it pays), or when its item is registered (a canonical of it is
stored: the client said it will come back). For a request that accepts approximate KV the chunk's
content is what recurs (survivor and transfer serve it behind any antecedent), so its cid is what
is remembered. ``all`` saves every computed chunk on first sight.

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

    def admit(self, seen_key: str, *, is_registered: bool) -> bool:
        """Whether a chunk computed now under ``seen_key`` is saved; remembers the key either way."""
        is_seen = seen_key in self._seen
        if is_seen:
            self._seen.move_to_end(seen_key)
        else:
            self._seen[seen_key] = None
            if len(self._seen) > self._max_keys:
                self._seen.popitem(last=False)
        if self._is_all or is_seen or is_registered:
            self.num_admitted += 1
            return True
        self.num_declined += 1
        return False

    def take_counts(self) -> tuple[int, int]:
        """(admitted, declined) since the last call."""
        counts = (self.num_admitted, self.num_declined)
        self.num_admitted = self.num_declined = 0
        return counts
