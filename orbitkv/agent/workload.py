"""A deterministic agent-style multimodal trace, shared by ``orbitkv demo`` and ``orbitkv bench agent``.

An agent looks at a stream of screenshots through a window of ``window`` images. Every step sends
the system text, the window's images (optionally each with a text observation) and a question:

- ``slide``: the window moves on by one new image (the oldest falls out);
- ``reorder``: the same images as the step before, in another order (no new image);
- ``recall``: an image that fell out of the window earlier comes back, replacing the oldest;
- ``observe`` (``recurring`` trace only): no new screenshot, only a new tool output and question;
- ``append`` (``sessions`` trace only): the session's history so far, one new screenshot after it.

The traces (``TRACES``):

- ``basic`` (``make_workload``): start, slides, one reorder, one recall. A fresh tool output sits
  before the window's last item (a result the agent got just before that screenshot), so cached
  items follow fresh text;
- ``recurring`` (``make_recurring_workload``): the window operations come back. A set is reordered
  twice, an evicted image is recalled twice behind the same antecedent (a look back shown after the
  unchanged window, for that step only), text-only ``observe`` steps come between; the tool output
  sits right before the question, so an image's antecedent is made of images and observations only;
- ``fresh`` (``make_fresh_workload``): every step a window of new images and a new tool output,
  nothing to reuse but the system text (a cache's cost where it cannot help);
- ``sessions`` (``make_sessions_workload``): ``window`` agent sessions interleaved round-robin, each
  keeping its whole history (every screenshot it took, oldest first, each with its observation)
  and adding one screenshot per turn. A turn's prompt is the session's previous prompt without its
  question, plus the new screenshot and a question: exact reuse throughout, but between two turns
  of a session every other session runs one, so a prefix cache smaller than the sessions'
  working set has evicted it (``bench agent --kv-blocks``).

With ``obs_words`` each image is followed by its observation (fixed per image, so cached with it);
every step ends with a new question. The floors of a step (``floors.py``) are counted from the trace.

The first step (``start``) fills the window. Images are synthetic "screenshots" drawn with PIL:
a title bar, a few coloured shapes and a line of text, all a function of ``(seed, image index)``,
so the same index always gives the same bytes and a different index a different picture.

Nothing here imports vLLM: the trace and the request bodies are plain data.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

SLIDE, REORDER, RECALL, START, OBSERVE = "slide", "reorder", "recall", "start", "observe"
APPEND = "append"
KINDS = (START, SLIDE, REORDER, RECALL, OBSERVE, APPEND)

SYSTEM_TEXT = (
    "You are a computer-use agent. You see the most recent screenshots of the user's desktop, "
    "oldest first. Answer the question about them in a few words."
)
_QUESTIONS = (
    "Which window is in front now?",
    "What changed since the previous screenshot?",
    "Where is the red button?",
    "What does the title bar say?",
    "Which screenshot shows the dialog?",
    "How many shapes are visible?",
)
_WORDS = (
    "file edit view save open close cancel submit search settings inbox draft terminal build "
    "deploy login logout share upload download refresh back next previous help window panel"
).split()
_COLOURS = ((220, 50, 47), (38, 139, 210), (133, 153, 0), (181, 137, 0), (108, 113, 196), (42, 161, 152))


@dataclass(frozen=True)
class Step:
    """One request of the trace: which images, in which order, and why."""

    index: int
    kind: str
    images: tuple[int, ...]  # image ids in prompt order
    question: str
    new_images: tuple[int, ...] = ()  # ids never sent before this step
    note: str = ""
    tool_text: str = ""  # a fresh tool output (where: ``Workload.is_tool_before_question``)


@dataclass(frozen=True)
class Workload:
    seed: int
    window: int
    steps: tuple[Step, ...]
    image_size: int = 64
    obs_words: int = 0  # words of text observation after each image (0: none)
    system_text: str = SYSTEM_TEXT
    tool_words: int = 0  # words of fresh tool output per step (0: none)
    # Where the tool output goes: right before the question, or before the window's last item.
    is_tool_before_question: bool = False
    trace: str = "basic"

    @property
    def session(self) -> str:
        """The agent session this trace is: every request carries it as vLLM's ``cache_salt``,
        the namespace in which OrbitKV may serve the agent approximate KV (its own removed
        chunks, never another session's)."""
        return f"agent-{self.seed}"

    @property
    def image_ids(self) -> list[int]:
        seen: list[int] = []
        for step in self.steps:
            seen.extend(i for i in step.images if i not in seen)
        return seen

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"step": s.index, "kind": s.kind, "images": list(s.images), "new": list(s.new_images), "note": s.note}
            for s in self.steps
        ]


def make_workload(
    *,
    seed: int = 0,
    window: int = 3,
    num_steps: int = 6,
    reorder_at: int | None = None,
    recall_at: int | None = None,
    image_size: int = 64,
    obs_words: int = 0,
    tool_words: int = 0,
) -> Workload:
    """The trace: ``start``, then slides, with one ``reorder`` and one ``recall`` step.

    By default the reorder comes at step ``num_steps // 2`` and the recall at the last step, so an
    image has been evicted by then. ``reorder_at`` / ``recall_at`` move them (``-1``: leave out).
    """
    if window < 2:
        raise ValueError("window must be >= 2 (a reorder needs two images)")
    if reorder_at is None:
        reorder_at = max(2, num_steps // 2)
        if recall_at is None and reorder_at == num_steps - 1:
            reorder_at -= 1
    if recall_at is None:
        recall_at = num_steps - 1
    if num_steps < 3 and (reorder_at >= 0 or recall_at >= 0):
        raise ValueError("num_steps must be >= 3 for a reorder and a recall")
    if reorder_at == recall_at and reorder_at >= 0:
        raise ValueError("reorder and recall must be different steps")
    for name, at in (("reorder_at", reorder_at), ("recall_at", recall_at)):
        if at == 0 or at >= num_steps:
            raise ValueError(f"{name}={at} must be in 1..{num_steps - 1} (or -1 to leave out)")
    rng = random.Random(seed)
    steps: list[Step] = []
    next_id = window
    current = list(range(window))
    evicted: list[int] = []
    # When each image in the window (re)entered it: a slide or a recall evicts the stalest one,
    # wherever a reorder put it, and keeps the order of the others.
    entered = {image_id: 0 for image_id in current}

    def evict_oldest() -> int:
        out = min(current, key=lambda i: (entered[i], i))
        current.remove(out)
        evicted.append(out)
        return out

    steps.append(Step(0, START, tuple(current), rng.choice(_QUESTIONS), tuple(current), f"window of {window}"))
    for i in range(1, num_steps):
        question = rng.choice(_QUESTIONS)
        if i == reorder_at:
            # A fixed non-identity permutation: rotate by one, the newest image moves first.
            current = current[-1:] + current[:-1]
            steps.append(Step(i, REORDER, tuple(current), question, (), "same images, last moved first"))
            continue
        if i == recall_at:
            if not evicted:
                raise ValueError(f"recall at step {i}: no image has been evicted yet (slide first)")
            back = evicted.pop(0)  # the image evicted longest ago
            out = evict_oldest()
            current.append(back)
            entered[back] = i
            steps.append(Step(i, RECALL, tuple(current), question, (), f"image {out} out, evicted image {back} recalled"))
            continue
        out = evict_oldest()
        current.append(next_id)
        entered[next_id] = i
        steps.append(Step(i, SLIDE, tuple(current), question, (next_id,), f"image {out} out, {next_id} in"))
        next_id += 1
    if tool_words > 0:
        steps = [
            dataclasses.replace(step, tool_text=tool_output(seed, step.index, tool_words))
            for step in steps
        ]
    return Workload(seed, window, tuple(steps), image_size=image_size, obs_words=obs_words,
                    tool_words=tool_words)


# The ``recurring`` trace after its start step, cycled for longer traces: a set reordered twice
# (a text-only step between), then one evicted image recalled twice behind the same window.
RECURRING_PATTERN = (SLIDE, SLIDE, REORDER, OBSERVE, REORDER, SLIDE, RECALL, OBSERVE, RECALL,
                     SLIDE, SLIDE, RECALL, SLIDE)


def make_recurring_workload(
    *,
    seed: int = 0,
    window: int = 4,
    num_steps: int = 14,
    image_size: int = 64,
    obs_words: int = 0,
    tool_words: int = 0,
) -> Workload:
    """The ``recurring`` trace (module doc): ``RECURRING_PATTERN`` after the start step.

    A slide evicts the image that entered the window earliest (wherever a reorder put it). A
    reorder rotates the window by one (the last image moves first), so two reorders in a row give
    two orders of one set, both new. A recall shows an evicted image after the window, for that
    step only: the same image as the last recall while the window has not changed since (same
    antecedent), else the image evicted longest ago that was not recalled yet.
    """
    if window < 3:
        raise ValueError("window must be >= 3 (two reorders of a set in two new orders)")
    if num_steps < 10:
        raise ValueError("num_steps must be >= 10 (a set reordered twice, an image recalled twice)")
    rng = random.Random(seed)
    current = list(range(window))
    entered = {image_id: 0 for image_id in current}
    evicted: list[int] = []
    recalled: set[int] = set()
    last_recall: tuple[tuple[int, ...], int] | None = None  # (window, image) of the last recall
    next_id = window
    steps = [Step(0, START, tuple(current), rng.choice(_QUESTIONS), tuple(current), f"window of {window}")]
    for i in range(1, num_steps):
        kind = RECURRING_PATTERN[(i - 1) % len(RECURRING_PATTERN)]
        question = rng.choice(_QUESTIONS)
        if kind == SLIDE:
            out = min(current, key=lambda j: (entered[j], j))
            current.remove(out)
            evicted.append(out)
            current.append(next_id)
            entered[next_id] = i
            steps.append(Step(i, SLIDE, tuple(current), question, (next_id,), f"image {out} out, {next_id} in"))
            next_id += 1
        elif kind == REORDER:
            current = current[-1:] + current[:-1]
            steps.append(Step(i, REORDER, tuple(current), question, (), "same images, last moved first"))
        elif kind == OBSERVE:
            steps.append(Step(i, OBSERVE, tuple(current), question, (), "no new screenshot"))
        else:
            if last_recall is not None and last_recall[0] == tuple(current):
                back, note = last_recall[1], f"image {last_recall[1]} again, behind the same window"
            else:
                back = next(j for j in evicted if j not in recalled)
                recalled.add(back)
                note = f"evicted image {back} shown after the window"
            last_recall = (tuple(current), back)
            steps.append(Step(i, RECALL, (*current, back), question, (), note))
    if tool_words > 0:
        steps = [dataclasses.replace(s, tool_text=tool_output(seed, s.index, tool_words)) for s in steps]
    return Workload(seed, window, tuple(steps), image_size=image_size, obs_words=obs_words,
                    tool_words=tool_words, is_tool_before_question=True, trace="recurring")


def make_sessions_workload(
    *,
    seed: int = 0,
    window: int = 6,
    num_steps: int = 36,
    image_size: int = 64,
    obs_words: int = 0,
    tool_words: int = 0,
) -> Workload:
    """The ``sessions`` trace (module doc): ``window`` sessions, ``num_steps`` turns in all, turn
    ``i`` belonging to session ``i % window``. Session ``s``'s screenshots are ids ``s * 1000 + j``."""
    if window < 2:
        raise ValueError("window (the number of sessions) must be >= 2")
    if num_steps < 2 * window:
        raise ValueError("num_steps must be >= 2 x the sessions (each session comes back at least once)")
    rng = random.Random(seed)
    steps = []
    for i in range(num_steps):
        session, turn = i % window, i // window
        images = tuple(session * 1000 + j for j in range(turn + 1))
        kind = START if turn == 0 else APPEND
        steps.append(Step(i, kind, images, rng.choice(_QUESTIONS), images[-1:],
                          f"session {session}, turn {turn}: image {images[-1]} appended"))
    if tool_words > 0:
        steps = [dataclasses.replace(s, tool_text=tool_output(seed, s.index, tool_words)) for s in steps]
    return Workload(seed, window, tuple(steps), image_size=image_size, obs_words=obs_words,
                    tool_words=tool_words, is_tool_before_question=True, trace="sessions")


def make_fresh_workload(
    *,
    seed: int = 0,
    window: int = 3,
    num_steps: int = 8,
    image_size: int = 64,
    obs_words: int = 0,
    tool_words: int = 0,
) -> Workload:
    """The ``fresh`` trace: every step a window of ``window`` images never sent before and a new
    tool output, so no request has anything to reuse beyond the system text, which vLLM's prefix
    cache holds. What a cache costs a request it cannot help (issue 26: within 3% of APC)."""
    if window < 1:
        raise ValueError("window must be >= 1")
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    rng = random.Random(seed)
    steps = []
    for i in range(num_steps):
        images = tuple(range(i * window, (i + 1) * window))
        steps.append(Step(i, START, images, rng.choice(_QUESTIONS), images, f"new window {list(images)}"))
    if tool_words > 0:
        steps = [dataclasses.replace(s, tool_text=tool_output(seed, s.index, tool_words)) for s in steps]
    return Workload(seed, window, tuple(steps), image_size=image_size, obs_words=obs_words,
                    tool_words=tool_words, is_tool_before_question=True, trace="fresh")


TRACES = {"recurring": make_recurring_workload, "basic": make_workload, "sessions": make_sessions_workload,
          "fresh": make_fresh_workload}
# Each trace's default (window, steps); for ``sessions`` the window is the number of sessions.
TRACE_SHAPES = {"recurring": (4, 14), "basic": (3, 6), "sessions": (6, 36), "fresh": (3, 8)}


# -- images --------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def image_png(seed: int, image_id: int, size: int = 64) -> bytes:
    """A synthetic screenshot as PNG bytes, a pure function of its arguments."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"{seed}:{image_id}")
    bg = tuple(rng.randrange(200, 256) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    bar = max(4, size // 8)
    draw.rectangle([0, 0, size - 1, bar], fill=_COLOURS[image_id % len(_COLOURS)])
    draw.text((2, max(0, bar // 2 - 5)), f"#{image_id}", fill=(255, 255, 255))
    for _ in range(3 + rng.randrange(4)):
        x0, y0 = rng.randrange(0, size - 8), rng.randrange(bar + 1, size - 8)
        x1, y1 = x0 + rng.randrange(6, max(7, size // 2)), y0 + rng.randrange(6, max(7, size // 3))
        colour = rng.choice(_COLOURS)
        if rng.random() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=colour, outline=(0, 0, 0))
        else:
            draw.ellipse([x0, y0, x1, y1], fill=colour, outline=(0, 0, 0))
    draw.text((2, size - 12), rng.choice(_WORDS), fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def image_data_url(seed: int, image_id: int, size: int = 64) -> str:
    return "data:image/png;base64," + base64.b64encode(image_png(seed, image_id, size)).decode()


def tool_output(seed: int, step: int, num_words: int) -> str:
    """A deterministic, per-step tool result (new text every step)."""
    rng = random.Random(f"tool:{seed}:{step}")
    return f"[tool output, step {step}] " + " ".join(rng.choice(_WORDS) for _ in range(num_words))


def observation_text(seed: int, image_id: int, num_words: int) -> str:
    """A deterministic text observation (an accessibility-tree-like dump) for one screenshot."""
    if num_words <= 0:
        return ""
    rng = random.Random(f"obs:{seed}:{image_id}")
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    return f"[screen {image_id}] " + " ".join(words)


# -- requests ------------------------------------------------------------------------------------


def chat_messages(workload: Workload, step: Step, *, is_floor_removed: bool = False) -> list[dict[str, Any]]:
    """OpenAI chat messages for one step: system text, then the images (oldest first) with their
    observations, the tool output (before the last image, or before the question), then the
    question. ``is_floor_removed``: without the step's fresh content (new images and their
    observations, tool output, question), for counting the content floor's tokens."""
    content: list[dict[str, Any]] = []
    has_tool = bool(step.tool_text) and not is_floor_removed
    for position, image_id in enumerate(step.images):
        if has_tool and not workload.is_tool_before_question and position == len(step.images) - 1:
            content.append({"type": "text", "text": step.tool_text + "\n"})
        if is_floor_removed and image_id in step.new_images:
            continue
        content.append(
            {"type": "image_url", "image_url": {"url": image_data_url(workload.seed, image_id, workload.image_size)}}
        )
        obs = observation_text(workload.seed, image_id, workload.obs_words)
        if obs:
            content.append({"type": "text", "text": obs + "\n"})
    if has_tool and workload.is_tool_before_question:
        content.append({"type": "text", "text": step.tool_text + "\n"})
    if not is_floor_removed:
        content.append({"type": "text", "text": step.question})
    if not content:  # everything was fresh; vLLM refuses an empty list, not an empty text
        content.append({"type": "text", "text": ""})
    return [
        {"role": "system", "content": workload.system_text},
        {"role": "user", "content": content},
    ]


def chat_body(
    workload: Workload,
    step: Step,
    model: str,
    *,
    max_tokens: int = 2,
    stream: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` request body for one step (greedy, short answer)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(workload, step),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "cache_salt": workload.session,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body
