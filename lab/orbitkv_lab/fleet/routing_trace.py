"""The routing trace: agent teams over a fleet, the same trace under several routing arms, side by side.

A team is several agents looking at the same screenshots (text stand-ins here: the fleet's tiny
qwen2 reads no images): their prompts share the team's system text and the window of screenshots,
one line each, and differ in the agent's role line and question at the end. Per step the window
slides, is reordered, or recalls a screenshot that fell out (``STEPS``). Sessions move: from
``move_step`` on every agent works under a new session id (a handed-off sub-agent), so a router
that keys on the session places it afresh.

Each arm runs the same trace shape on its own text (another seed: arms never hit each other's KV),
and the arms are interleaved request by request (the order rotated every step), all servers up.
An arm is a ``Route``: where a request of a session is sent. Every request waits until no replica
is busy (``quiet``); accounting per request is the replicas' counters (``sessions.send``) plus
OrbitKV's tokens by tier (``vllm:orbitkv_hit_tokens_total{tier}``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from orbitkv.serving.http_client import scraped_label_totals

from .sessions import Reply, chat_body, percentile, send

_WORDS = (
    "screen window button click scroll page table row column cell value error retry open close "
    "file folder search result query tool call return status ready wait input output agent plan "
    "step goal check verify submit form field label text image chart report summary update"
).split()
# (kind, window as indices into the team's screenshots)
STEPS = (("start", (0, 1)), ("slide", (1, 2)), ("reorder", (2, 1)), ("recall", (0, 2)), ("slide", (2, 3)))
ROLES = ("planner", "verifier", "writer")


@dataclass(frozen=True)
class Agent:
    team: int
    role: str
    system: str
    shots: tuple[str, ...]

    def messages(self, step: int, seed: int) -> list[dict[str, str]]:
        _, window = STEPS[step]
        lines = [f"Screenshot {i}: {self.shots[i]}" for i in window]
        rng = random.Random(f"{seed}-{self.team}-{self.role}-{step}")
        question = " ".join(rng.choice(_WORDS) for _ in range(12))
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": "\n".join(lines) + f"\nRole: {self.role}. {question}?"}]


def make_team_agents(seed: int, num_teams: int, agents_per_team: int, *, system_words: int = 140,
                     shot_words: int = 130) -> list[Agent]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    agents = []
    for team in range(num_teams):
        system = f"You are team {team} of run {seed}. Tools: {text(system_words)}"
        shots = tuple(text(shot_words) for _ in range(4))
        agents.extend(Agent(team, ROLES[i % len(ROLES)], system, shots) for i in range(agents_per_team))
    return agents


def tier_tokens(url: str) -> dict[str, float]:
    """OrbitKV's tokens served on this replica so far, by tier (empty while it is down)."""
    return scraped_label_totals(url, "vllm:orbitkv_hit_tokens_total", "tier")


# (url, headers) for a request of ``session`` on ``replicas``; ``on_error(session)`` after a
# request to that target failed (an affinity route places the session again).
@dataclass
class Route:
    name: str
    target: Callable[[str], tuple[str, dict[str, str]]]
    on_error: Callable[[str], None] | None = None


def affinity_route(replica_urls: Sequence[str]) -> Route:
    """Session affinity: a new session goes to the replica with the fewest sessions, then stays;
    a replica that fails it places it again (what a sticky router does)."""
    home: dict[str, int] = {}
    down: set[int] = set()

    def target(session: str) -> tuple[str, dict[str, str]]:
        if session not in home:
            counts = [sum(1 for h in home.values() if h == i) for i in range(len(replica_urls))]
            home[session] = min((i for i in range(len(replica_urls)) if i not in down),
                                key=lambda i: (counts[i], i), default=0)
        return replica_urls[home[session]], {}

    def on_error(session: str) -> None:
        down.add(home.pop(session, 0))

    return Route("affinity", target, on_error)


def header_route(name: str, url: str) -> Route:
    """A router that reads the session from ``X-Session-ID``."""
    return Route(name, lambda session: (url, {"X-Session-ID": session}))


def run_interleaved(routes: Sequence[Route], replica_urls: Sequence[str], *, seed: int,
                    num_teams: int, agents_per_team: int, steps: Sequence[int], move_step: int,
                    max_tokens: int, quiet: Callable[[], None] | None = None,
                    phase: str = "measure", before_step: Callable[[int], None] | None = None,
                    ) -> list[dict[str, Any]]:
    """One pass of the trace per route, interleaved; returns one record per request."""
    agents = {r.name: make_team_agents(seed + 1000 * i, num_teams, agents_per_team)
              for i, r in enumerate(routes)}
    records: list[dict[str, Any]] = []
    for n, step in enumerate(steps):
        if before_step is not None:
            before_step(step)
        order = list(routes[n % len(routes):]) + list(routes[: n % len(routes)])
        for a in range(num_teams * agents_per_team):
            for route in order:
                agent = agents[route.name][a]
                epoch = 1 if step >= move_step else 0
                session = f"{route.name}-{seed}-{agent.team}-{agent.role}-{epoch}"
                body = chat_body("model", agent.messages(step, seed), max_tokens=max_tokens)
                reply, tiers = _ask(route, session, body, replica_urls, quiet)
                records.append({"phase": phase, "arm": route.name, "step": step, "kind": STEPS[step][0],
                                "agent": a, "session": session, "body": body, "tiers": tiers,
                                **reply.to_json()})
    return records


def _ask(route: Route, session: str, body: dict[str, Any], replica_urls: Sequence[str],
         quiet: Callable[[], None] | None) -> tuple[Reply, dict[str, float]]:
    for attempt in range(2):
        if quiet is not None:
            quiet()
        url, headers = route.target(session)
        before = [tier_tokens(u) for u in replica_urls]
        reply = send(url, body, replica_urls, headers=headers)
        if reply.error is None or route.on_error is None or attempt:
            break
        route.on_error(session)
    tiers: dict[str, float] = {}
    if reply.replica is not None:
        after = tier_tokens(replica_urls[reply.replica])
        b = before[reply.replica]
        tiers = {k: v - b.get(k, 0.0) for k, v in after.items() if v - b.get(k, 0.0)}
    return reply, tiers


def summarize_arm(records: Sequence[dict[str, Any]], num_replicas: int) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    ttfts = [r["ttft_s"] for r in ok]
    by_tier: dict[str, float] = {}
    for r in ok:
        for tier, n in r["tiers"].items():
            by_tier[tier] = by_tier.get(tier, 0.0) + n
    load = [0] * num_replicas
    for r in ok:
        if r["replica"] is not None:
            load[r["replica"]] += 1

    def rate(n: float) -> float | None:
        return round(n / prompt, 4) if prompt else None

    return {
        "num_requests": len(records),
        "num_failed_requests": len(records) - len(ok),
        "prompt_tokens": prompt,
        "computed_tokens": sum(r["computed_tokens"] for r in ok),
        # The arms' texts differ (their own seeds): tokens computed per prompt token compares them.
        "computed_share": rate(sum(r["computed_tokens"] for r in ok)),
        "hit_rate": {"prefix_cache": rate(sum(r["prefix_cache_tokens"] for r in ok)),
                     "orbitkv": rate(sum(r["orbitkv_tokens"] for r in ok)),
                     **{f"orbitkv_{t}": rate(n) for t, n in sorted(by_tier.items())}},
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p95_s": _round(percentile(ttfts, 95)),
        "requests_per_replica": load,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
