"""YCSB-T (Styx §8.1): money transfers between accounts; the total balance never changes."""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator

from charon import Application, Context, Operator

account = Operator("account")
INITIAL_BALANCE = 1_000_000


class NotEnoughCredit(Exception):
    """The debtor's balance is below the amount."""


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    """Move ``amount`` from this account to ``to``; returns this account's new balance."""
    balance = ctx.get(default=0)
    if balance < amount:
        raise NotEnoughCredit(f"account {ctx.key} has {balance}, needs {amount}")
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)
    return balance - amount


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> None:
    """Add ``amount`` to this account."""
    ctx.put(ctx.get(default=0) + amount)


@account.function(public=True)
async def balance(ctx: Context) -> int:
    """This account's balance."""
    return ctx.get(default=0)


app = Application("ycsb", [account])


def key(i: int) -> str:
    """The key of account number ``i``."""
    return f"a{i}"


def initial_state(n: int, balance: int = INITIAL_BALANCE) -> dict[str, int]:
    """``n`` accounts with ``balance`` each."""
    return {key(i): balance for i in range(n)}


class Zipf:
    """Zipfian sampler over 0..n-1 with coefficient ``c`` (c = 0 is uniform)."""

    def __init__(self, n: int, c: float) -> None:
        self.n = n
        self.c = c
        if c > 0:
            weights = [1.0 / (i + 1) ** c for i in range(n)]
            total = sum(weights)
            acc = 0.0
            self.cdf = []
            for w in weights:
                acc += w / total
                self.cdf.append(acc)

    def sample(self, rng: random.Random) -> int:
        if self.c <= 0:
            return rng.randrange(self.n)
        return min(bisect.bisect_left(self.cdf, rng.random()), self.n - 1)


def workload(
    n: int, count: int, *, zipf: float = 0.0, seed: int = 0, max_amount: int = 10, partitions: int | None = None,
    multi_partition: float | None = None,
) -> Iterator[tuple[str, str, str, list]]:
    """``count`` transfers as (operator, key, function, args): uniform debtors, uniform or Zipf creditors.

    ``multi_partition`` (with ``partitions``) sets the share of transfers whose creditor lives in another
    partition than the debtor (the rest stay in the debtor's partition).
    """
    from charon.core.routing import partition_of

    rng = random.Random(seed)
    creditors = Zipf(n, zipf)
    for _ in range(count):
        debtor = rng.randrange(n)
        creditor = creditors.sample(rng)
        if multi_partition is not None and partitions:
            want_remote = rng.random() < multi_partition
            for _ in range(64):
                same = partition_of("account", key(creditor), partitions) == partition_of(
                    "account", key(debtor), partitions
                )
                if same != want_remote:
                    break
                creditor = creditors.sample(rng)
        yield ("account", key(debtor), "transfer", [key(creditor), rng.randint(1, max_amount)])
