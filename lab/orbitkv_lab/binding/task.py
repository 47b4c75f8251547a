"""Synthetic "legend + image" binding task for the OrbitKV fidelity lab (``--arch binding``).

An item is ``[BOS] + A + B + question -> answer``:

* **A, the legend** (``A_LEN`` = 16 tokens): a random balanced map of ``N_ENT`` = 8 entities onto
  ``N_ATTR`` = 4 attributes, written as a redundant patch code: one "swatch" token per entity,
  ``SWATCH0 + e * N_ATTR + attr_of[e]`` (it defines entity ``e`` as having that attribute), each
  swatch repeated ``A_REPEAT`` = 2 times, shuffled.
* **B, the image** (``B_LEN`` = 32 tokens): a label map of "patches", each an entity token, laid
  out as contiguous regions (runs) of one entity, like a segmented image. B refers to entities
  only and never names an attribute: what each region *is* (its attribute) needs A.

Questions (two tokens ``[Q_type, arg]``; the answer is predicted at ``arg``):

* ``QA e`` (single-hop, A): the attribute of entity ``e`` -- a readout of A's own tokens.
* ``QE``   (single-hop, B): the entity covering most patches of B -- a readout of B's own tokens.
* ``QM``   (multi-hop): the attribute covering most patches of B. Every patch must be bound to
  its attribute through A and the bound attributes aggregated over the whole image. The single
  query cannot redo the binding patch by patch itself (one query, 32 patches); it has to read
  attribute features that B's tokens absorbed from A while B was prefilled after A -- exactly
  what blind reuse (B cached after the anchor only) loses. In half of the items ("traps") the
  attribute of the majority *entity* is not the majority *attribute*, so the shortcut "look up
  the attribute of the most frequent entity" (which blind reuse would still allow) fails there.

Majorities are unique by a margin of >= 2 patches. Everything is deterministic from a seed
(``numpy.random.default_rng``). Token ids are the vocabulary (no tokenizer; ``VOCAB`` names them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

N_ENT = 8
N_ATTR = 4
A_REPEAT = 2
B_LEN = 32
MIN_REGION = 2

# vocabulary
PAD, BOS, SEP, Q_A, Q_E, Q_M, ARG = 0, 1, 2, 3, 4, 5, 6
ENT0 = 7
ATTR0 = ENT0 + N_ENT
SWATCH0 = ATTR0 + N_ATTR  # legend "swatch" patch tokens, one per (entity, attribute)
VOCAB_SIZE = SWATCH0 + N_ENT * N_ATTR  # 51

A_LEN = N_ENT * A_REPEAT  # 16

VOCAB = (
    ["<pad>", "<bos>", "<sep>", "<QA>", "<QE>", "<QM>", "<arg>"]
    + [f"ent{e}" for e in range(N_ENT)]
    + [f"attr{c}" for c in range(N_ATTR)]
    + [f"swatch{e}:{c}" for e in range(N_ENT) for c in range(N_ATTR)]
)
assert len(VOCAB) == VOCAB_SIZE
PREFIX_LEN = 1  # the anchor (BOS)
Q_LEN = 2
QTYPES = ("A", "E", "M")  # single-hop A, single-hop B, multi-hop
QTOKEN = {"A": Q_A, "E": Q_E, "M": Q_M}


@dataclasses.dataclass(frozen=True)
class Item:
    a: np.ndarray  # [A_LEN] int64
    b: np.ndarray  # [B_LEN] int64
    attr_of: np.ndarray  # [N_ENT] attribute index of each entity
    ent_counts: np.ndarray  # [N_ENT] patches per entity in B
    attr_counts: np.ndarray  # [N_ATTR] patches per attribute in B
    qtype: str
    qarg: int  # entity index for QA, else -1
    answer: int  # answer token id
    trap: bool  # attr of majority entity != majority attribute

    @property
    def question(self) -> np.ndarray:
        arg = ENT0 + self.qarg if self.qtype == "A" else ARG
        return np.array([QTOKEN[self.qtype], arg], dtype=np.int64)

    @property
    def multi_hop(self) -> bool:
        return self.qtype == "M"


def sample_legend(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random balanced entity->attribute map and its redundant patch code: one swatch token
    ``SWATCH0 + e * N_ATTR + attr_of[e]`` per entity, each repeated ``A_REPEAT`` times, shuffled."""
    attr_of = rng.permutation(np.repeat(np.arange(N_ATTR), N_ENT // N_ATTR))
    sw = SWATCH0 + np.arange(N_ENT) * N_ATTR + attr_of
    a = np.tile(sw, A_REPEAT)[rng.permutation(A_LEN)].astype(np.int64)
    return attr_of, a


def sample_image(
    rng: np.random.Generator, attr_of: np.ndarray, trap: bool | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """A region-structured label map whose majority entity and majority attribute are unique
    (by a margin of 2 patches). ``trap`` forces (True) or forbids (False) the trap case."""
    while True:
        if trap:
            b_ent = _trap_layout(rng, attr_of)
        else:
            b_ent = _region_layout(rng)
        ec = np.bincount(b_ent, minlength=N_ENT)
        ac = np.bincount(attr_of[b_ent], minlength=N_ATTR)
        se, sa = np.sort(ec), np.sort(ac)
        if se[-1] - se[-2] < 2 or sa[-1] - sa[-2] < 2:
            continue
        is_trap = bool(attr_of[int(ec.argmax())] != int(ac.argmax()))
        if trap is not None and is_trap != trap:
            continue
        return (ENT0 + b_ent).astype(np.int64), ec, ac, is_trap


def _region_layout(rng: np.random.Generator) -> np.ndarray:
    """4-8 contiguous regions of random sizes (>= MIN_REGION) and entities."""
    k = int(rng.integers(4, 9))
    m = B_LEN - k * MIN_REGION + k - 1
    cuts = np.sort(rng.choice(m, size=k - 1, replace=False))
    sizes = np.diff(np.concatenate([[-1], cuts, [m]])) - 1 + MIN_REGION
    ents = rng.integers(0, N_ENT, size=k)
    for i in range(1, k):  # adjacent regions differ
        while ents[i] == ents[i - 1]:
            ents[i] = rng.integers(0, N_ENT)
    return np.repeat(ents, sizes)


def _trap_layout(rng: np.random.Generator, attr_of: np.ndarray) -> np.ndarray:
    """Counts built so that one entity x is the largest, while the entities of another attribute
    together outweigh every attribute; laid out as shuffled runs. (``sample_image`` re-checks.)"""
    c_star = int(rng.integers(0, N_ATTR))
    mine = np.flatnonzero(attr_of == c_star)
    others = np.flatnonzero(attr_of != c_star)
    x = int(rng.choice(others))
    counts = np.zeros(N_ENT, dtype=np.int64)
    n_x = int(rng.integers(6, 11))
    counts[x] = n_x
    lo = max(MIN_REGION, (n_x + 2 + 1) // 2)
    for e in mine:
        counts[e] = int(rng.integers(lo, n_x - 1))
    rest = B_LEN - int(counts.sum())
    pool = [int(e) for e in others if e != x]
    while rest > 0:
        e = pool[int(rng.integers(0, len(pool)))]
        chunk = min(rest, int(rng.integers(MIN_REGION, 6)))
        if rest - chunk == 1:
            chunk += 1
        counts[e] += chunk
        rest -= chunk
    return _runs_layout(rng, counts)


def _runs_layout(rng: np.random.Generator, counts: np.ndarray) -> np.ndarray:
    runs = []
    for e, c in enumerate(counts):
        c = int(c)
        if c == 0:
            continue
        if c >= 2 * MIN_REGION and rng.random() < 0.5:
            s = int(rng.integers(MIN_REGION, c - MIN_REGION + 1))
            runs += [(e, s), (e, c - s)]
        else:
            runs.append((e, c))
    order = rng.permutation(len(runs))
    return np.concatenate([np.full(runs[i][1], runs[i][0]) for i in order])


def sample_item(
    rng: np.random.Generator,
    qtype: str,
    legend: tuple[np.ndarray, np.ndarray] | None = None,
) -> Item:
    attr_of, a = legend if legend is not None else sample_legend(rng)
    b, ec, ac, trap = sample_image(rng, attr_of, trap=bool(rng.integers(0, 2)))
    qarg = -1
    if qtype == "A":
        qarg = int(rng.integers(0, N_ENT))
        answer = ATTR0 + int(attr_of[qarg])
    elif qtype == "E":
        answer = ENT0 + int(ec.argmax())
    elif qtype == "M":
        answer = ATTR0 + int(ac.argmax())
    else:
        raise ValueError(qtype)
    return Item(a, b, attr_of, ec, ac, qtype, qarg, answer, trap)


def make_eval_set(seed: int, n_per_type: int, legends: int | None = None) -> list[Item]:
    """Held-out items, ``n_per_type`` of each question type. With ``legends`` set, items share
    that many distinct A's (round-robin), so a patch formed on one item can be tried on another
    with the same A (the "transfer" arm)."""
    rng = np.random.default_rng([seed, 0xB1D])
    pool = [sample_legend(rng) for _ in range(legends)] if legends else None
    items = []
    for qt in QTYPES:
        for i in range(n_per_type):
            lg = pool[i % len(pool)] if pool else None
            items.append(sample_item(rng, qt, lg))
    return items


def train_batch(
    rng: np.random.Generator, batch: int, extra_qa: int = 1, aux_binding: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training sequences ``[BOS] A B`` + the three questions (random order) and ``extra_qa``
    more ``QA`` questions, each followed by its answer.

    Returns (tokens [batch, T], answer targets [batch, T], aux targets [batch, T]); targets are
    -100 off their slots. The answer targets sit at each question's ``arg`` position. The aux
    targets (``aux_binding``) sit at B's patch positions: the attribute of that patch's entity,
    i.e. the model is asked to read each patch's meaning out of the legend while B is prefilled
    after A (deep supervision of the binding; it is a training signal only, never evaluated).
    """
    n_q = len(QTYPES) + extra_qa
    T = PREFIX_LEN + A_LEN + B_LEN + n_q * (Q_LEN + 1)
    toks = np.empty((batch, T), dtype=np.int64)
    tgt = np.full((batch, T), -100, dtype=np.int64)
    aux = np.full((batch, T), -100, dtype=np.int64)
    b0 = PREFIX_LEN + A_LEN
    for r in range(batch):
        attr_of, a = sample_legend(rng)
        b, ec, ac, _ = sample_image(rng, attr_of, trap=bool(rng.integers(0, 2)))
        seq = [BOS, *a.tolist(), *b.tolist()]
        if aux_binding:
            aux[r, b0 : b0 + B_LEN] = ATTR0 + attr_of[b - ENT0]
        for qt in [*rng.permutation(QTYPES).tolist(), *["A"] * extra_qa]:
            if qt == "A":
                e = int(rng.integers(0, N_ENT))
                q, ans = [Q_A, ENT0 + e], ATTR0 + int(attr_of[e])
            elif qt == "E":
                q, ans = [Q_E, ARG], ENT0 + int(ec.argmax())
            else:
                q, ans = [Q_M, ARG], ATTR0 + int(ac.argmax())
            seq += q
            tgt[r, len(seq) - 1] = ans  # the logits at the arg position predict the answer
            seq.append(ans)
        toks[r] = seq
    return toks, tgt, aux
