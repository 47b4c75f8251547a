"""vLLM's prefix cache, split by lineage and tenant: a block hasher per namespaced request.

vLLM finds a request's cached prefix by its block hashes (``request.block_hashes``, a chain: each
hash covers the whole prefix up to its block) and caches every block it allocates under the same
hashes. OrbitKV replaces the hasher of a request that needs a namespace:

- a request under an approximate policy: its blocks hash as vLLM's own while they are exact, and as
  ``tag(policy, h)`` from the first block holding approximate KV on. An exact request (vLLM's plain
  chain) then never finds approximate KV, and a request under the same policy still finds both;
- a request whose tenant is not the deployment's: every hash is ``tag(tenant, h)``, so tenants a
  request may pick (``request_tenants``) never share vLLM's cache either.

Each tagged hash is a hash of vLLM's own hash of that block, which already covers the whole prefix:
namespaces never meet, and a block's approximate hash does not depend on where the request's
approximation began, so a later request can switch from exact to approximate blocks at any block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

HashFn = Callable[[Any], bytes]


class LineageHasher:
    """Stands in for ``request._block_hasher``; vLLM calls it as ``hasher(request)`` for new blocks."""

    def __init__(
        self, inner: Callable[[Request], list[bytes]] | None, hash_fn: HashFn, base_tag: str,
        approx_tag: str,
    ) -> None:
        self._inner = inner
        self._hash_fn = hash_fn
        self._base_tag = base_tag
        self._approx_tag = approx_tag
        # vLLM's own chain, which vLLM's hasher extends.
        self.plain: list[bytes] = []
        # Blocks from this index on hold approximate KV (None: the request is exact so far).
        self.approx_from_block: int | None = None
        self._memo: dict[tuple[int, bool], bytes] = {}

    @classmethod
    def install(
        cls, request: Request, hash_fn: HashFn, base_tag: str, approx_tag: str
    ) -> LineageHasher:
        """Take over ``request``'s hashing (vLLM already hashed its prompt: those are kept aside)."""
        hasher = cls(getattr(request, "_block_hasher", None), hash_fn, base_tag, approx_tag)
        hasher.plain = list(request.block_hashes)
        request._block_hasher = hasher
        hasher.show(request, None)
        return hasher

    @property
    def is_approximate_allowed(self) -> bool:
        return bool(self._approx_tag)

    def __call__(self, request: Request) -> list[bytes]:
        if self._inner is None:
            return []
        shown = request.block_hashes
        request.block_hashes = self.plain  # vLLM's hasher chains from the last plain hash
        try:
            new = self._inner(request)
        finally:
            request.block_hashes = shown
        start = len(self.plain)
        self.plain.extend(new)
        return [self.hash_at(k, self.approx_from_block) for k in range(start, len(self.plain))]

    def hash_at(self, k: int, approx_from_block: int | None) -> bytes:
        is_approx = approx_from_block is not None and k >= approx_from_block
        key = (k, is_approx)
        found = self._memo.get(key)
        if found is None:
            found = self._tag(self._base_tag, self.plain[k]) if self._base_tag else self.plain[k]
            if is_approx:
                found = self._tag(self._approx_tag, found)
            self._memo[key] = found
        return found

    def _tag(self, namespace: str, block_hash: bytes) -> bytes:
        return self._hash_fn(("orbitkv", namespace, block_hash))

    def show(self, request: Request, approx_from_block: int | None) -> None:
        """Make vLLM see the chain that switches to approximate blocks at ``approx_from_block``."""
        request.block_hashes = [self.hash_at(k, approx_from_block) for k in range(len(self.plain))]

    def set_lineage(self, request: Request, approx_from_token: int | None, block_size: int) -> None:
        """From the block holding ``approx_from_token`` on, this request's blocks are approximate."""
        self.approx_from_block = None if approx_from_token is None else approx_from_token // block_size
        self.show(request, self.approx_from_block)

    def best_switch(self, is_cached: Callable[[bytes], bool], max_blocks: int) -> tuple[int, int]:
        """The block ``j`` where a lookup should switch from exact to approximate blocks, and how
        many blocks that chain hits: exact blocks as far as they go, then whichever switch reaches
        furthest (ties keep more exact blocks)."""
        n = min(len(self.plain), max_blocks)
        num_exact = 0
        while num_exact < n and is_cached(self.hash_at(num_exact, None)):
            num_exact += 1
        if not self._approx_tag:
            return num_exact, num_exact
        best, best_len = num_exact, num_exact
        run_end = n
        # run_end: the first block >= j not cached as approximate, scanning j downwards.
        for j in range(n - 1, -1, -1):
            if not is_cached(self.hash_at(j, j)):
                run_end = j
                continue
            if j <= num_exact and run_end > best_len:
                best, best_len = j, run_end
        return best, best_len
