"""Which samples go in which batch: the epoch permutation and its split over ranks.

One global batch per optimizer step; rank r takes a contiguous slice of it. The order is a
function of (seed, epoch) only, so batch b of epoch e is the same whether iteration starts at
0 or at b (exact resume), and the union over ranks covers every sample once per epoch.
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import DataError


def derive_seed(*parts) -> int:
    """A 63-bit seed from a tuple of ints/strings (stable across processes and runs)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous [lo, hi) of n items for `rank`; sizes differ by at most one, union = all."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class EpochPlan:
    """Global batches of `batch_size` over `n` samples, and this rank's slice of each. That the
    batch splits evenly over the ranks (and their micro-batches) is the Trainer's one check
    (config.micro_batch, where the world size is known)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        seed: int,
        drop_last: bool,
        rank: int = 0,
        world_size: int = 1,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"data: rank {rank} is not in [0, {world_size})")
        if batch_size > n:
            raise DataError(
                f"data.batch_size ({batch_size}) is larger than the training set "
                f"({n} images): lower data.batch_size"
            )
        self.n, self.batch_size, self.seed, self.drop_last = n, batch_size, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.num_batches = n // batch_size if drop_last else -(-n // batch_size)
        self._cache: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.num_batches

    def permutation(self, epoch: int) -> torch.Tensor:
        """[n] int64: the order of the whole train set in this epoch (same on every rank)."""
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (
                epoch,
                torch.randperm(self.n, generator=generator("perm", self.seed, epoch)),
            )
        return self._cache[1]

    def global_batch(self, epoch: int, b: int) -> torch.Tensor:
        """[Bg] sample indices of global batch b (Bg = batch_size except a last partial batch)."""
        return self.permutation(epoch)[b * self.batch_size : (b + 1) * self.batch_size]

    def local_range(self, global_size: int) -> tuple[int, int]:
        """This rank's [lo, hi) inside a global batch of `global_size` samples."""
        return shard_range(global_size, self.rank, self.world_size)

    def indices(self, epoch: int) -> torch.Tensor:
        """[n_local] every sample index this rank sees in `epoch`, in order."""
        parts = []
        for b in range(self.num_batches):
            g = self.global_batch(epoch, b)
            lo, hi = self.local_range(len(g))
            parts.append(g[lo:hi])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
