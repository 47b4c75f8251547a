"""A tiny trained model where cross-chunk binding matters (fidelity lab ``--arch binding``).

* ``orbitkv_lab.binding.task``  -- the synthetic legend(A) + image(B) task, deterministic from a seed.
* ``orbitkv_lab.binding.train`` -- ``python -m orbitkv_lab.binding.train --out DIR --seed 0`` (CPU).
* ``orbitkv_lab.binding.eval``  -- ceiling / blind / patch@m / transfer / baseline accuracy.

The shipped weights live in ``lab/orbitkv_lab/assets/binding`` (``load_model()``).
"""

from __future__ import annotations


def load_model(path: str | None = None):
    """The shipped ``LlamaForCausalLM`` (fp32, eval mode)."""
    from .eval import ASSET_DIR
    from .eval import load_model as _load

    return _load(path or ASSET_DIR)
