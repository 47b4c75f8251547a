"""A tiny trained model where cross-chunk binding matters (fidelity lab ``--arch binding``).

* ``orbitkv.binding.task``  -- the synthetic legend(A) + image(B) task, deterministic from a seed.
* ``orbitkv.binding.train`` -- ``python -m orbitkv.binding.train --out DIR --seed 0`` (CPU).
* ``orbitkv.binding.eval``  -- ceiling / blind / patch@m / transfer / baseline accuracy.

The shipped weights live in ``orbitkv/assets/binding`` (``load_model()``).
"""

from __future__ import annotations


def load_model(path: str | None = None):
    """The shipped ``LlamaForCausalLM`` (fp32, eval mode)."""
    from .eval import ASSET_DIR
    from .eval import load_model as _load

    return _load(path or ASSET_DIR)
