"""The shared docs writer of the benchmarks."""

from __future__ import annotations

import attrs

from kvcellar.bench.common import DOCS_INTRO, Figures, docs_section, machine_sentence, rewrite_docs_section


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


def test_a_docs_section_aligns_text_columns_left_and_lists_the_summary():
    figures = Figures(
        title="terminal title",
        columns=("measurement", "median", "note"),
        rows=[("restore", "1.5 ms", "cold")],
        summary=["all targets met"],
    )
    machine = {"cpus": "2", "cpu_model": "cpu", "memory_total": "1 GiB", "platform": "linux", "python": "3", "mlx": "0"}
    section = docs_section(
        "A benchmark", ["Run today.", machine_sentence(machine, " (CPU).")], figures, ["What it means."]
    )
    assert section.splitlines() == [
        "## A benchmark",
        "",
        "Run today.",
        "",
        "Machine: 2 CPUs (cpu), 1 GiB RAM, linux, Python 3, MLX 0 (CPU).",
        "",
        "| measurement | median | note |",
        "|---|---:|---|",
        "| restore | 1.5 ms | cold |",
        "",
        "- all targets met",
        "",
        "What it means.",
    ]
    assert "- " not in "\n".join(attrs.evolve(figures, summary=()).markdown())
