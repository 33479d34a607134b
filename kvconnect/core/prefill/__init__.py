"""The prefill half: the lease table (`table`), the leases it holds (`lease`), which blocks they hold (`holds`),
what is due when (`due`), releases that come before their grant (`early`), the checks a reader must pass
(`checks`), and the lender that grants and answers decodes' lease requests (`lender`). It never imports the
decode half.

The lease rules:

- **Keys.** A lease is keyed by a random lease id (`new_lease_id`); the request's own id is only its label
  (logs, callbacks), so knowing it gives nothing.
- **One end.** A lease ends exactly once: COMPLETED (its reader's notification or confirmation arrived while
  held), RELEASED, or EXPIRED (TTL). Each end calls `on_free(lease, freed_block_ids)`; ended leases stay as
  tombstones for a while, so a late confirmation learns whether its read was under the lease.
- **Shared blocks.** Several live leases may hold one block (prefix caching): the table counts holders, and an
  end hands back only the blocks no other lease holds (`holds.py`).
- **Read tokens.** Every reader speaks with a random token of its own; the first token a reader slot uses
  (PIN, notification or CONFIRM) claims it. Any other token is answered CONSUMED, so params replayed to a
  second decode never pass as read under the lease.
- **Bound to blocks.** A reader names the blocks it read; `blocks_problem` (`checks.py`) refuses any the lease
  does not hold (a suffix of the leased ids is fine: a decode's own prefix-cache hit reads fewer; for a hybrid
  model's lease, a suffix of each KV cache group), and a refusal leaves the lease as it was.
- **Bound to a prompt.** A lease granted with a prompt digest (`params.prompt_digest`) answers a PIN, CONFIRM
  or notification only when it names the same digest: a client cannot have one prompt decoded from another
  prompt's KV (nor cache it under the other prompt's hashes). A lease granted without one is unbound.
- **Pins.** A reader may pin a held lease before its read ends: until the pin ends (complete, release, or its
  own deadline) the blocks are not handed back, whatever ends the lease meanwhile; that end takes effect when
  the last pin goes.
- **Renewals.** A decode whose request waits in its queue renews the lease (`renew`): held another TTL from
  now, never past `max_s` from its grant, so a dead decode's leases still end one TTL after its last renewal,
  and no lease is held forever. A renewal claims no reader slot and reads nothing; one that comes after the
  TTL ran out (before a tick ended the lease) ends it instead of reviving it.
- **Bounded.** Leases hold at most `max_blocks` blocks at once (`lease_cache_share` of the cache): a grant
  beyond it expires unpinned leases idle `share_min_idle_s` or longer, least recently granted or renewed first
  (`Holds.room_for`: a younger lease is most likely on its way to its decode). A grant is never refused; pinned
  or younger leases stay, so those and the grant may go over the bound.
- **Work by what is due.** `expire` runs at every connector tick, the engine's included: it looks only at
  leases with something due (a TTL, a pin's deadline, a tombstone to forget: `due.py`), never at the minute's
  tombstones.
- **Early releases.** With a grace (`grace_s`: engines that grant a little after their params left), a RELEASE
  of a lease not granted yet is remembered that long, and the grant it precedes ends at once, RELEASED, if the
  release named a suffix of its blocks (`early.py`).
"""
