"""The KV-cache block pool: free lists, ref counts, prefix hashes, copy-on-write.

Owns one invariant: every block is either free (ref count 0, in one of the free
lists) or used (ref count >= 1, in at least one sequence's block table), so
`num_free_blocks + num_used_blocks == num_total_blocks` always holds.

A sequence's block table grows only when its last block is full: slots for
`n` tokens need ceil(n / block_size) blocks. Allocation is all-or-nothing, so a
failed request for blocks changes nothing.

Prefix caching. A full block whose K/V are computed is identified by a chained
hash (`prefix_hash.block_hashes`: the parent block's hash and this block's
token ids, the chain salted with the model and block size, and with the
request's `cache_salt` if it has one), the same function the fleet router uses
to predict hits. A cached block also records its parent:
the cached block that preceded it in the sequence that registered it. A lookup
accepts block i only if its stored tokens equal the prompt's and its parent is
the block accepted at i-1, so by induction a hit covers the whole prefix, not
just one block's tokens, whatever the hashes do. Evicting a block uncaches its
cached descendants with it, so every cached block's parent is cached
(`check_accounting` asserts this). When a sequence is admitted, every block of
its longest cached prefix is reused (ref count up) and only the rest is
computed. A freed block keeps its contents and its hash: it sits in the free
list still findable, and is evicted only when it is handed out again.

The set of cached hashes is maintained incrementally: `_cached` (hash ->
block) and a counting-Bloom `PrefixDigest` change only when a block is
registered or evicted (the digest logs those and applies them in one batch when
a report reads it), so reporting them to a router costs nothing per cached block.

Hot cache. The blocks a prefix lookup reused in the last `HOT_WINDOW_S` (in use or
free) are the cache's working set: `num_hot_cached_blocks`, what the autoscaler keeps
room for when it scales in. Each block records the whole second of its last reuse,
and a count per second is kept (a reuse moves a block from its old second to the
current one, an eviction takes it out): O(1) per reused block, and a read sums at
most `HOT_WINDOW_S` counts. Time is `clock` (monotonic; the simulator's is simulated).

Eviction: a segmented LRU whose split adapts (ARC's rule). Free blocks sit in one
of two LRU lists, each taking blocks at its back: the probation list (blocks no
prefix lookup has reused since they were cached, and uncached ones) and the
protected list (cached blocks a lookup has reused). A block is taken from the
probation list's front, and from the protected list only when probation is
empty. A block freed into a protected list longer than its target pushes the
list's oldest to the probation list's back, so a reused prefix gone cold still
ages out.

Why two lists: a serving replica caches every request's unique tail (its query,
its output) beside the prefixes that requests share, and under plain LRU that
never-reused tail pushes a tenant's system prompt out whenever the tenant comes
back less often than the pool turns over. Why the target adapts: protecting what
was reused costs the blocks waiting for their first reuse (a chat's last turn
before the next one comes), and which matters more depends on the traffic. So the
target starts at 0 (plain LRU) and learns from misses, as ARC (Megiddo and Modha)
sizes its lists: the hashes evicted last (as many as the pool has blocks) are
remembered as ghosts, each marked whether it had been reused. An admission whose
prompt misses a ghost that had been reused grows the target (a reused prefix was
evicted too soon); one that misses a ghost never reused shrinks it (a block was
evicted before its first reuse). Each miss moves it by one block, or by the ratio
of the other kind of ghosts to its own kind where that is larger, so the rarer
evidence weighs as much as the commoner. The target stays within
`protected_fraction` of the pool, so new prompts always keep a share in which to
earn their first reuse; `protected_fraction=0` is plain LRU.

A sequence's blocks are returned in reverse order (its tail first, since a
prefix's deeper blocks are the least likely to be shared).

Sliding windows. With `sliding_window` W (set when every layer of the model
attends through a window, W the widest), a token at position j is read by no
later query once the next query's position p has p - W >= j. After each step
(`free_out_of_window`) the blocks wholly before the window of a sequence's next
query go back to the pool; their table entries stay (the kernels skip them,
`pagefleet.kernels`), counted by `seq.num_freed_blocks`, and `free` / `fork`
pass over them. A sequence then holds at most ceil(W / block_size) + 1 blocks
whatever its length. Prefix caching with windows: a cached prefix is a chain
of blocks from the first token that are all still held or free-but-intact;
a block freed out of a window is about to be overwritten by whoever takes it
next, and without it no chain through it can be hit, so its hash is dropped
with its cached descendants' (theirs can no longer be reached), and the
digest the router reads loses them at once. Prompts sharing a prefix within
the window still hit while the first holder has not slid past it. With a
global layer among the windowed ones (Gemma 3), every token stays readable,
so nothing is freed early.

Copy-on-write. `fork` gives a child sequence the parent's block table, every
block's ref count up by one. Before a sequence writes K/V into a block that
others still reference (only a partly filled last block can be written), it
gets a fresh block and the scheduler is told to copy the old block's contents
into it.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from .prefix_hash import PrefixDigest, extend_block_hashes, prefix_hash_salt, salted
from .sequence import Sequence

# Parent of a chain's first block in `_parent_of` (block ids are >= 0).
_ROOT = -1
_ABSENT = object()  # a default no block maps to (`allocate_prefilled`)
# A cached block reused within this many seconds is hot (`num_hot_cached_blocks`).
HOT_WINDOW_S = 60
# Share of the pool the protected free list may grow to (module docstring, "Eviction").
PROTECTED_FRACTION = 0.8


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_salt: int | None = None,
        digest_bits: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        protected_fraction: float = PROTECTED_FRACTION,
        sliding_window: int | None = None,
    ) -> None:
        """`hash_salt` roots every hash chain (`prefix_hash.prefix_hash_salt(model,
        block_size)`; by default that of an unnamed model); `digest_bits` sizes the
        prefix digest (default `PrefixDigest.bits_for(num_blocks)`); `clock` times
        reuses (the hot cache); `protected_fraction` bounds the protected free list
        (module docstring, "Eviction"); `sliding_window`: past it no layer reads a
        token (module docstring, "Sliding windows"; None: every token stays)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not 0 <= protected_fraction <= 1:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = prefix_hash_salt("", block_size) if hash_salt is None else hash_salt
        self._ref_counts = [0] * num_blocks
        # The free lists (module docstring, "Eviction"): front = next out.
        self._probation: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._max_protected = int(protected_fraction * num_blocks)
        self._protected_target = 0  # adapts within [0, _max_protected]
        # Evicted hash -> whether it had been reused, the oldest first (at most
        # num_blocks), and how many of them had.
        self._ghosts: OrderedDict[int, bool] = OrderedDict()
        self._reused_ghosts = 0
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        # Cached block -> the cached block before it in its chain (_ROOT for a first block).
        self._parent_of: list[int | None] = [None] * num_blocks
        # Cached block -> its cached children (a block with none has no entry).
        self._children: dict[int, set[int]] = {}
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.digest = PrefixDigest(digest_bits or PrefixDigest.bits_for(num_blocks))
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM counts tokens)
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.clock = clock
        self._reused_at: list[int] = [-1] * num_blocks  # second of its last reuse; -1: none
        self._reused_in: dict[int, int] = {}  # second -> cached blocks last reused in it

    # -- state ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._probation) + len(self._protected)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_hot_cached_blocks(self, window_s: int = HOT_WINDOW_S) -> int:
        """Cached blocks (in use or free) a prefix lookup reused in the last `window_s`
        seconds (module docstring, "Hot cache"); older counts are dropped as it reads."""
        now = int(self.clock())
        counts = self._reused_in
        for second in [s for s in counts if s <= now - window_s]:
            del counts[second]
        return sum(counts.values())

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be handed out (evicted)."""
        return [*self._probation, *self._protected]

    def cached_block_hashes(self, limit: int = 4096) -> frozenset[int]:
        """Hashes of cached blocks, most recently used first, at most `limit`.

        In-use blocks come first, then free ones from the most recently freed.
        A router can match a prompt's block hashes against it (or, cheaper and
        bounded, against `digest`). Costs O(cached blocks), not O(all blocks):
        under the limit it is a copy of the incrementally kept set.
        """
        if len(self._cached) <= limit:
            return frozenset(self._cached)
        used = [h for h, b in self._cached.items() if self._ref_counts[b]]
        out = used[:limit]
        for b in itertools.chain(reversed(self._protected), reversed(self._probation)):
            if len(out) >= limit:
                break
            h = self._hash_of[b]
            if h is not None:
                out.append(h)
        return frozenset(out)

    def prefix_digest(self) -> bytes:
        """The cached hashes as a bounded Bloom bitset (`prefix_hash.DigestView` reads it)."""
        return self.digest.to_bytes()

    # -- hashing ----------------------------------------------------------------

    def block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of `seq`'s full blocks (extended as it grows)."""
        hashes = seq.block_hashes
        root = salted(self.hash_salt, seq.cache_salt)
        extend_block_hashes(hashes, seq.token_ids, self.block_size, root)
        return hashes

    def holds(self, block_hash: int) -> bool:
        """Whether a block with this hash is cached and in use (a sequence that reuses it
        takes nothing from the free pool)."""
        block = self._cached.get(block_hash)
        return block is not None and self._ref_counts[block] > 0

    def cached_run(self, hashes: Iterable[int]) -> int:
        """How many of a prompt's chained block `hashes`, from the first, are cached (in
        use or free): an exact view of this cache, as a router fed its events has it."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s tokens.

        At most all but the last token: one token is always computed, so that
        the step has logits to sample from (two for a request about to fork,
        which stops one token short before it forks).
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        if seq.params.embed:  # every prompt token's hidden state is pooled
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1 - min(1, seq.num_forks_pending)) // bs
        # Each block is a hit if its hash is cached, its parent is the block accepted
        # before it (the whole chain, not only this block) and its tokens are this
        # block's: the run of hits is the prefix before the first block failing any of
        # the three. A prompt's hits are hundreds of blocks, so each test runs over the
        # whole run at once (C-level maps), each stopping the run at its first failure.
        blocks = list(map(self._cached.get, self.block_hashes(seq)[:max_blocks]))
        if None in blocks:
            del blocks[blocks.index(None) :]
        if not blocks:
            return blocks
        parents = map(self._parent_of.__getitem__, blocks)
        wrong = list(map(operator.ne, parents, itertools.chain((_ROOT,), blocks)))
        if True in wrong:
            del blocks[wrong.index(True) :]
        tokens = iter(seq.token_ids[: len(blocks) * bs])
        chunks = zip(*[tokens] * bs, strict=True)  # per block, as tuples
        wrong = list(map(operator.ne, map(self._tokens_of.__getitem__, blocks), chunks))
        if True in wrong:
            del blocks[wrong.index(True) :]
        return blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s newly full, computed blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq)
        # Locals: a prompt chunk registers hundreds of blocks here.
        first = seq.num_registered_blocks
        table = seq.block_table
        # The new blocks' tokens as one tuple, sliced per block (from block `first`).
        tokens = tuple(seq.token_ids[first * bs : full * bs])
        hash_of, tokens_of, parent_of = self._hash_of, self._tokens_of, self._parent_of
        cached, children = self._cached, self._children
        added: list[int] = []
        for i in range(first, full):
            block, h = table[i], hashes[i]
            parent = table[i - 1] if i else _ROOT
            # Only extend a cached chain: a block whose predecessor in this
            # sequence is not the cached holder of the previous hash (a duplicate
            # computed alongside the cached one) starts no chain of its own.
            if (
                hash_of[block] is None
                and h not in cached
                and (parent == _ROOT or hash_of[parent] == hashes[i - 1])
            ):
                hash_of[block] = h
                tokens_of[block] = tokens[(i - first) * bs : (i - first + 1) * bs]
                parent_of[block] = parent
                if parent != _ROOT:
                    children.setdefault(parent, set()).add(block)
                cached[h] = block
                added.append(h)
        self.digest.add_many(added)
        seq.num_registered_blocks = full

    # -- allocation ---------------------------------------------------------------

    def _take_free(self, evicted: list[int]) -> int:
        """The next free block out (probation's front, else the protected list's), evicted
        from the cache if cached: its hash (and its descendants') go to `evicted`, for the
        caller to take out of the digest."""
        block, _ = (self._probation or self._protected).popitem(last=False)
        if self._hash_of[block] is not None:  # evict: its contents are about to be overwritten
            self._uncache(block, evicted)
        self._ref_counts[block] = 1
        return block

    def _uncache(self, block: int, evicted: list[int]) -> None:
        """Forget `block`'s hash and, with it, every cached block chained below it.

        A descendant can no longer be reached through the chain check, and
        keeping it would leave a dead hash in the digest and squat its hash
        against a later, reachable copy. Descendants are free blocks: whoever
        holds a cached block holds its whole chain. Iterative: chains can be
        longer than Python's recursion limit.
        """
        parent = self._parent_of[block]
        if parent is not None and parent != _ROOT:
            siblings = self._children[parent]
            siblings.discard(block)
            if not siblings:
                del self._children[parent]
        stack = [block]
        while stack:
            b = stack.pop()
            h = self._hash_of[b]
            assert h is not None
            del self._cached[h]
            evicted.append(h)
            second = self._reused_at[b]
            if self._max_protected:
                self._remember(h, second >= 0)
            if second >= 0:
                self._reused_at[b] = -1
                if second in self._reused_in:  # else older than any window read
                    self._reused_in[second] -= 1
            self._hash_of[b] = None
            self._tokens_of[b] = None
            self._parent_of[b] = None
            if b in self._protected:  # nothing to protect: next out
                del self._protected[b]
                self._probation[b] = None
                self._probation.move_to_end(b, last=False)
            stack.extend(self._children.pop(b, ()))

    def _remember(self, block_hash: int, reused: bool) -> None:
        """Keep an evicted hash as a ghost (module docstring, "Eviction")."""
        ghosts = self._ghosts
        self._reused_ghosts += reused - ghosts.pop(block_hash, False)
        ghosts[block_hash] = reused
        if len(ghosts) > self.num_total_blocks:
            self._reused_ghosts -= ghosts.popitem(last=False)[1]

    def _learn(self, missed: Iterable[int]) -> None:
        """Move the protected target by the ghosts among an admitted prompt's `missed`
        block hashes (module docstring, "Eviction"); each such ghost is forgotten, its
        block about to be computed again."""
        ghosts = self._ghosts
        # Per missed hash: True / False for a ghost (taken out), None for none; at C speed
        # (a prompt misses hundreds of blocks, most of them never cached).
        found = list(map(ghosts.pop, missed, itertools.repeat(None)))
        grow, shrink = found.count(True), found.count(False)
        if not (grow or shrink):
            return
        self._reused_ghosts -= grow
        reused_ghosts, new_ghosts = self._reused_ghosts, len(ghosts) - self._reused_ghosts
        step = grow * max(1.0, new_ghosts / max(reused_ghosts, 1)) - shrink * max(
            1.0, reused_ghosts / max(new_ghosts, 1)
        )
        self._protected_target = max(
            0, min(self._max_protected, self._protected_target + round(step))
        )
        while len(self._protected) > self._protected_target:
            self._demote_oldest()

    def _demote_oldest(self) -> None:
        """The protected list's oldest block to probation's back (it is still cached)."""
        self._probation[self._protected.popitem(last=False)[0]] = None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add so that its table holds `num_tokens` slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table)) + int(self._needs_copy(seq, num_tokens))

    def _needs_copy(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the next write lands in a block other sequences still hold."""
        start = seq.num_computed_tokens
        idx = start // self.block_size
        return (
            num_tokens > start
            and idx < len(seq.block_table)
            and self._ref_counts[seq.block_table[idx]] > 1
        )

    def allocate(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Grow `seq`'s table to `num_tokens` slots; False (and no change) if short.

        A shared block about to be written is replaced by a private copy;
        the (source, destination) pair is appended to `copies`.
        """
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks:
            return False
        evicted: list[int] = []
        if self._needs_copy(seq, num_tokens):
            idx = seq.num_computed_tokens // self.block_size
            old = seq.block_table[idx]
            new = self._take_free(evicted)
            self._ref_counts[old] -= 1
            seq.block_table[idx] = new
            copies.append((old, new))
        want = -(-num_tokens // self.block_size)
        while len(seq.block_table) < want:
            seq.block_table.append(self._take_free(evicted))
        self.digest.remove_many(evicted)
        return True

    def allocate_prefilled(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Admit `seq`: reuse the `cached` prefix blocks, then add blocks up to `num_tokens` slots."""
        assert not seq.block_table, "admission starts from an empty block table"
        refs = self._ref_counts
        counts = list(map(refs.__getitem__, cached))
        revived = counts.count(0)
        need = -(-num_tokens // self.block_size) - len(cached)
        if need > self.num_free_blocks - revived:
            return False
        if cached:
            # The prefix's blocks (distinct: one chain; a prompt reuses hundreds) read in
            # C-level passes; written in loops, which store faster than a map over a slot
            # wrapper such as `__setitem__` (measured below). Free ones leave their list.
            if revived:
                idle = list(itertools.compress(cached, map(operator.not_, counts)))
                absent = itertools.repeat(_ABSENT)
                popped = map(self._protected.pop, idle, absent)
                probation = self._probation
                for block in itertools.compress(idle, map(operator.is_, popped, absent)):
                    del probation[block]
            now = int(self.clock())
            reused_at, reused_in = self._reused_at, self._reused_in
            seconds = Counter(map(reused_at.__getitem__, cached))
            for second, n in seconds.items():
                # -1 (never) and dropped seconds are absent
                if second != now and second in reused_in:
                    reused_in[second] -= n
            for block, count in zip(cached, counts, strict=True):
                refs[block] = count + 1
                reused_at[block] = now
            reused_in[now] = reused_in.get(now, 0) + len(cached) - seconds.get(now, 0)
        seq.block_table.extend(cached)
        seq.num_registered_blocks = len(cached)
        if self._ghosts:
            self._learn(itertools.islice(seq.block_hashes, len(cached), None))
        evicted: list[int] = []
        for _ in range(need):
            seq.block_table.append(self._take_free(evicted))
        self.digest.remove_many(evicted)
        if self.enable_prefix_caching:
            seq.num_cached_tokens = len(cached) * self.block_size
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of `parent` with `child` (copy-on-write later)."""
        assert not child.block_table
        for block in parent.block_table[parent.num_freed_blocks :]:
            self._ref_counts[block] += 1
        child.block_table.extend(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_freed_blocks = parent.num_freed_blocks

    def blocks_to_hold(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once: all of them, or with
        a window, those of the window around its newest query (plus the one it starts)."""
        blocks = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, -(-self.sliding_window // self.block_size) + 1)

    def free_out_of_window(self, seq: Sequence) -> int:
        """Return the blocks wholly before the window of `seq`'s next query to the pool
        (module docstring, "Sliding windows"); how many were freed."""
        if self.sliding_window is None:
            return 0
        dead = (seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        first = seq.num_freed_blocks
        if dead <= first:
            return 0
        evicted: list[int] = []
        for block in seq.block_table[first:dead]:
            if self._hash_of[block] is not None:
                self._uncache(block, evicted)
            self._release(block)
        self.digest.remove_many(evicted)
        seq.num_freed_blocks = dead
        return dead - first

    def _release(self, block: int) -> None:
        """One holder fewer; a block no one holds goes to probation's back."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._probation[block] = None

    def replace_last_token(self, seq: Sequence, token: int) -> None:
        """Change `seq`'s newest token, whose K/V are not computed yet (beam search)."""
        assert seq.num_computed_tokens < seq.num_tokens, "the last token is already in the cache"
        seq.token_ids[-1] = token
        del seq.block_hashes[(seq.num_tokens - 1) // self.block_size :]

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; a block returns to the pool when no one holds it."""
        reused_at, protected, target = self._reused_at, self._protected, self._protected_target
        refs, probation = self._ref_counts, self._probation
        for block in reversed(seq.block_table[seq.num_freed_blocks :]):
            left = refs[block] - 1
            refs[block] = left
            if left == 0:
                if reused_at[block] < 0 or not target:
                    probation[block] = None
                    continue
                protected[block] = None
                if len(protected) > target:
                    self._demote_oldest()
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.num_freed_blocks = 0

    def check_accounting(self) -> None:
        """Raise AssertionError unless free + used == total and ref counts agree."""
        for block, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"block {block}: negative ref count {count}")
            free = (block in self._probation) + (block in self._protected)
            if free > 1 or (count == 0) != (free == 1):
                raise AssertionError(f"block {block}: ref count {count} but in {free} free lists")
        if not len(self._protected) <= self._protected_target <= self._max_protected:
            raise AssertionError(
                f"{len(self._protected)} protected, target {self._protected_target}, "
                f"at most {self._max_protected}"
            )
        if len(self._ghosts) > self.num_total_blocks or self._reused_ghosts != sum(
            self._ghosts.values()
        ):
            raise AssertionError(f"{len(self._ghosts)} ghosts, {self._reused_ghosts} reused")
        for block in self._protected:
            if self._reused_at[block] < 0:
                raise AssertionError(f"protected block {block} was never reused")
        for h, block in self._cached.items():
            if self._hash_of[block] != h:
                raise AssertionError(
                    f"cached hash {h} points at block {block} holding {self._hash_of[block]}"
                )
            parent = self._parent_of[block]
            if parent is None or (parent != _ROOT and self._hash_of[parent] is None):
                raise AssertionError(f"cached block {block} has no cached parent ({parent})")
        per_second: dict[int, int] = {}
        for block, second in enumerate(self._reused_at):
            if second >= 0:
                if self._hash_of[block] is None:
                    raise AssertionError(f"block {block}: reused at {second} but not cached")
                per_second[second] = per_second.get(second, 0) + 1
        for second, count in self._reused_in.items():
            if per_second.get(second, 0) != count:
                raise AssertionError(f"second {second}: {count} hot blocks counted, {per_second}")
        if len(self.digest) != len(self._cached):
            raise AssertionError(
                f"digest holds {len(self.digest)} hashes, cache {len(self._cached)}"
            )
        if self.num_free_blocks + self.num_used_blocks != self.num_total_blocks:
            raise AssertionError("free + used != total")
