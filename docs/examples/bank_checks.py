# bank_checks.py: a workload and invariants for bank.py, for `charon test-app`
import random

from charon.testing import Invocation, Snapshot

ACCOUNTS = ["alice", "bob", "carol"]


def workload(rng: random.Random) -> list[Invocation]:
    """Deposits of 100 into each account, then random transfers (some overdraw, so they abort)."""
    calls = [Invocation("account", a, "deposit", (100,)) for a in ACCOUNTS]
    for _ in range(30):
        src, dst = rng.sample(ACCOUNTS, 2)
        calls.append(Invocation("account", src, "transfer", (dst, rng.randint(1, 150))))
    return calls


def conserved(snapshot: Snapshot) -> bool:
    """Transfers move money, never make or lose it: the total is what the committed deposits put in."""
    deposited = sum(int(inv.args[0]) for inv, _ in snapshot.committed() if inv.function == "deposit")
    return sum(int(v) for v in snapshot.entities("account").values()) == deposited


def no_overdraft(snapshot: Snapshot) -> bool:
    return all(int(v) >= 0 for v in snapshot.entities("account").values())
