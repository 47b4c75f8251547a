"""Per-request options: parsed leniently, since a client's typo must never stop the engine."""

from __future__ import annotations

from orbitkv.connector.options import RequestOptions, parse_options
from orbitkv.connector.planner import BLIND, EXACT, SURVIVOR

DEFAULT = frozenset({EXACT, SURVIVOR})


def _parse(raw):
    return parse_options(raw, default_modes=DEFAULT, default_tenant="t0")


def test_defaults_without_options():
    assert _parse(None) == RequestOptions(modes=DEFAULT, tenant="t0")
    assert _parse({"other_connector": 1}) == RequestOptions(modes=DEFAULT, tenant="t0")


def test_values_are_read():
    opts = _parse(
        {
            "orbitkv": {
                "load": False,
                "save": False,
                "modes": {"blind": True, "survivor": False},
                "tenant": "acme",
                "chunk_boundaries": [9, 3, 3],
                "role": "canonicalize",
            }
        }
    )
    assert not opts.is_load_enabled and not opts.is_save_enabled
    assert opts.modes == {EXACT, BLIND}
    assert (opts.tenant, opts.chunk_boundaries, opts.role) == ("acme", (3, 9), "canonicalize")
    assert _parse({"orbitkv": {"modes": ["exact"]}}).modes == {EXACT}


def test_bad_values_keep_defaults():
    opts = _parse(
        {
            "orbitkv": {
                "load": "no",
                "modes": ["warp"],
                "tenant": 5,
                "chunk_boundaries": "x",
                "role": "admin",
                "typo": 1,
            }
        }
    )
    assert opts == RequestOptions(modes=DEFAULT, tenant="t0")
    assert _parse({"orbitkv": "yes"}) == RequestOptions(modes=DEFAULT, tenant="t0")
