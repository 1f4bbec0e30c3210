"""Where a dp rank's logical addresses live across its ``tp`` ranks (``memory.layout``).

In TP mode the ``P`` tp ranks of a dp rank share one logical address space of
``num_logical`` addresses. Each rank owns a part of it and stores the owned entries in
its own pools, indexed by a *local address* in ``[0, rank_capacity)``. A layout is the
map ``logical address -> (owner rank, local address)``; every rank knows the whole map,
so every rank can tell who owns any selected entry.

* ``mod``: address ``a`` on rank ``a mod P`` at local address ``a // P``. Consecutive
  positions of a page sit on consecutive ranks: a request's history is spread evenly.
* ``block``: rank ``r`` owns the contiguous range ``[r * C, (r + 1) * C)`` of the
  rank's logical space (``C`` = ``rank_capacity``), at local address ``a - r * C``.
  Where a request lands depends on which logical pages the engine hands it.
* ``request``: every request has one owner rank. Memory systems see addresses, not
  requests, so ownership is kept per logical *page* in a table: when a request's first
  prefill chunk is written (``write_prefill`` names its decode row), the row gets as
  owner the rank with the most free local pages (lowest rank on ties), and every page
  first written by that row -- in prefill, or when a decode step writes its new token
  (``decode_step`` passes one address per decode row) -- takes a free local page of the
  owner. When the owner is full, the page spills to the ranks with free pages (lowest
  rank first), so nothing is ever refused: ``num_logical`` equals the local pages of all
  ranks. Releasing a request frees its pages and its row's owner.

``replicated`` (a full copy on every rank) is ``resident``'s TP layout, not one of these.

All functions are pure jnp on local values (no dp axis) and give the same result on
every tp rank: the layout state is replicated over ``tp``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from ula_jax.core.scatter import set_where
from ula_jax.core.types import INVALID

_I32 = jnp.int32

LAYOUTS: tuple[str, ...] = ("mod", "block", "request")


class Layout(abc.ABC):
  """A static (hashable) layout over ``tp`` ranks of ``rank_capacity`` local addresses.

  Sizes: ``num_logical`` (a multiple of ``page_size``, at most ``tp * rank_capacity``).
  """

  name: ClassVar[str]

  def __init__(self, tp: int, rank_capacity: int, page_size: int, max_batch: int):
    self.tp = tp
    self.rank_capacity = rank_capacity
    self.page_size = page_size
    self.max_batch = max_batch
    self.num_logical = (tp * rank_capacity // page_size) * page_size

  def init(self) -> Any:
    """The empty layout state (local arrays, replicated over tp)."""
    return ()

  @abc.abstractmethod
  def locate(self, st: Any, addrs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """addrs: [...] int32 -> (rank [...] int32, local [...] int32), both INVALID where
    the address is invalid or (``request``) not placed yet."""

  def place(self, st: Any, addrs: jax.Array, valid: jax.Array, rows: jax.Array) -> Any:
    """Gives an owner to the addresses about to be written (only ``request`` keeps state).

    addrs: [n] int32; valid: [n] bool; rows: [n] int32 the decode row writing each
    address (INVALID: unknown)
    """
    del addrs, valid, rows
    return st

  def release(self, st: Any, addrs: jax.Array, valid: jax.Array, row: jax.Array) -> Any:
    """Frees what ``place`` gave ``addrs`` ([n] int32, valid [n] bool) and row ``row``."""
    del addrs, valid, row
    return st

  def owned_per_row(self, pages: int) -> int:
    """At most how many positions of a row of ``pages`` pages one rank owns."""
    return pages * self.page_size

  def _ok(self, addrs: jax.Array) -> jax.Array:
    return (addrs >= 0) & (addrs < self.num_logical)


class ModLayout(Layout):
  """Address ``a`` on rank ``a mod P``, local address ``a // P``."""

  name = "mod"

  def owned_per_row(self, pages: int) -> int:
    # A page's addresses are consecutive: a rank owns at most ceil(page_size / P) of them.
    return pages * -(-self.page_size // self.tp)

  def locate(self, st, addrs):
    del st
    ok = self._ok(addrs)
    return (jnp.where(ok, addrs % self.tp, INVALID).astype(_I32),
            jnp.where(ok, addrs // self.tp, INVALID).astype(_I32))


class BlockLayout(Layout):
  """Rank ``r`` owns addresses ``[r * C, (r + 1) * C)``, ``C = rank_capacity``."""

  name = "block"

  def locate(self, st, addrs):
    del st
    ok = self._ok(addrs)
    C = self.rank_capacity
    return (jnp.where(ok, addrs // C, INVALID).astype(_I32),
            jnp.where(ok, addrs % C, INVALID).astype(_I32))


@struct.dataclass
class RequestLayoutState:
  """Page ownership of the ``request`` layout (replicated over tp).

  page_rank:  [NP] int32 owner rank of each logical page, INVALID = not placed
  page_local: [NP] int32 its local page on the owner
  free:       [P, LP] bool free local pages of each rank
  row_owner:  [B] int32 owner rank of the request in each decode row, INVALID = none
  """

  page_rank: jax.Array
  page_local: jax.Array
  free: jax.Array
  row_owner: jax.Array


class RequestLayout(Layout):
  """One owner rank per request, kept per logical page (see the module doc)."""

  name = "request"

  def __init__(self, tp: int, rank_capacity: int, page_size: int, max_batch: int):
    super().__init__(tp, rank_capacity, page_size, max_batch)
    self.local_pages = rank_capacity // page_size  # LP
    self.num_logical = tp * self.local_pages * page_size
    self.num_pages = tp * self.local_pages  # NP

  def init(self) -> RequestLayoutState:
    return RequestLayoutState(
        page_rank=jnp.full((self.num_pages,), INVALID, _I32),
        page_local=jnp.full((self.num_pages,), INVALID, _I32),
        free=jnp.ones((self.tp, self.local_pages), jnp.bool_),
        row_owner=jnp.full((self.max_batch,), INVALID, _I32),
    )

  def locate(self, st: RequestLayoutState, addrs):
    ok = self._ok(addrs)
    page = jnp.clip(addrs // self.page_size, 0, self.num_pages - 1)
    rank = st.page_rank[page]
    ok = ok & (rank >= 0)
    local = st.page_local[page] * self.page_size + addrs % self.page_size
    return jnp.where(ok, rank, INVALID).astype(_I32), jnp.where(ok, local, INVALID).astype(_I32)

  def place(self, st: RequestLayoutState, addrs, valid, rows) -> RequestLayoutState:
    n, P, LP, NP = addrs.shape[0], self.tp, self.local_pages, self.num_pages
    ok = valid & self._ok(addrs)
    page = jnp.where(ok, addrs // self.page_size, NP)
    fresh = ok & (st.page_rank[jnp.clip(page, 0, NP - 1)] < 0)

    # A row without an owner (its request's first chunk) takes the rank with the most
    # free pages; every fresh page prefers its row's owner.
    free_cnt = jnp.sum(st.free, axis=1).astype(_I32)  # [P]
    roomiest = jnp.argmax(free_cnt).astype(_I32)
    row_ok = (rows >= 0) & (rows < self.max_batch)
    rclip = jnp.clip(rows, 0, self.max_batch - 1)
    owner = jnp.where(row_ok, st.row_owner[rclip], INVALID)
    pref = jnp.where(owner >= 0, owner, roomiest)
    row_owner = st.row_owner.at[jnp.where(row_ok & fresh & (owner < 0), rclip, self.max_batch)
                                ].set(roomiest, mode="drop")

    # One placement per distinct fresh page (the first address that names it).
    key = jnp.where(fresh, page, NP)
    order = jnp.argsort(key, stable=True)
    skey = key[order]
    head_s = (skey < NP) & jnp.concatenate([jnp.ones((1,), jnp.bool_), skey[1:] != skey[:-1]])
    head = jnp.zeros((n,), jnp.bool_).at[order].set(head_s)

    # Pass 1: the j-th fresh page preferring rank r takes r's j-th free page, if any.
    onehot = head[:, None] & (pref[:, None] == jnp.arange(P)[None, :])  # [n, P]
    ordinal = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1,
                                  jnp.clip(pref, 0, P - 1)[:, None], axis=1)[:, 0]
    first = head & (ordinal < free_cnt[jnp.clip(pref, 0, P - 1)])
    used1 = jnp.minimum(jnp.sum(onehot, axis=0).astype(_I32), free_cnt)  # [P]

    # Pass 2: pages that did not fit spill over the remaining free pages, lowest rank first.
    spill = head & ~first
    rem = free_cnt - used1
    ends = jnp.cumsum(rem)
    s = jnp.cumsum(spill) - 1
    srank = jnp.clip(jnp.searchsorted(ends, s, side="right"), 0, P - 1).astype(_I32)
    sord = used1[srank] + s - (ends[srank] - rem[srank])
    placed = first | (spill & (s < ends[-1]))
    rank = jnp.where(first, pref, srank)
    nth = jnp.where(first, ordinal, sord)

    # The nth free local page of each rank (ascending).
    cs = jnp.cumsum(st.free, axis=1) - 1  # [P, LP]
    freelist = set_where(jnp.full((P, LP), INVALID, _I32), (jnp.arange(P)[:, None], cs),
                         jnp.broadcast_to(jnp.arange(LP, dtype=_I32), (P, LP)), st.free)
    lpage = freelist[jnp.clip(rank, 0, P - 1), jnp.clip(nth, 0, LP - 1)]
    placed = placed & (lpage >= 0)

    tgt = jnp.where(placed, page, NP)
    return RequestLayoutState(
        page_rank=st.page_rank.at[tgt].set(rank, mode="drop"),
        page_local=st.page_local.at[tgt].set(lpage, mode="drop"),
        free=set_where(st.free, (rank, lpage), False, placed),
        row_owner=row_owner,
    )

  def release(self, st: RequestLayoutState, addrs, valid, row) -> RequestLayoutState:
    NP = self.num_pages
    ok = valid & self._ok(addrs)
    page = jnp.clip(addrs // self.page_size, 0, NP - 1)
    rank, lpage = st.page_rank[page], st.page_local[page]
    ok = ok & (rank >= 0)
    row_ok = (row >= 0) & (row < self.max_batch)
    return RequestLayoutState(
        page_rank=st.page_rank.at[jnp.where(ok, page, NP)].set(INVALID, mode="drop"),
        page_local=st.page_local.at[jnp.where(ok, page, NP)].set(INVALID, mode="drop"),
        free=set_where(st.free, (rank, lpage), True, ok),
        row_owner=st.row_owner.at[jnp.where(row_ok, row, self.max_batch)].set(
            INVALID, mode="drop"),
    )


_CLASSES: dict[str, type[Layout]] = {"mod": ModLayout, "block": BlockLayout,
                                     "request": RequestLayout}


def make_layout(name: str, tp: int, rank_capacity: int, page_size: int,
                max_batch: int) -> Layout:
  """The layout ``name`` over ``tp`` ranks of ``rank_capacity`` local addresses each."""
  if name == "replicated":
    raise ValueError(
        "memory.layout='replicated' is resident's TP baseline (a full copy on every tp "
        "rank), not a ula layout: use memory.system=resident for it, or memory.layout one "
        f"of {list(LAYOUTS)} with memory.system=ula")
  if name not in _CLASSES:
    raise ValueError(f"memory.layout={name!r}: expected one of {list(LAYOUTS)}")
  return _CLASSES[name](tp, rank_capacity, page_size, max_batch)
