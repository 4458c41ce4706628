"""In-memory prefix index over stored entries: the SSD tier's `find()`.

`PrefixIndex.best(query)` returns the entry that lets the query reuse the most
tokens under `kvcellar.store.signature.usable_prefix_length` (the one rule),
without scanning every entry's tokens.

Structure: a radix trie over token ids. A node exists only at the root, at a
branch point, or where an entry ends. A node stores no label of its own: its
edge label is `source[parent.depth:depth]`, a slice of the token array of some
live entry in its subtree, so the trie holds no tokens beyond the one uint32
array kept per entry. Query slices are compared with edge labels by numpy.

Invariants (kept by `add` and `remove`, and established by `from_entries`):

- every non-root node has an entry ending at it or at least two children, so
  churn cannot leak nodes;
- `node.source` is the token array of a live entry in the node's subtree;
- `node.frontier` is the Pareto frontier of the trimmable entries in the
  subtree as `(minimum_reusable_offset, length, entry_id)` points: sorted by
  offset ascending with `(length, entry_id)` strictly descending, so "the
  shortest trimmable entry below that can serve `u` tokens" is the last point
  whose offset is `<= u`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import attrs
import numpy as np

TOKEN_DTYPE = np.uint32
_TOKEN_ID_LIMIT = int(np.iinfo(TOKEN_DTYPE).max)

# (minimum_reusable_offset, entry length in tokens, entry id)
FrontierPoint = tuple[int, int, str]
Tokens = Sequence[int] | np.ndarray


class IndexableEntry(Protocol):
    """What `PrefixIndex.from_entries` reads of each entry (the store's
    `IndexedEntry` is one)."""

    @property
    def entry_id(self) -> str: ...
    @property
    def tokens(self) -> np.ndarray: ...
    @property
    def trimmable(self) -> bool: ...
    @property
    def minimum_reusable_offset(self) -> int: ...


@attrs.frozen(kw_only=True)
class IndexMatch:
    """The entry chosen for a query and how many of its tokens it serves."""

    entry_id: str
    usable_tokens: int
    entry_tokens: int

    @property
    def needs_trim(self) -> bool:
        return self.usable_tokens < self.entry_tokens


@attrs.define(eq=False)
class _Node:
    parent: _Node | None
    depth: int
    source: np.ndarray
    children: dict[int, _Node] = attrs.field(factory=dict)
    entries: dict[str, _Entry] = attrs.field(factory=dict)
    frontier: tuple[FrontierPoint, ...] = ()


@attrs.define(eq=False)
class _Entry:
    entry_id: str
    tokens: np.ndarray
    trimmable: bool
    minimum_reusable_offset: int
    node: _Node

    @property
    def frontier_point(self) -> FrontierPoint:
        return (self.minimum_reusable_offset, len(self.tokens), self.entry_id)


def as_token_array(tokens: Tokens) -> np.ndarray:
    """`tokens` as a 1-D uint32 array, without copying when it already is one.

    Raises `ValueError` for ids outside uint32 (a silent wrap could match a
    different token) and `TypeError` for non-integer input.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == TOKEN_DTYPE:
        array = tokens
    else:
        array = np.asarray(tokens)
        if array.size == 0:
            return np.empty(0, dtype=TOKEN_DTYPE)
        if array.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
        if int(array.min()) < 0 or int(array.max()) > _TOKEN_ID_LIMIT:
            raise ValueError("token ids must lie in 0..2**32-1")
        array = array.astype(TOKEN_DTYPE)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    return array


def _matching_length(left: np.ndarray, right: np.ndarray) -> int:
    """Length of the common prefix of two equally long arrays (`argmax` finds
    the first mismatch without building the index list `flatnonzero` does)."""
    differs = left != right
    first = int(differs.argmax())
    return first if differs[first] else len(left)


def _owned_read_only(array: np.ndarray) -> np.ndarray:
    """`array` as a read-only array nobody can change under the index: a
    read-only view of an immutable `bytes` (a header's or a journal row's
    token ids) is kept as it is; anything else is copied."""
    if not array.flags.writeable and isinstance(array.base, bytes) and array.flags.c_contiguous:
        return array
    owned = np.array(array, dtype=TOKEN_DTYPE, copy=True)
    owned.setflags(write=False)
    return owned


def _common_prefix_length(left: np.ndarray, right: np.ndarray) -> int:
    shorter = min(len(left), len(right))
    return _matching_length(left[:shorter], right[:shorter]) if shorter else 0


_LITTLE_ENDIAN_TOKEN = np.dtype("<u4")


def _sort_key(array: np.ndarray) -> bytes:
    """The array's tokens as little-endian bytes: the `bytes` it views
    whole when it does (no copy), else a copy."""
    base = array.base
    if isinstance(base, bytes) and array.dtype == _LITTLE_ENDIAN_TOKEN and len(base) == array.nbytes:
        return base
    return array.astype(_LITTLE_ENDIAN_TOKEN).tobytes()


def _finish_frontier(node: _Node) -> None:
    """Set `node.frontier` from its own entries and its children's (already
    final) frontiers: the bottom-up step of `PrefixIndex.from_entries`. The
    common shapes (a leaf, or one child's points passed up unchanged) skip
    the general merge, which gives the same tuple."""
    own = [entry.frontier_point for entry in node.entries.values() if entry.trimmable]
    below = [child.frontier for child in node.children.values() if child.frontier]
    if not below and len(own) <= 1:
        node.frontier = tuple(own)
    elif not own and len(below) == 1:
        node.frontier = below[0]
    else:
        node.frontier = _pareto_frontier(itertools.chain(own, *below))


def _dominates(point: FrontierPoint, other: FrontierPoint) -> bool:
    return point[0] <= other[0] and point[1:] < other[1:]


def _pareto_frontier(points: Iterable[FrontierPoint]) -> tuple[FrontierPoint, ...]:
    """Points not dominated by another (serves no fewer offsets, is shorter)."""
    kept: list[FrontierPoint] = []
    for point in sorted(points):
        if not kept or point[1:] < kept[-1][1:]:
            kept.append(point)
    return tuple(kept)


def _frontier_with(frontier: tuple[FrontierPoint, ...], point: FrontierPoint) -> tuple[FrontierPoint, ...] | None:
    """`frontier` after adding `point`, or None when `point` is dominated."""
    if any(_dominates(kept, point) for kept in frontier):
        return None
    survivors = [kept for kept in frontier if not _dominates(point, kept)]
    survivors.append(point)
    survivors.sort()
    return tuple(survivors)


def _shortest_serving(frontier: tuple[FrontierPoint, ...], usable_tokens: int) -> FrontierPoint | None:
    """The shortest (then smallest-id) trimmable entry whose minimum reusable
    offset allows serving `usable_tokens`."""
    chosen = None
    for point in frontier:
        if point[0] > usable_tokens:
            break
        chosen = point
    return chosen


class PrefixIndex:
    """Entries by id and a radix trie over their tokens; see the module docstring."""

    def __init__(self) -> None:
        self._root = _Node(parent=None, depth=0, source=np.empty(0, dtype=TOKEN_DTYPE))
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def from_entries(cls, entries: Iterable[IndexableEntry]) -> PrefixIndex:
        """The index `add` would build from `entries` in turn (of an id given
        twice, the last wins), built in one pass instead: the token arrays
        sorted (by their little-endian bytes, below: a prefix before its
        extensions, each subtree contiguous), each one's common prefix with its
        predecessor, then one stack walk down the rightmost path that creates
        nodes only at branch points and entry ends. A node's frontier is
        computed once, when the walk leaves its subtree for good.

        The sort needs an order in which every prefix comes before its
        extensions and every subtree's entries are contiguous: any
        lexicographic order over token sequences gives both, whatever order
        it puts single tokens in. Comparing the little-endian bytes of the
        arrays is one such order (each token is exactly four bytes), and a
        header's or a journal row's token array already views such bytes, so
        the keys cost no copy (a big-endian copy of every array measured
        14 us per 4,000-token entry, mostly page faults on fresh memory)."""
        latest: dict[str, IndexableEntry] = {}
        for entry in entries:
            if entry.minimum_reusable_offset < 0:
                raise ValueError(f"minimum_reusable_offset must be >= 0, got {entry.minimum_reusable_offset}")
            latest[entry.entry_id] = entry
        keyed = []
        for entry_id in sorted(latest):
            entry = latest[entry_id]
            array = _owned_read_only(as_token_array(entry.tokens))
            keyed.append((_sort_key(array), entry_id, array, entry))
        # A stable sort on the key alone: ties keep the ids' order, and each
        # comparison is one memcmp (a `(key, id)` tuple key made two, an
        # equality test then an order test: 47 ms against 33 ms at 10,000
        # entries of 4,000 tokens, bound by the memory the compares read).
        keyed.sort(key=operator.itemgetter(0))
        index = cls()
        stack = [index._root]
        previous: np.ndarray | None = None
        for _, entry_id, array, source in keyed:
            common = 0 if previous is None else _common_prefix_length(previous, array)
            node = index._bulk_node_ending_at(stack, array, common)
            entry = _Entry(
                entry_id=entry_id,
                tokens=array,
                trimmable=bool(source.trimmable),
                minimum_reusable_offset=int(source.minimum_reusable_offset),
                node=node,
            )
            node.entries[entry_id] = entry
            index._entries[entry_id] = entry
            previous = array
        while stack:
            _finish_frontier(stack.pop())
        return index

    @staticmethod
    def _bulk_node_ending_at(stack: list[_Node], tokens: np.ndarray, common: int) -> _Node:
        """`from_entries`' step: `stack` is the path to the previous entry's
        node, `common` that entry's common prefix with `tokens` (which sort
        after it). Leaves the path to `tokens`' node on the stack; returns it."""
        left: _Node | None = None
        while stack[-1].depth > common:
            # Later entries sort after `tokens`, so none enters this subtree again.
            left = stack.pop()
            _finish_frontier(left)
        top = stack[-1]
        if top.depth < common:
            # The previous entry ran deeper than `common`, so `left` is the node
            # just left; the branch point goes on its edge.
            assert left is not None
            branch = _Node(parent=top, depth=common, source=left.source)
            top.children[int(left.source[top.depth])] = branch
            branch.children[int(left.source[common])] = left
            left.parent = branch
            stack.append(branch)
            top = branch
        if len(tokens) == common:
            # Sorted order puts a prefix before its extensions, so an entry
            # ending at `common` holds exactly the previous entry's tokens.
            return top
        leaf = _Node(parent=top, depth=len(tokens), source=tokens)
        top.children[int(tokens[common])] = leaf
        stack.append(leaf)
        return leaf

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def node_count(self) -> int:
        """Trie nodes including the root: at most `2 * len(self) + 1` (invariant)."""
        pending, count = [self._root], 0
        while pending:
            node = pending.pop()
            count += 1
            pending.extend(node.children.values())
        return count

    def tokens_of(self, entry_id: str) -> np.ndarray:
        """The entry's tokens (read-only uint32 array). Unknown id: KeyError."""
        return self._entries[entry_id].tokens

    def add(self, entry_id: str, tokens: Tokens, *, trimmable: bool, minimum_reusable_offset: int) -> None:
        """Index an entry; an id already present is replaced."""
        if minimum_reusable_offset < 0:
            raise ValueError(f"minimum_reusable_offset must be >= 0, got {minimum_reusable_offset}")
        array = _owned_read_only(as_token_array(tokens))
        if entry_id in self._entries:
            self.remove(entry_id)
        node = self._node_ending_at(array)
        entry = _Entry(
            entry_id=entry_id,
            tokens=array,
            trimmable=bool(trimmable),
            minimum_reusable_offset=int(minimum_reusable_offset),
            node=node,
        )
        node.entries[entry_id] = entry
        self._entries[entry_id] = entry
        if entry.trimmable:
            self._spread_frontier_point(node, entry.frontier_point)

    def remove(self, entry_id: str) -> None:
        """Drop an entry, pruning and merging nodes it alone held. Unknown id: KeyError."""
        entry = self._entries.pop(entry_id)
        del entry.node.entries[entry_id]
        point = entry.frontier_point if entry.trimmable else None
        node: _Node | None = entry.node
        while node is not None:
            parent = node.parent
            if parent is None or not self._absorbed_into_neighbours(node, parent):
                if point is not None and point in node.frontier:
                    node.frontier = self._recomputed_frontier(node)
                if node.source is entry.tokens:
                    node.source = self._live_source(node)
            node = parent

    def best(self, query: Tokens) -> IndexMatch | None:
        """The entry giving `query` the longest usable prefix, or None when none does.

        Ties: an entry needing no trim, then the shortest, then the smallest id.
        """
        query_array = as_token_array(query)
        prompt_tokens = len(query_array)
        if prompt_tokens <= 1:
            return None
        path, matched_tokens, tail = self._walk(query_array)
        # An entry serves min(common prefix, prompt_tokens - 1) tokens, so levels
        # taken deepest first serve strictly fewer tokens each, save that common
        # prefixes of prompt_tokens and prompt_tokens - 1 both serve
        # prompt_tokens - 1: a level is skipped only once it serves fewer than
        # the best found, never on a tie.
        levels = [(tail, matched_tokens)] if tail is not None else []
        levels.extend((node, node.depth) for node in reversed(path))
        best_key: tuple[int, bool, int, str] | None = None
        for node, common_tokens in levels:
            usable = min(common_tokens, prompt_tokens - 1)
            if usable <= 0 or (best_key is not None and usable < -best_key[0]):
                break
            for key in self._candidates_at(node, usable):
                if best_key is None or key < best_key:
                    best_key = key
        if best_key is None:
            return None
        return IndexMatch(entry_id=best_key[3], usable_tokens=-best_key[0], entry_tokens=best_key[2])

    def divergence(self, query: Tokens, next_tokens: int) -> tuple[int, np.ndarray]:
        """Where `query` leaves the longest prefix any entry shares with it:
        (the tokens matched, up to `next_tokens` of an entry's tokens from
        there on; empty when no entry goes further). A diagnostic: the
        matched prefix need not be usable (`best` says what is)."""
        query_array = as_token_array(query)
        path, matched, tail = self._walk(query_array)
        node = tail if tail is not None else path[-1]
        if tail is None:
            following = next(iter(node.children.values()), None)
            source = following.source if following is not None else node.source
        else:
            source = node.source
        return matched, source[matched : matched + next_tokens].copy()

    def strict_prefix_ancestors(self, tokens: Tokens) -> list[str]:
        """Ids (sorted) of entries whose tokens are a strict prefix of `tokens`."""
        array = as_token_array(tokens)
        path, _, _ = self._walk(array)
        return sorted(entry_id for node in path if node.depth < len(array) for entry_id in node.entries)

    def exact(self, tokens: Tokens) -> list[str]:
        """Ids (sorted) of entries holding exactly `tokens`."""
        array = as_token_array(tokens)
        path, matched_tokens, tail = self._walk(array)
        if tail is not None or matched_tokens != len(array):
            return []
        return sorted(path[-1].entries)

    def same_tokens(self, entry_id: str) -> list[str]:
        """Ids (sorted) of entries holding exactly the tokens of indexed entry
        `entry_id`, itself included: `exact` without walking, since every
        entry at a node holds that node's path. Unknown id: KeyError."""
        return sorted(self._entries[entry_id].node.entries)

    def strict_prefix_ancestors_of(self, entry_id: str) -> list[str]:
        """`strict_prefix_ancestors` of an indexed entry's tokens, from its
        node's ancestors instead of a walk. Unknown id: KeyError."""
        ancestors: list[str] = []
        node = self._entries[entry_id].node.parent
        while node is not None:
            ancestors.extend(node.entries)
            node = node.parent
        return sorted(ancestors)

    def entries_on_shared_paths(self) -> set[str]:
        """Ids of the entries whose node holds another entry too (same
        tokens) or lies below a node holding one (a strict prefix): the
        entries for which `same_tokens` or `strict_prefix_ancestors_of`
        names an entry besides itself. One walk of the trie, for the startup
        scan's supersession pass, which skips every other entry."""
        found: set[str] = set()
        pending: list[tuple[_Node, bool]] = [(self._root, False)]
        while pending:
            node, below_an_entry = pending.pop()
            if node.entries and (below_an_entry or len(node.entries) > 1):
                found.update(node.entries)
            below = below_an_entry or bool(node.entries)
            pending.extend((child, below) for child in node.children.values())
        return found

    def _candidates_at(self, node: _Node, usable: int) -> Iterator[tuple[int, bool, int, str]]:
        """Sort keys `(-usable, needs_trim, length, id)` of the best entries under
        `node` serving `usable` tokens. Sound only when no deeper level on the
        query's path serves more (then every trimmable entry below that can
        serve `usable` gives exactly `usable`)."""
        if node.depth == usable:
            serving = [entry_id for entry_id, entry in node.entries.items() if entry.minimum_reusable_offset <= usable]
            if serving:
                yield (-usable, False, usable, min(serving))
        point = _shortest_serving(node.frontier, usable)
        if point is not None:
            yield (-usable, point[1] != usable, point[1], point[2])

    def _walk(self, query: np.ndarray) -> tuple[list[_Node], int, _Node | None]:
        """Follow `query` down the trie.

        Returns the nodes fully matched (root first), the number of query
        tokens matched, and the node whose edge the match stopped inside
        (None when it stopped exactly at the last node of the path).
        """
        node, matched, path = self._root, 0, [self._root]
        while matched < len(query):
            child = node.children.get(int(query[matched]))
            if child is None:
                break
            end = min(len(query), child.depth)
            matched += _matching_length(query[matched:end], child.source[matched:end])
            if matched < child.depth:
                return path, matched, child
            node = child
            path.append(child)
        return path, matched, None

    def _node_ending_at(self, tokens: np.ndarray) -> _Node:
        """The node at depth `len(tokens)` on the tokens' path, created (and an
        edge split) as needed."""
        node = self._root
        while node.depth < len(tokens):
            first = int(tokens[node.depth])
            child = node.children.get(first)
            if child is None:
                leaf = _Node(parent=node, depth=len(tokens), source=tokens)
                node.children[first] = leaf
                return leaf
            end = min(len(tokens), child.depth)
            split_depth = node.depth + _matching_length(tokens[node.depth : end], child.source[node.depth : end])
            if split_depth < child.depth:
                child = self._split_edge(node, child, split_depth)
            node = child
        return node

    @staticmethod
    def _split_edge(parent: _Node, child: _Node, depth: int) -> _Node:
        """Insert a node at `depth` on the edge parent -> child; returns it."""
        middle = _Node(parent=parent, depth=depth, source=child.source, frontier=child.frontier)
        parent.children[int(child.source[parent.depth])] = middle
        middle.children[int(child.source[depth])] = child
        child.parent = middle
        return middle

    @staticmethod
    def _spread_frontier_point(node: _Node | None, point: FrontierPoint) -> None:
        # A point dominated at a node is dominated at every ancestor too, whose
        # subtree holds the dominating entry; so the walk stops there.
        while node is not None:
            widened = _frontier_with(node.frontier, point)
            if widened is None:
                return
            node.frontier = widened
            node = node.parent

    @staticmethod
    def _absorbed_into_neighbours(node: _Node, parent: _Node) -> bool:
        """Prune a node holding nothing, or merge one holding no entry and a
        single child into that child. True when `node` left the trie."""
        if node.entries or len(node.children) > 1:
            return False
        # node.source may be a removed entry's array; it still holds the tokens.
        first = int(node.source[parent.depth])
        if not node.children:
            del parent.children[first]
            return True
        (only_child,) = node.children.values()
        only_child.parent = parent
        parent.children[first] = only_child
        return True

    @staticmethod
    def _recomputed_frontier(node: _Node) -> tuple[FrontierPoint, ...]:
        own = (entry.frontier_point for entry in node.entries.values() if entry.trimmable)
        below = (point for child in node.children.values() for point in child.frontier)
        return _pareto_frontier(itertools.chain(own, below))

    @staticmethod
    def _live_source(node: _Node) -> np.ndarray:
        # Children are fixed before their parent (bottom-up walk), so a
        # child's source is already a live entry's array.
        for entry in node.entries.values():
            return entry.tokens
        for child in node.children.values():
            return child.source
        return np.empty(0, dtype=TOKEN_DTYPE)
