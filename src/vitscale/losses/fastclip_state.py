"""Where FastCLIP's per-sample state lives (losses/fastclip.py): the rows of lu1, lu2 and, for
per-sample temperatures, tau1, tau2, their Adam moments and bounds (fastclip_temperature.py).

Replicated (default): every rank keeps the whole table and applies the gathered updates.  Sharded
(`shard_state=True`): rank r keeps the rows of the dataset indices i with i % K == r (1/K of the
table, at i // K).  Each step then first all-gathers the batch's indices ((K-1)b elements) and
fetches the batch's rows (lu1, lu2; + tau1, tau2, bound1, bound2 for per-sample temperatures) with
one all_reduce of an [N, c] float64 table in which each owner fills its rows (the other entries
are 0, so the sum is the owner's value, exactly); the gathered updates are written by their owners
only.  Every number equals the replicated run's bit for bit.  Checkpoints hold the whole table
(gathered on rank 0), so a run can resume at any world size and in either mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardMap:
    """Which rows of a [n]-row per-sample table this rank keeps, and the collectives that move them."""

    def __init__(self, n: int, k: int, rank: int, sharded: bool):
        self.n, self.sharded = n, sharded
        self.k, self.rank = (k, rank) if sharded else (1, 0)

    @property
    def size(self) -> int:
        """Rows allocated on this rank: n, or ceil(n / K) when sharded."""
        return -(-self.n // self.k)

    @property
    def held(self) -> int:
        """Rows of this rank that hold a dataset index (the last ones of a shard may be padding)."""
        return len(range(self.rank, self.n, self.k))

    def own(self, idx, *values):
        """(positions, *values) of the dataset indices `idx` this rank keeps (all when replicated)."""
        if not self.sharded:
            return (idx, *values)
        mine = idx % self.k == self.rank
        return (idx[mine] // self.k, *(v[mine] for v in values))

    def write(self, table, idx_all, values) -> None:
        """Store the gathered values of the global batch's indices (owned rows only when sharded)."""
        idx_all, values = self.own(idx_all, values)
        table[idx_all] = values.to(table.dtype)

    def fetch(self, tables: list, idx_all, group) -> torch.Tensor:
        """Sharded state: the rows of the global batch's dataset indices [N] from their owners, as one
        [N, len(tables)] float64 table, by one all_reduce in which the other ranks add 0: x + 0 = x
        exactly, for x = -inf (never seen) and nan too."""
        mine = idx_all % self.k == self.rank
        pos = idx_all[mine] // self.k
        table = torch.zeros(len(idx_all), len(tables), dtype=torch.float64, device=idx_all.device)
        table[mine] = torch.stack([t[pos].double() for t in tables], 1)
        dist.all_reduce(table, group=group)
        return table

    def gather_full(self, t, group) -> torch.Tensor:
        """The whole [n] table on rank 0 from every rank's rows (collective: call it on every rank;
        the other ranks get `t` back)."""
        k, rank = self.k, self.rank
        parts = [torch.empty_like(t) for _ in range(k)] if rank == 0 else None
        dist.gather(
            t, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        if rank != 0:
            return t
        full = torch.empty(self.n, dtype=t.dtype, device=t.device)
        for r, part in enumerate(parts):
            full[r::k] = part[: len(range(r, self.n, k))]
        return full

    def load_tables(self, tables: dict, sd: dict) -> None:
        """Copy a checkpoint's entries `sd` into `tables` (by key): this rank's rows of each whole
        [n] table, 0-d entries as they are; a missing table or another dataset size is refused."""
        missing = [k for k in tables if k not in sd]
        if missing:
            raise ValueError(
                f"loss state lacks {', '.join(missing)} (written by an older vitscale, "
                "before the reference-parity temperatures?)"
            )
        for k, cur in tables.items():
            new = sd[k]
            if new.ndim and new.shape != (self.n,):
                raise ValueError(
                    f"loss state {k}: shape {tuple(new.shape)} != ({self.n},) "
                    "(dataset size changed?)"
                )
            if new.ndim:  # this rank's rows of the whole table
                self.load(cur, new)
            else:
                cur.copy_(new.to(cur.device, cur.dtype))

    def load(self, cur, full) -> None:
        """Copy this rank's rows of a whole [n] table into `cur`."""
        if not self.sharded:
            cur.copy_(full.to(cur.device, cur.dtype))
            return
        mine = full[self.rank :: self.k]
        cur.zero_()
        cur[: len(mine)] = mine.to(cur.device, cur.dtype)
