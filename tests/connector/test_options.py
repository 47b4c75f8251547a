"""Per-request options: parsed leniently, since a client's typo must never stop the engine."""

from __future__ import annotations

from orbitkv.connector.scheduler.options import RequestOptions, parse_options
from orbitkv.connector.scheduler.planner import BLIND, EXACT, SURVIVOR

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


def _rules(**config):
    from orbitkv.connector.scheduler.options import RequestRules

    from orbitkv.config import OrbitKVConfig

    cfg = OrbitKVConfig.from_kv_connector_extra_config(
        {"orbitkv": {"approximate_reuse": "all", "require_calibration": False, **config}}
    )
    return cfg, RequestRules(cfg)


def test_transfer_is_narrowed_to_its_modalities_and_named_in_the_policy():
    from types import SimpleNamespace

    from orbitkv.connector.scheduler.planner import TRANSFER, TRANSFER_ATTACHED

    cfg, rules = _rules()
    plain = rules.options(None, None)
    assert TRANSFER not in plain.modes and plain.policy.mode_filter() is None
    cfg, rules = _rules(transfer_modalities=["image"])
    opts = rules.options(None, None)
    assert TRANSFER in opts.modes and TRANSFER in opts.policy.modes
    modes_for = opts.policy.mode_filter()
    image = SimpleNamespace(is_mm=True, modality="image")
    text = SimpleNamespace(is_mm=False, modality="text")
    assert TRANSFER in modes_for(image) and TRANSFER not in modes_for(text)
    assert SURVIVOR in modes_for(text)  # the other modes are not narrowed
    # Another scope is another policy: its entries and blocks are not this one's.
    _, wider = _rules(transfer_modalities=["image", "text"])
    assert wider.options(None, None).policy.tag != opts.policy.tag
    # Text attached to the chunk before it: transfer with the attached-only allowance.
    cfg_attached, attached = _rules(transfer_modalities=["image"], transfer_attached_modalities=["text"])
    attached_filter = attached.options(None, None).policy.mode_filter()
    text_modes = attached_filter(text)
    assert TRANSFER not in text_modes and TRANSFER_ATTACHED in text_modes
    assert TRANSFER_ATTACHED not in attached_filter(image)
    tags = {opts.policy.tag, wider.options(None, None).policy.tag, attached.options(None, None).policy.tag}
    assert len(tags) == 3
    # A request that leaves transfer out keeps the tag of a deployment without it.
    without = rules.options({"orbitkv": {"modes": {"transfer": False}}}, None)
    assert without.policy.tag == plain.policy.tag
    # An exact request has no policy whatever the scope.
    assert rules.options({"orbitkv": {"modes": ["exact"]}}, None).policy.is_exact


def test_a_request_naming_no_option_gets_the_deployments_exact_options_and_one_naming_some_its_own():
    """The options of a request naming none are resolved once (``RequestRules._plain``); a
    request naming options, another tenant or approximate KV is still read on its own."""
    from orbitkv.connector.scheduler.options import RequestRules

    from orbitkv.config import OrbitKVConfig

    cfg = OrbitKVConfig.from_kv_connector_extra_config(
        {"orbitkv": {"approximate_reuse": "request", "require_calibration": False,
                     "enable_survivor": True, "request_tenants": ["acme"]}}
    )
    rules = RequestRules(cfg)
    plain = rules.options(None, None)
    assert plain.policy.is_exact and plain.modes == {EXACT} and plain.tenant == cfg.tenant
    assert rules.options({"other_connector": 1}, "salt") == plain
    named = rules.options({"orbitkv": {"save": False, "tenant": "acme"}}, None)
    assert not named.is_save_enabled and named.tenant == "acme"
    opted = rules.options({"orbitkv": {"approximate": True}}, None)
    assert SURVIVOR in opted.modes and not opted.policy.is_exact
    assert rules.options(None, None) == plain and plain.is_save_enabled
    # Every request may receive approximate KV: nothing is resolved ahead of the request.
    _, every = _rules(enable_survivor=True)
    assert SURVIVOR in every.options(None, None).modes


def test_the_same_exact_options_are_resolved_once_and_approximate_ones_every_time(monkeypatch):
    """An agent sends the same options with every request: exact ones are resolved once; those
    the mode gate narrows (its verdicts change while serving) are resolved per request."""
    from orbitkv.connector.scheduler import options

    from orbitkv.config import OrbitKVConfig

    calls = []
    real = options.parse_options
    monkeypatch.setattr(options, "parse_options", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = OrbitKVConfig.from_kv_connector_extra_config(
        {"orbitkv": {"approximate_reuse": "request", "require_calibration": False,
                     "enable_survivor": True, "request_tenants": ["acme"]}}
    )
    rules = options.RequestRules(cfg)
    first = rules.options({"orbitkv": {"tenant": "acme", "save": False}}, None)
    again = rules.options({"orbitkv": {"tenant": "acme", "save": False}}, "another salt")
    assert again is first and len(calls) == 1 and first.tenant == "acme"
    other = rules.options({"orbitkv": {"tenant": "acme"}}, None)  # other options: their own
    assert other.is_save_enabled and len(calls) == 2
    for _ in range(2):
        assert SURVIVOR in rules.options({"orbitkv": {"approximate": True}}, None).modes
    assert len(calls) == 4
