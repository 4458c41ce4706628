"""The SSD tier's prefix index against a brute-force reference built on
`usable_prefix_length`, plus the cases the store relies on."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from kvcellar.store.prefix_index import IndexMatch, PrefixIndex
from kvcellar.store.signature import usable_prefix_length

# A tiny alphabet and short lists make prefixes collide, branch and nest often.
token_lists = st.lists(st.integers(min_value=0, max_value=3), max_size=8)
entry_ids = st.sampled_from([f"e{number}" for number in range(8)])


def _common_prefix_length(left: list[int], right: list[int]) -> int:
    length = 0
    for left_token, right_token in zip(left, right, strict=False):
        if left_token != right_token:
            break
        length += 1
    return length


def _reference_usable(entry: tuple[list[int], bool, int], query: list[int]) -> int:
    tokens, trimmable, minimum_reusable = entry
    return usable_prefix_length(
        _common_prefix_length(tokens, query), len(tokens), len(query), trimmable, minimum_reusable
    )


def _reference_best(entries: dict[str, tuple[list[int], bool, int]], query: list[int]) -> IndexMatch | None:
    keys = []
    for entry_id, entry in entries.items():
        usable = _reference_usable(entry, query)
        if usable > 0:
            length = len(entry[0])
            keys.append((-usable, usable != length, length, entry_id))
    if not keys:
        return None
    usable_negated, _, length, entry_id = min(keys)
    return IndexMatch(entry_id=entry_id, usable_tokens=-usable_negated, entry_tokens=length)


class PrefixIndexAgainstReference(RuleBasedStateMachine):
    stored_ids = Bundle("stored_ids")

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.reference: dict[str, tuple[list[int], bool, int]] = {}

    @rule(
        target=stored_ids,
        entry_id=entry_ids,
        tokens=token_lists,
        trimmable=st.booleans(),
        extra_offset=st.integers(min_value=0, max_value=3),
        untrimmable_style=st.booleans(),
    )
    def add(self, entry_id, tokens, trimmable, extra_offset, untrimmable_style):
        # Mostly the offsets real caches declare (0 trimmable, full length untrimmable),
        # sometimes an arbitrary bound, possibly past the entry's end.
        natural = 0 if trimmable else len(tokens)
        offset = natural if untrimmable_style else natural + extra_offset
        self.index.add(entry_id, tokens, trimmable=trimmable, minimum_reusable_offset=offset)
        self.reference[entry_id] = (tokens, trimmable, offset)
        return entry_id

    @rule(entry_id=consumes(stored_ids))
    def remove(self, entry_id):
        if entry_id in self.reference:
            self.index.remove(entry_id)
            del self.reference[entry_id]
        else:
            with pytest.raises(KeyError):
                self.index.remove(entry_id)

    @rule(query=token_lists)
    def best_matches_reference(self, query):
        found = self.index.best(query)
        assert found == _reference_best(self.reference, query)
        if found is not None:
            chosen = self.reference[found.entry_id]
            assert _reference_usable(chosen, query) == found.usable_tokens
            assert len(chosen[0]) == found.entry_tokens

    @rule(stored=stored_ids, extension=token_lists, cut=st.integers(min_value=0, max_value=8))
    def best_for_a_query_near_a_stored_entry(self, stored, extension, cut):
        if stored in self.reference:
            query = self.reference[stored][0][:cut] + extension
            assert self.index.best(query) == _reference_best(self.reference, query)

    @rule(tokens=token_lists)
    def ancestors_and_exact_match_reference(self, tokens):
        ancestors = sorted(
            entry_id
            for entry_id, (stored, _, _) in self.reference.items()
            if len(stored) < len(tokens) and tokens[: len(stored)] == stored
        )
        exact = sorted(entry_id for entry_id, (stored, _, _) in self.reference.items() if stored == tokens)
        assert self.index.strict_prefix_ancestors(tokens) == ancestors
        assert self.index.exact(tokens) == exact

    @rule(tokens=token_lists)
    def divergence_matches_reference(self, tokens):
        """The longest prefix any entry shares with the query, and an entry's tokens after it."""
        matched, following = self.index.divergence(tokens, 4)
        commons = {entry_id: _common(stored, tokens) for entry_id, (stored, _, _) in self.reference.items()}
        assert matched == max(commons.values(), default=0)
        sharing = [stored for entry_id, (stored, _, _) in self.reference.items() if commons[entry_id] == matched]
        if following.size:
            assert any(stored[matched : matched + 4] == following.tolist() for stored in sharing)
        else:
            assert all(len(stored) == matched for stored in sharing)

    @rule(stored=stored_ids)
    def by_id_lists_equal_the_walks(self, stored):
        if stored in self.reference:
            tokens = self.reference[stored][0]
            assert self.index.same_tokens(stored) == self.index.exact(tokens)
            assert self.index.strict_prefix_ancestors_of(stored) == self.index.strict_prefix_ancestors(tokens)

    @invariant()
    def membership_and_size_follow_reference(self):
        assert len(self.index) == len(self.reference)
        for entry_id, (tokens, _, _) in self.reference.items():
            assert entry_id in self.index
            assert self.index.tokens_of(entry_id).tolist() == tokens
        assert self.index.node_count() <= 2 * len(self.reference) + 1


PrefixIndexAgainstReference.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_index_agrees_with_brute_force_reference = PrefixIndexAgainstReference.TestCase


def _common(left: list[int], right: list[int]) -> int:
    shared = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _index(*entries: tuple[str, list[int], bool, int]) -> PrefixIndex:
    index = PrefixIndex()
    for entry_id, tokens, trimmable, offset in entries:
        index.add(entry_id, tokens, trimmable=trimmable, minimum_reusable_offset=offset)
    return index


def test_untrimmable_longer_entry_is_skipped_on_a_partial_match():
    index = _index(("ssm", [1, 2, 3, 4], False, 4))
    assert index.best([1, 2, 9, 9]) is None
    assert index.best([1, 2, 3]) is None


def test_untrimmable_entry_is_served_when_it_is_a_strict_prefix_of_the_query():
    index = _index(("ssm", [1, 2, 3, 4], False, 4))
    assert index.best([1, 2, 3, 4, 5]) == IndexMatch(entry_id="ssm", usable_tokens=4, entry_tokens=4)


def test_entry_equal_to_the_query_needs_a_trim_of_one_token():
    untrimmable = _index(("ssm", [1, 2, 3], False, 3))
    trimmable = _index(("kv", [1, 2, 3], True, 0))
    assert untrimmable.best([1, 2, 3]) is None
    assert trimmable.best([1, 2, 3]) == IndexMatch(entry_id="kv", usable_tokens=2, entry_tokens=3)


def test_minimum_reusable_offset_bounds_how_short_a_trim_may_go():
    index = _index(("kv", [1, 2, 3, 4, 5, 6], True, 3))
    assert index.best([1, 2, 7]) is None
    assert index.best([1, 2, 3, 7]).usable_tokens == 3


def test_longest_usable_prefix_wins_over_a_shorter_exact_prefix():
    index = _index(("system", [1, 2], False, 2), ("turn", [1, 2, 3, 4, 5], True, 0))
    assert index.best([1, 2, 3, 4, 9]).entry_id == "turn"
    assert index.best([1, 2, 8]).entry_id == "system"


def test_ties_prefer_no_trim_then_the_shorter_entry_then_the_smaller_id():
    no_trim = _index(("long", [1, 2, 3, 9, 9], True, 0), ("exact", [1, 2, 3], True, 0))
    assert no_trim.best([1, 2, 3, 4]).entry_id == "exact"
    shorter = _index(("b-long", [1, 2, 3, 9, 9, 9], True, 0), ("c-short", [1, 2, 3, 8], True, 0))
    assert shorter.best([1, 2, 3, 4]).entry_id == "c-short"
    same = _index(("b", [1, 2, 5], True, 0), ("a", [1, 2, 6], True, 0))
    assert same.best([1, 2, 7]).entry_id == "a"


def test_tie_break_by_id_holds_among_trimmable_entries_with_different_offsets():
    index = _index(("a", [1, 2, 3, 4], True, 2), ("b", [1, 2, 3, 5], True, 0))
    assert index.best([1, 2, 3, 9]).entry_id == "a"
    assert index.best([1, 9]).entry_id == "b"
    # A shorter entry that outranks both, once gone, must leave both answers as they were.
    index.add("c", [1, 2, 3], trimmable=True, minimum_reusable_offset=0)
    index.remove("c")
    assert index.best([1, 2, 3, 9]).entry_id == "a"
    assert index.best([1, 9]).entry_id == "b"


def test_removal_restores_the_previous_answer_and_prunes_the_trie():
    index = _index(("base", [1, 2, 3], True, 0))
    before = index.best([1, 2, 3, 4, 5, 6])
    nodes_before = index.node_count()
    index.add("branch", [1, 2, 3, 4, 5, 7, 7], trimmable=True, minimum_reusable_offset=0)
    assert index.best([1, 2, 3, 4, 5, 6]).entry_id == "branch"
    index.remove("branch")
    assert index.best([1, 2, 3, 4, 5, 6]) == before
    assert index.node_count() == nodes_before


def test_replacing_an_id_forgets_its_old_tokens():
    index = _index(("entry", [1, 2, 3, 4], True, 0))
    index.add("entry", [5, 6, 7], trimmable=True, minimum_reusable_offset=0)
    assert index.best([1, 2, 3, 4, 5]) is None
    assert index.best([5, 6, 7, 8]).usable_tokens == 3
    assert len(index) == 1


def test_identical_tokens_under_two_ids_coexist_and_leave_independently():
    index = _index(("a", [1, 2, 3], True, 0), ("b", [1, 2, 3], True, 0))
    assert index.exact([1, 2, 3]) == ["a", "b"]
    index.remove("a")
    assert index.best([1, 2, 3, 4]).entry_id == "b"
    assert index.exact([1, 2, 3]) == ["b"]


@pytest.mark.parametrize("query", [[], [1]])
def test_empty_and_single_token_queries_reuse_nothing(query):
    index = _index(("kv", [1, 2, 3], True, 0), ("short", [1], False, 1))
    assert index.best(query) is None


def test_unknown_id_raises_key_error():
    index = PrefixIndex()
    with pytest.raises(KeyError):
        index.remove("missing")
    with pytest.raises(KeyError):
        index.tokens_of("missing")


def test_tokens_are_stored_as_read_only_uint32_copies():
    source = np.array([1, 2, 3], dtype=np.uint32)
    index = _index(("kv", source, True, 0))
    source[0] = 9
    stored = index.tokens_of("kv")
    assert stored.dtype == np.uint32 and stored.tolist() == [1, 2, 3]
    assert not stored.flags.writeable


def test_token_ids_outside_uint32_are_refused_rather_than_wrapped():
    index = PrefixIndex()
    with pytest.raises(ValueError):
        index.add("kv", [1, -1], trimmable=True, minimum_reusable_offset=0)
    with pytest.raises(ValueError):
        index.best(np.array([1, 2**32], dtype=np.int64))


def test_churn_leaves_no_nodes_behind():
    rng = np.random.default_rng(0)
    index = PrefixIndex()
    for round_number in range(200):
        tokens = rng.integers(0, 4, size=rng.integers(1, 12)).tolist()
        index.add(f"e{round_number % 17}", tokens, trimmable=True, minimum_reusable_offset=0)
    for entry_id in [f"e{number}" for number in range(17)]:
        index.remove(entry_id)
    assert len(index) == 0
    assert index.node_count() == 1


def test_tokens_viewing_immutable_bytes_are_kept_without_a_copy():
    packed = np.array([4, 5, 6], dtype="<u4").tobytes()
    view = np.frombuffer(packed, dtype=np.uint32)
    index = _index(("kv", view, True, 0))
    assert index.tokens_of("kv") is view and not view.flags.writeable


@attrs.frozen(kw_only=True)
class _BulkEntry:
    entry_id: str
    tokens: Any
    trimmable: bool
    minimum_reusable_offset: int


def _trie_shape(index: PrefixIndex) -> tuple[Any, ...]:
    """The trie as plain data (each node's path, entries, frontier and
    children), asserting the module's invariants on the way down."""

    def shape(node: Any, path: list[int]) -> tuple[Any, ...]:
        if node.parent is not None:
            assert node.entries or len(node.children) >= 2, "a node with no entry and one child"
        live_arrays = [entry.tokens for entry in node.entries.values()]
        assert node.source[: node.depth].tolist() == path
        assert all(array[: node.depth].tolist() == path for array in live_arrays)
        children = []
        for first, child in sorted(node.children.items()):
            assert child.parent is node and int(child.source[node.depth]) == first
            children.append(shape(child, child.source[: child.depth].tolist()))
        return (tuple(path), tuple(sorted(node.entries)), node.frontier, tuple(children))

    return shape(index._root, [])


bulk_entry_lists = st.lists(
    st.tuples(
        entry_ids, token_lists, st.booleans(), st.integers(min_value=0, max_value=3), st.booleans(), st.booleans()
    ),
    max_size=14,
)


def _bytes_view(tokens: list[int]) -> np.ndarray:
    """Tokens as a read-only view of `bytes`, as a header or a journal row gives them."""
    return np.frombuffer(np.array(tokens, dtype="<u4").tobytes(), dtype=np.uint32)


@settings(max_examples=400, deadline=None)
@given(entries=bulk_entry_lists, queries=st.lists(token_lists, min_size=1, max_size=8), removals=st.sets(entry_ids))
def test_bulk_build_equals_repeated_add(entries, queries, removals):
    """`from_entries` builds the very trie repeated `add` builds (last of an
    id wins), answers every query as the brute-force reference does, and
    stays a valid index under later removals and adds."""
    bulk_input, added, reference = [], PrefixIndex(), {}
    for entry_id, tokens, trimmable, extra_offset, natural_style, as_view in entries:
        natural = 0 if trimmable else len(tokens)
        offset = natural if natural_style else natural + extra_offset
        # Views of bytes and lists sort on keys made two ways: a mix must sort as one.
        given_tokens = _bytes_view(tokens) if as_view else tokens
        bulk_input.append(
            _BulkEntry(entry_id=entry_id, tokens=given_tokens, trimmable=trimmable, minimum_reusable_offset=offset)
        )
        added.add(entry_id, tokens, trimmable=trimmable, minimum_reusable_offset=offset)
        reference[entry_id] = (tokens, trimmable, offset)
    built = PrefixIndex.from_entries(bulk_input)
    for step in range(2):
        assert _trie_shape(built) == _trie_shape(added)
        assert len(built) == len(added) == len(reference)
        for query in queries + [tokens for tokens, _, _ in reference.values()]:
            assert built.best(query) == added.best(query) == _reference_best(reference, query)
            assert built.exact(query) == added.exact(query)
            assert built.strict_prefix_ancestors(query) == added.strict_prefix_ancestors(query)
        for entry_id in reference:
            assert built.same_tokens(entry_id) == added.same_tokens(entry_id)
            assert built.strict_prefix_ancestors_of(entry_id) == added.strict_prefix_ancestors_of(entry_id)
            assert built.tokens_of(entry_id).tolist() == reference[entry_id][0]
        sharing = {
            entry_id
            for entry_id, (tokens, _, _) in reference.items()
            if any(
                other_id != entry_id and len(other) <= len(tokens) and tokens[: len(other)] == other
                for other_id, (other, _, _) in reference.items()
            )
        }
        assert built.entries_on_shared_paths() == added.entries_on_shared_paths() == sharing
        if step == 0:
            for entry_id in sorted(removals & set(reference)):
                built.remove(entry_id)
                added.remove(entry_id)
                del reference[entry_id]
            for query in queries[:2]:
                built.add("late", query, trimmable=True, minimum_reusable_offset=0)
                added.add("late", query, trimmable=True, minimum_reusable_offset=0)
                reference["late"] = (query, True, 0)


def test_bulk_build_refuses_what_add_refuses():
    with pytest.raises(ValueError):
        PrefixIndex.from_entries([_BulkEntry(entry_id="a", tokens=[1], trimmable=True, minimum_reusable_offset=-1)])
    with pytest.raises(ValueError):
        PrefixIndex.from_entries([_BulkEntry(entry_id="a", tokens=[1, -1], trimmable=True, minimum_reusable_offset=0)])
    assert len(PrefixIndex.from_entries([])) == 0 and PrefixIndex.from_entries([]).node_count() == 1


def test_bulk_build_keeps_token_arrays_viewing_immutable_bytes():
    view = _bytes_view([4, 5, 6])
    built = PrefixIndex.from_entries(
        [_BulkEntry(entry_id="kv", tokens=view, trimmable=True, minimum_reusable_offset=0)]
    )
    assert built.tokens_of("kv") is view
