"""The floors of a run: what a cache must compute at each step, counted from the trace itself.

A run is the episodes' traces sent in order to one server (every arm gets the same run), so "seen
before" means anywhere earlier in the run.

- **content floor**: the step's fresh content only: images never sent before (with their
  observations), its tool output, its question, and the system text the first time. No cache of
  any kind can avoid it; position-free reuse of everything else reaches it. Counted as the step's
  prompt tokens minus the tokens of the same prompt without its fresh content.
- **exact floor**: what an exact cache must compute: the fresh content, and every token whose
  antecedent (everything before it, with it) was never computed before: from the first token whose
  prefix no earlier prompt had, or the first fresh token if that comes first, to the end. An
  image's placeholder tokens are told apart by the image they stand for. Counted per token, the
  finest any exact cache could reach: vLLM's prefix cache reaches it up to its block size, OrbitKV's
  exact mode up to its chunks; only approximate reuse (``survivor``, ``patched``, ...) goes below.
  At least one token, as vLLM computes at least one.

Token ids come from a ``tokenize(messages) -> ids`` callable: the server's ``/tokenize`` (images
expanded to their placeholder tokens), called after the timed run so that it warms no arm's caches.
Nothing here reads what the system under test computed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orbitkv.agent.workload import Step, Workload, chat_messages

Tokenize = Callable[[list[dict[str, Any]]], "list[int] | None"]


@dataclass(frozen=True, slots=True)
class StepFloors:
    episode: int
    step: int
    prompt_tokens: int
    exact_floor_tokens: int
    content_floor_tokens: int | None  # None: the server would not tokenize the prompt without it
    num_new_images: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tag_images(ids: Sequence[int], image_token_id: int, image_keys: Sequence[Hashable]) -> list[Hashable]:
    """``ids`` with each image placeholder token replaced by (image key, index in the image).

    The placeholders of the i-th image in the prompt are the i-th equal share of all of them
    (every image of a trace has the same size, so the same number of placeholder tokens)."""
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    if not image_keys:
        if positions:
            raise ValueError(f"{len(positions)} image placeholder tokens in a prompt without images")
        return list(ids)
    per_image, rest = divmod(len(positions), len(image_keys))
    if rest or per_image == 0:
        raise ValueError(f"{len(positions)} image placeholder tokens do not split over {len(image_keys)} images")
    out: list[Hashable] = list(ids)
    for j, pos in enumerate(positions):
        out[pos] = (image_keys[j // per_image], j % per_image)
    return out


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def exact_floors(prompts: Sequence[Sequence[Hashable]], fresh_starts: Sequence[int | None]) -> list[int]:
    """For each tagged prompt: the tokens from the first one whose prefix no earlier prompt had, or
    from its first fresh token (``fresh_starts``; None: not known), whichever comes first; >= 1."""
    out = []
    for i, (prompt, fresh) in enumerate(zip(prompts, fresh_starts, strict=True)):
        start = max((common_prefix(prompt, earlier) for earlier in prompts[:i]), default=0)
        if fresh is not None:
            start = min(start, fresh)
        out.append(max(1, len(prompt) - start))
    return out


def run_floors(tokenize: Tokenize, workloads: Sequence[Workload], image_token_id: int) -> list[StepFloors]:
    """Both floors of every step of the run (``workloads`` in the order they were sent).

    The content floor is the prompt's tokens minus those of the same prompt without its fresh
    content; where the two first differ is the first fresh token."""
    if len({w.seed for w in workloads}) != len(workloads):
        raise ValueError("the episodes of a run must have distinct seeds (other images)")
    prompts: list[list[Hashable]] = []
    fresh_starts: list[int | None] = []
    meta: list[tuple[int, Step, int | None, int]] = []
    for episode, w in enumerate(workloads):
        for step in w.steps:
            ids = tokenize(chat_messages(w, step))
            if ids is None:
                raise RuntimeError(f"/tokenize failed for episode {episode} step {step.index}")
            tagged = tag_images(ids, image_token_id, [(w.seed, i) for i in step.images])
            if not prompts:  # the run's first request: all of it is fresh
                content, fresh = len(ids), 0
            else:
                rest = tokenize(chat_messages(w, step, is_floor_removed=True))
                kept = [(w.seed, i) for i in step.images if i not in step.new_images]
                content = None if rest is None else max(1, len(ids) - len(rest))
                fresh = None if rest is None else common_prefix(tagged, tag_images(rest, image_token_id, kept))
            prompts.append(tagged)
            fresh_starts.append(fresh)
            meta.append((episode, step, content, len(ids)))
    return [
        StepFloors(episode, step.index, num_ids, exact, content, len(step.new_images))
        for (episode, step, content, num_ids), exact in zip(meta, exact_floors(prompts, fresh_starts), strict=True)
    ]


# -- records against the floors ------------------------------------------------------------------


def attach_floors(records: Sequence[Any], floors: Sequence[StepFloors]) -> None:
    """Set each record's floors from the run's (matched by episode and step)."""
    by_step = {(f.episode, f.step): f for f in floors}
    for r in records:
        f = by_step.get((r.episode, r.step))
        if f is not None:
            r.exact_floor_tokens = f.exact_floor_tokens
            r.content_floor_tokens = f.content_floor_tokens
            r.num_new_images = f.num_new_images


def total(values: list[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else int(sum(values))  # type: ignore[arg-type]


def by_kind(records: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Per step kind: tokens computed against both floors, encoder items run against new images.

    ``encoder_items_run``: vLLM's own count (its iteration log), for every arm;
    ``encoder_items_registered``: the same count for the requests that registered the step's new
    images before it (None for an arm that does not register); ``orbitkv_encoded_items``: OrbitKV's
    per-request summary (None for an arm without OrbitKV). A total is None where any step's value
    is not known."""
    groups: dict[str, list[Any]] = {}
    for r in records:
        groups.setdefault(r.kind, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for kind, rs in groups.items():
        computed = total([r.computed_tokens for r in rs])
        exact = total([r.exact_floor_tokens for r in rs])
        content = total([r.content_floor_tokens for r in rs])
        orbitkv = [(r.orbitkv or {}).get("num_encoded_items") for r in rs]
        out[kind] = {
            "num_steps": len(rs),
            "computed_tokens": computed,
            "exact_floor_tokens": exact,
            "content_floor_tokens": content,
            "computed_over_exact_floor": _ratio(computed, exact),
            "computed_over_content_floor": _ratio(computed, content),
            "num_new_images": total([r.num_new_images for r in rs]),
            "encoder_items_run": total([r.encoder_items_run for r in rs]),
            "encoder_items_registered": total([r.encoder_items_registered for r in rs]),
            "orbitkv_encoded_items": total(orbitkv),
        }
    return out


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or not b else a / b
