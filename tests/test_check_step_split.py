"""``orbitkv check step-split``: its document-agent prompts on the real model's tokenizer (records of
about 70 tokens; each split's cached head whole blocks that the whole chat starts with). The vLLM
run itself is opt-in (slow); its figures are in docs/exactness.md."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from orbitkv.models import smollm2

    try:
        return AutoTokenizer.from_pretrained(str(smollm2.smollm2_checkpoint()))
    except FileNotFoundError as exc:  # the `real` extra is not installed
        pytest.skip(str(exc))


def test_prompts_split_at_record_boundaries(tok) -> None:
    from orbitkv_lab.checks.step_split import BLOCK_SIZE, SPLITS, prompt_ids, prompts

    cases = prompts(6)
    assert len({content for content, _ in cases}) == 6
    for content, records in cases:
        assert len(records) == 4
        assert all(55 <= len(tok(r, add_special_tokens=False)["input_ids"]) <= 85 for r in records)
        ids, cuts = prompt_ids(tok, content, records, BLOCK_SIZE)
        assert set(cuts) == set(SPLITS)
        assert BLOCK_SIZE <= cuts["after_first_record"] < cuts["after_records"] < len(ids) - 8
        assert cuts["all_but_last_token"] == len(ids) - 1 and len(ids) % BLOCK_SIZE == 1
        assert cuts["after_first_record"] % BLOCK_SIZE == 0 == cuts["after_records"] % BLOCK_SIZE
        # The head ends within the records it names: the first record's is in the first record.
        head = tok.decode(ids[: cuts["after_first_record"]])
        assert records[0][:20] in head and records[1][:20] not in head
        assert records[3][:20] in tok.decode(ids[: cuts["after_records"]])


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_alone_run_reports_every_split(tmp_path) -> None:
    import json

    from orbitkv_lab.checks.step_split import SPLITS, main

    out = tmp_path / "split.json"
    assert main(["--prompts", "2", "--max-tokens", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == set(SPLITS)
    for row in report["rows"]:
        assert [row["splits"][s]["cached"] for s in SPLITS] == sorted(row["splits"][s]["cached"] for s in SPLITS)
        assert row["full"]["text"]
