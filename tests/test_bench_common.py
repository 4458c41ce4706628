"""The shared docs writer of the benchmarks."""

from __future__ import annotations

from kvcellar.bench.common import DOCS_INTRO, rewrite_docs_section


def test_sections_are_replaced_in_place_and_new_ones_appended(tmp_path):
    docs = tmp_path / "benchmarks.md"
    rewrite_docs_section("one", "first", docs)
    rewrite_docs_section("two", "second", docs)
    rewrite_docs_section("one", "first, again", docs)
    text = docs.read_text()
    assert text.startswith(DOCS_INTRO)
    assert text.count("<!-- one:begin -->") == 1 and "first, again\n<!-- one:end -->" in text
    assert text.index("<!-- one:end -->") < text.index("<!-- two:begin -->")
    assert "second\n<!-- two:end -->" in text and "first\n" not in text
