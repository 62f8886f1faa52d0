"""docs/benchmarks.md's generated sections are what the committed records
under bench/results render to (no testbed: it reads files)."""

from __future__ import annotations

import json

from bench import docs
from bench.lib import results


def test_docs_match_the_committed_results():
    text = docs.DOCS.read_text()
    assert docs.studies_in(text), "docs/benchmarks.md has no generated section"
    assert docs.regenerate(text) == text, "run `python -m bench.docs`: the tables differ from bench/results"


def test_every_committed_record_has_a_section_and_a_renderer():
    text = docs.DOCS.read_text()
    committed = sorted(p.parent.name for p in results.RESULTS.glob("*/results.json"))
    assert committed and set(committed) <= set(docs.studies_in(text)) and set(committed) <= set(docs.RENDER)


def test_a_changed_number_is_caught(tmp_path):
    # The check must fail when a record and the docs disagree.
    for study in docs.studies_in(docs.DOCS.read_text()):
        (tmp_path / study).mkdir()
        r = results.load(study)
        r["wall_s"] += 1
        (tmp_path / study / "results.json").write_text(json.dumps(r))
    text = docs.DOCS.read_text()
    assert docs.regenerate(text, tmp_path) != text


def test_records_say_what_made_them():
    for p in results.RESULTS.glob("*/results.json"):
        r = json.loads(p.read_text())
        assert {"command", "commit", "started_utc", "machine", "load_average", "rows"} <= r.keys(), p
        assert len(r["commit"]["sha"]) == 40 and isinstance(r["commit"]["dirty"], bool), p
        assert {"cpu", "cores", "kernel"} <= r["machine"].keys(), p
        assert len(r["load_average"]["start"]) == 3 and len(r["load_average"]["end"]) == 3, p
