"""Wallets credited by a payment provider's webhook: the fault harness's example (``charon test-app``).

The provider delivers each payment at least once: a redelivery (the provider's retry) is a new request carrying
the same payment ``token``, and a wallet must credit each token once. :data:`app` checks the tokens it credited
in the wallet's state (``ctx.put_item``), in the same transaction as the credit. :data:`buggy_app` is missing
that check: it remembers the tokens in module-level process memory (by transaction, so that the engine's own
re-execution of a transaction is not taken for a redelivery). On a stable cluster (one Python worker that never
restarts) that holds, and the app passes; it credits a redelivered payment twice (the service pays twice) when
the retry runs in another process than the first delivery: after a rescale moved the wallet to a worker that
joined the cluster, a task moved, or the worker restarted. ``charon test-app charon.apps.wallets:buggy_app
--seeds 10 --workload charon.apps.wallets:payments --invariant charon.apps.wallets:credited_once --cluster
stable`` finds it with rescales, and not with ``--no-rescales``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from charon import Application, Context, Operator

if TYPE_CHECKING:
    from charon.testing.harness import Snapshot

WALLETS = ("w0", "w1", "w2")
#: buggy_app's defect: (wallet, token) -> the transaction (TID) that credited it, in this process's memory. Keyed by TID
#: because the engine may run a transaction more than once (a conflict's re-execution): that is not a redelivery.
_CREDITED: dict[tuple[str, str], int] = {}


def make_app(remember: str) -> Application:
    """The wallet service; ``remember``: where credited tokens are kept, ``"state"`` or ``"memory"`` (the
    defect)."""
    wallet = Operator("wallet")

    @wallet.function(public=True)
    async def credit(ctx: Context, token: str, amount: int) -> int:
        """Credit ``amount`` once per payment ``token``; returns the balance."""
        if remember == "state":
            if ctx.get_item("paid:" + token) is not None:  # a redelivery: already credited
                return ctx.get(default=0)
            ctx.put_item("paid:" + token, amount)
        else:
            if _CREDITED.setdefault((ctx.key, token), ctx.tid) != ctx.tid:  # another transaction credited it
                return ctx.get(default=0)
        b = ctx.get(default=0) + amount
        ctx.put(b)
        return b

    @wallet.function(public=True)
    async def pay(ctx: Context, to: str, amount: int) -> int:
        """Move ``amount`` to wallet ``to`` (aborts if short); returns the balance left."""
        b = ctx.get(default=0)
        if amount <= 0 or b < amount or to == ctx.key:
            raise ValueError(f"cannot pay {amount} of {b}")
        ctx.put(b - amount)
        await ctx.call(wallet, to, deposit, amount)
        return b - amount

    @wallet.function
    async def deposit(ctx: Context, amount: int) -> int:
        """The receiving side of ``pay``."""
        b = ctx.get(default=0) + amount
        ctx.put(b)
        return b

    return Application("wallets", [wallet])


app = make_app("state")
buggy_app = make_app("memory")


def payments(rng: random.Random) -> list[tuple[object, ...]]:
    """Payments (some redelivered a little later: the same token again, a new request) and payments between
    wallets."""
    out: list[tuple[object, ...]] = []
    for n in range(60):
        if rng.random() < 0.6:
            credit = ("wallet", rng.choice(WALLETS), "credit", f"tok{n}", rng.randint(1, 50))
            out.append(credit)
            if rng.random() < 0.4:
                out.insert(len(out) + rng.randint(0, 3), credit)
        else:
            out.append(("wallet", rng.choice(WALLETS), "pay", rng.choice(WALLETS), rng.randint(1, 30)))
    return out


def credited_once(s: Snapshot) -> None:
    """Money is conserved: the wallets hold exactly the payments credited, each (wallet, token) once (the first
    credit of a token counts; a redelivery changes nothing)."""
    paid: dict[tuple[str, str], int] = {}
    for inv, _ in s.committed():
        if inv.function == "credit":
            paid.setdefault((inv.key, inv.args[0]), inv.args[1])
    total = sum(b for b in s.entities("wallet").values() if isinstance(b, int))  # balances are ints
    assert total == sum(paid.values()), f"the wallets hold {total}, the distinct payments sum to {sum(paid.values())}"
