"""The deterministic simulator of the Spark paths (charon.testing.simulation) as part of the suite.

``CHARON_SIM_SEEDS`` seeds (default 1,000) run in chunks; a failure lists one reproduction line per seed
(``python -m charon.testing.simulation --seed N``). The explicit cases are defects the simulator found on the code
it was written against (each names its defect); they fail until that defect is fixed.
"""

from __future__ import annotations

import os

import pytest

from charon import serde
from charon.core.routing import store_key
from charon.testing.simulation import Faults, Simulation, repro_line, run_seed
from charon.testing.workloads import Workload

pytestmark = pytest.mark.usefixtures("fresh_means_empty")  # see conftest.py

SEEDS = int(os.environ.get("CHARON_SIM_SEEDS", "1000"))
WITHOUT = frozenset(x for x in os.environ.get("CHARON_WORKLOAD_WITHOUT", "").split(",") if x)  # local bisecting
CHUNK = 100


@pytest.mark.parametrize("start", range(0, SEEDS, CHUNK))
def test_seeds(start: int) -> None:
    outcomes = [run_seed(s, without=WITHOUT) for s in range(start, min(start + CHUNK, SEEDS))]
    failed = [repro_line(o, WITHOUT) for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    assert sum(o.stats["requests"] for o in outcomes) > 0


#: Seeds that failed on the code the simulator was written against (generator as of this file): defect, first
#: failure. They are among the seeds above; named here so a regression points at its defect.
FOUND_SEEDS = {
    2: "r2: calls created before they are awaited, replayed from the journal: the root's reply differs",
    5: "r7: a state read during an epoch rolled the durable copy back ('durable copy reaches -1')",
    8: "r2: a read journaled twice shifts the replay: a scan gets None (TypeError abort the oracle never sees)",
    272: "r3: after a driver crash the replayed epoch contradicts a reply already delivered",
    2534: "a verdict taken in the fallback (an overrun in a locked re-run) was forgotten by the transaction's next "
          "run once it was queued again: its reply (another error) contradicted the recorded verdict",
}


@pytest.mark.parametrize("seed", sorted(FOUND_SEEDS))
def test_found_seeds(seed: int) -> None:
    o = run_seed(seed)
    assert o.ok, f"{FOUND_SEEDS[seed]}\n{repro_line(o)}"


def test_seeds_with_the_input_log_resized_between_epochs() -> None:
    """``log_growth``: the input log grows (and maybe shrinks its routing count) before some epochs, the driver
    may crash inside the switch; every check of the simulation holds, and the epochs read the grown log."""
    outcomes = [run_seed(s, log_growth=True) for s in range(120)]
    failed = [repro_line(o, log_growth=True) for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    assert sum(o.stats["log_resizes"] > 0 for o in outcomes) > 40
    assert sum(o.stats["log_partitions_read"] > 4 for o in outcomes) > 10, "epochs read more partitions than any start"


def test_a_seed_is_deterministic(tmp_path) -> None:
    runs = []
    for i in range(2):
        sim = Simulation(7, str(tmp_path / str(i)))
        try:
            outcome: object = sim.run()
        except AssertionError as exc:  # the same failure, if any, both times
            outcome = str(exc)
        runs.append((outcome, sim.events, sim.expected, sim.rounds))
    assert runs[0] == runs[1]
    assert runs[0][3] > 0 and len(runs[0][1]) > 2


def _case(tmp_path, epochs: list, live: bool, faults: Faults, seed: int = 1, partitions: int = 2) -> Simulation:
    w = Workload({}, {}, [[(k, 0, prog, 1.0) for k, prog in ep] for ep in epochs], partitions, live)
    return Simulation(seed, str(tmp_path), workload=w, faults=faults)


QUIET = dict(hop=0.0, lose=0.0, restart=0.0, retry=0.0, read=0.0, crash=0.0, max_crashes=0)


@pytest.mark.parametrize("seed", range(6))
def test_r3_resumed_in_another_worker(tmp_path, seed: int) -> None:
    """r3: a call created before a send and awaited after it; rounds land in random workers, so the resuming
    round finds its live coroutine or replays the function from its journal: it must not send twice."""
    prog = [["early", "d", [], [["send", "c", [["add", "c0", 10]]]]]]
    sim = _case(tmp_path, [[("a", prog)]], live=True, faults=Faults(workers=2, **{**QUIET, "hop": 1.0}), seed=seed)
    out = sim.run()  # raises a Violation on any oracle difference
    assert out["requests"] == 1 and len(sim.delivered) == 1
    (reply,) = sim.delivered.values()
    assert reply.ok, reply
    final = sim.durable_state(out["epochs"] - 1)
    assert serde.decode(final[store_key("node", "c", "\x01c0")]) == 10  # the send ran once, not twice


def test_r7_state_read_during_an_epoch(tmp_path) -> None:
    """r7: a state read (at the last recorded epoch) after a partition finalized the next epoch but before
    its record is written must not roll the durable copy back."""
    sim = _case(tmp_path, [[("a", [["put", 1]])], [("a", [["get"], ["put", 2]])]], live=True,
                faults=Faults(workers=1, **{**QUIET, "read": 1.0}))
    out = sim.run()  # before the fix: Violation "epoch 0 is recorded but p0's durable copy reaches -1"
    assert out["epochs"] == 2 and out["requests"] == 2
    assert all(r.ok for r in sim.delivered.values()) and len(sim.delivered) == 2
    # the durable copy reaches the last epoch (nothing rolled back) and holds the oracle's state
    assert sim.durable_state(1) == sim.expected[1] and store_key("node", "a") in sim.expected[1]


DEFERS = Workload(  # found by search: the first epoch defers one transaction to the next (1 partition)
    {"a": 9, "b": 2}, {},
    [[("d", 0, [["send", "d", [["send", "a", [["raise_r", 0.2], ["raise_r", 0.05], ["add", "c0", 2]]],
                              ["call", "b", [["send", "c", [["raise_r", 0.2], ["add", "c1", 3], ["raise_r", 0.2]]]]],
                              ["raise_r", 0.2]]], ["put", 4], ["dcall", ["d", "d"], []]], 2.0),
      ("a", 1, [["get"], ["raise_if", 10]], 1.0), ("b", 1, [["scan", None, "i0"], ["put", -2]], 2.0),
      ("c", 2, [["put", -2]], 3.0),
      ("a", 0, [["scan", "i1", "i1"], ["call", "c", [["scan", "i0", "i1"]]], ["iget", "i1"], ["put_if", 0, 5]], 1.0),
      ("b", 1, [["scan", None, "i0"], ["scan", None, "i2"], ["get"],
                ["call", "d", [["scan", "i1", "i1"], ["call", "d", [["get"], ["call", "d", [["raise_if", 6], ["get"]]],
                                                                   ["iget", "i2"], ["iget", "i1"]]]]],
                ["put_if", 5, 4]], 2.0),
      ("b", 2, [["iget", "i1"], ["get"], ["get"], ["put_if", 3, 5]], 1.0)],
     [("d", 1, [["raise_if", 9], ["scan", None, "i2"], ["iget", "i2"], ["get"]], 2.0),
      ("b", 0, [["iget", "i1"], ["get"]], 3.0)]],
    partitions=1, live=True,
)


@pytest.mark.parametrize("seed", range(8))
def test_deferred_work_survives_crashes(tmp_path, seed: int) -> None:
    """A deferred transaction is finished by a later (tick) epoch, whatever crashes, hops and reads happen."""
    faults = Faults(workers=2, hop=0.5, lose=0.1, restart=0.2, retry=0.3, read=0.4, crash=0.3, max_crashes=3)
    sim = Simulation(seed, str(tmp_path), workload=DEFERS, faults=faults)
    stats = sim.run()  # checks that every request, the deferred one included, has exactly one outcome
    deferred = [res.requests[t].request_id for res in sim.results.values() for t in res.deferred]
    assert deferred, "the workload no longer defers: find another"
    later = {res.requests[t].request_id for res in sim.results.values() for t in res.order}
    assert set(deferred) <= later and stats["requests"] == 9


def test_new_structure_is_exercised_under_crashes(tmp_path) -> None:
    """The seeds reach the epoch structure of issue 10: finalizes deferred into the next batch's first round
    (pipeline_finalize), whole fallbacks in one task, an epoch's rest in one task, and driver crashes while
    an epoch's finalize is pending at every fault point (recovery then re-runs that epoch); every seed still
    equals the serial oracle."""
    import re
    import shutil

    pending_crashes: set[str] = set()
    pipelined = fallback_jobs = rest_jobs = 0
    wanted = {"before_epoch", "before_job", "after_round", "after_finalize", "after_defer", "after_record"}

    def reached() -> bool:
        return pipelined > 50 and fallback_jobs > 20 and rest_jobs > 20 and wanted <= pending_crashes

    # seeds 0, 1, ... until everything is reached (seed 111 today; at most 200): the same seeds run in test_seeds,
    # so the runs past that point proved nothing this test asks
    for seed in range(200):
        if reached():
            break
        sim = Simulation(seed, str(tmp_path / str(seed)))
        try:
            stats = sim.run()
        finally:
            shutil.rmtree(tmp_path / str(seed), ignore_errors=True)
        pipelined += stats["pipelined"]
        fallback_jobs += stats["fallback_jobs"]
        rest_jobs += stats["rest_jobs"]
        pending: set[int] = set()
        for ev in sim.events:
            if m := re.match(r"epoch (\d+): finalize deferred", ev):
                pending.add(int(m.group(1)))
            elif m := re.match(r"epoch (\d+) verified", ev):
                pending.discard(int(m.group(1)))
            elif ev.startswith("CRASH at ") and pending:
                pending_crashes.add(ev.split()[2])
    assert pipelined > 50 and fallback_jobs > 20 and rest_jobs > 20, (pipelined, fallback_jobs, rest_jobs)
    assert wanted <= pending_crashes, pending_crashes


def test_a_replayed_epoch_keeps_its_first_runs_chunks(tmp_path, monkeypatch) -> None:
    """Each driver (re)start chooses another chunk size (1, then whole epochs, ...), as a changed configuration
    would: every epoch runs with the chunk size its previous epoch's record names (``next_chunk``), so an epoch
    replayed after a crash (its replies out, its record not written) decides as its first run did."""
    import itertools

    import charon.runtime.spark.runtime as sr

    starts = itertools.count()

    def chunk(self: sr.SparkRuntime) -> int:
        if "_test_chunk" not in self.__dict__:
            self._test_chunk = [1, 0][next(starts) % 2]
        return self._test_chunk

    monkeypatch.setattr(sr.SparkRuntime, "_chunk", chunk)
    failed, crashed = [], 0
    for seed in range(60):
        sim = Simulation(seed, str(tmp_path / str(seed)))
        sim.chunk = None  # the runtime's choice, not the simulator's
        try:
            sim.run()
        except Exception as exc:  # noqa: BLE001 - every failing seed is listed
            failed.append(f"seed {seed}: {type(exc).__name__}: {exc}"[:300])
        crashed += sim.crashes
    assert not failed, "\n".join(failed)
    assert crashed > 20  # restarts (with the other chunk size) really happened


def test_overruns_become_replay_exact_verdicts(tmp_path) -> None:
    """Seeds whose tasks stop functions as past their budget (in an epoch's first run only; a rerun after a driver
    crash takes no new verdict): the driver records each verdict before its replies, recovery applies it, and
    every epoch still equals the serial oracle with those transactions aborted."""
    import shutil

    overruns = verdicts = crashed = 0
    for seed in range(120):
        sim = Simulation(seed, str(tmp_path / str(seed)))
        if not sim.overrun:
            continue
        try:
            stats = sim.run()
        finally:
            shutil.rmtree(tmp_path / str(seed), ignore_errors=True)
        overruns += stats["overruns"]
        verdicts += stats["verdicts"]
        crashed += bool(stats["verdicts"] and stats["crashes"])
    assert overruns >= 10 and verdicts >= 5 and crashed >= 1, (overruns, verdicts, crashed)


def test_a_rerun_sees_the_fired_timers_replies_a_dead_driver_wrote(monkeypatch) -> None:
    """A fired timer's request is in no log, so a rerun after a driver crash found its reply only through the
    reply mark its epoch's first start recorded (``recovery.json``): with fired timers' replies written at once and
    every other reply late (lost with the crash), seed 260 judged its rerun anew and contradicted such a reply."""
    from charon.core import timers
    from charon.testing import simulation as sim

    def timers_first(self, replies):  # type: ignore[no-untyped-def]
        fired = [r for r in replies if r.request_id.startswith(timers.REQUEST_PREFIX)]
        if fired:
            self.queue.append(fired)
            self.flush()
        rest = [r for r in replies if not r.request_id.startswith(timers.REQUEST_PREFIX)]
        if rest:
            self.queue.append(rest)  # late: lost with a crash

    monkeypatch.setattr(sim.LateReplies, "put", timers_first)
    for seed in (260,):
        out = run_seed(seed, exchange="jobs")
        assert out.ok, (seed, out.error)


def test_recovery_attempts_keep_the_first_starts_reply_mark(tmp_path) -> None:
    from charon.runtime.guard.quarantine import KEEP_MARKS, RecoveryAttempts

    a = RecoveryAttempts(str(tmp_path))
    a.starting(3, 10)
    a.starting(3, 25)  # a rerun: the first start's mark stays
    a.starting(4, 30)
    a.starting(2, 99)  # an older epoch run again: nothing written
    b = RecoveryAttempts(str(tmp_path))  # read back from the file
    assert (b.epoch, b.attempts, b.reply_mark(3), b.reply_mark(4), b.reply_mark(2)) == (4, 1, 10, 30, None)
    b.starting(4 + KEEP_MARKS, 40)
    assert RecoveryAttempts(str(tmp_path)).reply_marks == {4 + KEEP_MARKS: 40}


def test_a_rerun_keeps_the_verdicts_its_stream_atom_shows() -> None:
    """Seed 21286: epoch 0 finalized and appended its stream atom, the driver died before its record, a rescale
    at the restart moved the state as of the last record (its durable copies back at -1): the rerun judged anew
    (an overrun) and its state contradicted the atom a reader may have read. An appended atom now counts as
    replied: the rerun takes only the verdicts recorded before."""
    o = run_seed(21286, exchange="jobs", log_growth=True, engine_rescale=True, pauses=True)
    assert o.ok, repro_line(o, log_growth=True, engine_rescale=True, exchange="jobs", pauses=True)
