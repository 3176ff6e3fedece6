"""The seeded simulator's resident mode (charon.testing.simulation.ResidentSimulation): the real direct sequencer
and resident exchange over a simulated gang, with the gang's fault points (task death mid-round, a dropped or slow
socket, driver death between rounds, a relaunched stage's second hello, a lingering old gang's zombie task), and at
epoch boundaries engine rescales, pauses and input-log resizes.

``CHARON_SIM_RESIDENT_SEEDS`` seeds (default 40: CI-sized) run here, as many with the boundaries' draws
(``CHARON_SIM_RESIDENT_BOUNDARY_SEEDS``); ``python -m charon.testing.simulation --seeds 1000 --exchange resident
--rescale --pause --log-growth`` runs many.
"""

from __future__ import annotations

import os

import pytest

from charon.testing.simulation import Faults, ResidentSimulation, Simulation, repro_line, run_seed, seed_exchange
from charon.testing.simulation_resident import GangFaults

pytestmark = pytest.mark.usefixtures("fresh_means_empty")  # see conftest.py

SEEDS = int(os.environ.get("CHARON_SIM_RESIDENT_SEEDS", "40"))
BOUNDARY_SEEDS = int(os.environ.get("CHARON_SIM_RESIDENT_BOUNDARY_SEEDS", "40"))
BOUNDARIES = {"engine_rescale": True, "pauses": True, "log_growth": True}


def test_resident_seeds() -> None:
    """Every check of the simulation holds over seeds of the resident mode, whose fault points are exercised."""
    outcomes = [run_seed(s, exchange="resident", zombies=False) for s in range(SEEDS)]
    failed = [repro_line(o, exchange="resident", zombies=False) for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    total = {k: sum(o.stats[k] for o in outcomes) for k in ("requests", "crashes", "query_restarts", "gangs",
                                                              "pipelined", "writer_jobs")}
    assert total["requests"] > 0 and total["writer_jobs"] > 0
    assert total["query_restarts"] > 0, "no gang was lost to a gang fault"
    assert total["crashes"] > 0, "no driver crash"
    assert total["gangs"] > SEEDS, "no gang was ever relaunched"
    assert total["pipelined"] > 0, "no finalize rode in the next epoch's first round"


def test_the_default_run_draws_both_modes() -> None:
    modes = {seed_exchange(s, "drawn") for s in range(20)}
    assert modes == {"jobs", "resident"}
    assert seed_exchange(3, "resident") == "resident" and seed_exchange(3, "jobs") == "jobs"


def test_a_resident_seed_is_deterministic(tmp_path) -> None:
    traces = []
    for i in range(2):
        sim = ResidentSimulation(11, str(tmp_path / str(i)))
        sim.run()
        traces.append([e.replace(str(tmp_path / str(i)), "") for e in sim.events])
    assert traces[0] == traces[1]
    assert any("gang" in e for e in traces[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_task_fault_at_once_still_finishes_correctly(tmp_path, seed: int) -> None:
    """High rates of every gang fault but zombies (bounded by max_losses): the run finishes, every check holds,
    and gangs were lost and replaced."""
    faults = GangFaults(die=0.3, drop=0.2, slow=0.5, zombie=0.0, linger=0.0, relaunch=0.2, max_losses=6)
    sim = ResidentSimulation(seed, str(tmp_path), gang_faults=faults)
    stats = sim.run()
    assert stats["query_restarts"] >= 1
    assert any("TASK DEATH" in e or "dropped" in e or "RELAUNCH" in e for e in sim.events)


def test_a_second_hello_breaks_the_gang(tmp_path) -> None:
    """Spark relaunched the stage: the relaunched task's hello is never seated, the gang breaks, the supervisor's
    restart replaces it, and the epochs' checks hold."""
    faults = GangFaults(die=0.0, drop=0.0, slow=0.0, zombie=0.0, linger=0.0, relaunch=1.0, max_losses=2)
    sim = ResidentSimulation(4, str(tmp_path), gang_faults=faults)
    stats = sim.run()
    assert sum("RELAUNCH" in e for e in sim.events) == 2
    assert stats["query_restarts"] >= 2 and stats["gangs"] >= 3


#: Seeds of the resident mode that found a defect, fixed since (each names it): they must pass.
FIXED_SEEDS = {
    413: "a driver crash before epoch 1's bound was durable: the direct sequencer resumed epoch 0 (its deferred "
         "finalize lost) as the epoch in flight, not as a recovered one, and the recovery record named epoch 1: "
         "the rerun took a new verdict (an overrun) contradicting a reply epoch 0's first run had delivered",
    554: "the same defect (a Boom reply delivered, then an InvocationTimeout verdict on replay)",
    619: "the same defect",
}


@pytest.mark.parametrize("seed", sorted(FIXED_SEEDS))
def test_fixed_resident_seeds(seed: int) -> None:
    o = run_seed(seed, exchange="resident", zombies=False)
    assert o.ok, f"{FIXED_SEEDS[seed]}\n{repro_line(o, exchange='resident', zombies=False)}"
    assert o.stats["crashes"] >= 1 and o.stats["overruns"] >= 1


#: Seeds of the resident mode that failed before a fix: defect, first failure.
ZOMBIE_SEEDS = {
    60: "a zombie task of an abandoned gang runs epoch 0's first round after epoch 0 was recorded: its "
        "ensure_epoch(-1) found the local copy ahead and rewound, truncating the durable copy after -1 (the "
        "recorded epoch's delta was gone: 'p0: durable copy reaches only epoch -1, need 0'); now each gang claims "
        "its partitions' durable copy under its fence, on a directory as on object storage, and the zombie is "
        "refused",
}


@pytest.mark.parametrize("seed", sorted(ZOMBIE_SEEDS))
def test_zombie_resident_seeds(seed: int) -> None:
    o = run_seed(seed, exchange="resident")
    assert o.ok, f"{ZOMBIE_SEEDS[seed]}\n{repro_line(o, exchange='resident')}"
    assert o.stats["zombie_runs"] >= 1


def test_resident_seeds_with_rescales_pauses_and_log_resizes() -> None:
    """Every check holds over resident seeds that rescale the engine partitions (the real rescale, at a boundary),
    pause and resume, and resize the input log, under the gang's and the driver's faults."""
    outcomes = [run_seed(s, exchange="resident", **BOUNDARIES) for s in range(1000, 1000 + BOUNDARY_SEEDS)]
    failed = [repro_line(o, exchange="resident", **BOUNDARIES) for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    total = {k: sum(o.stats[k] for o in outcomes) for k in ("engine_rescales", "paused", "log_resizes",
                                                              "paused_crashes", "rescale_task_deaths")}
    assert all(total.values()), total


@pytest.mark.parametrize("point", ["relayout", "relayout_committed"])
def test_a_driver_crash_inside_the_rescale(tmp_path, point: str) -> None:
    """The driver dies inside the rescale, before its layout is committed or after: the restarted driver opens the
    layout recorded, the rescale runs again (or finds it done), and every check holds."""
    for seed in range(40):
        sim = ResidentSimulation(seed, str(tmp_path / str(seed)), engine_rescale=True,
                                 faults=Faults(1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0),
                                 gang_faults=GangFaults.calm())
        if not sim.engine_plan:
            continue
        crash = sim.maybe_crash

        def at(p: str, epoch: int, sim: ResidentSimulation = sim, crash=crash) -> None:
            if p == point and not sim.crash_at:  # the first time the rescale passes it
                sim.faults.crash, sim.faults.max_crashes = 1.0, sim.crashes + 1
            crash(p, epoch)
            sim.faults.crash = 0.0

        sim.maybe_crash = at  # type: ignore[method-assign]
        stats = sim.run()
        assert stats["relayout_crashes" if point == "relayout" else "committed_crashes"] == 1
        assert stats["engine_rescales"] >= 1
        return
    pytest.fail("no seed rescales")


def test_a_task_dies_in_the_first_epoch_after_a_rescale(tmp_path) -> None:
    """The new gang's first round loses a task: the supervisor's restart reruns the epoch on another gang of the new
    layout; the checks hold."""
    hit = 0
    for seed in range(10):
        sim = ResidentSimulation(seed, str(tmp_path / str(seed)), engine_rescale=True,
                                 faults=Faults(2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0), gang_faults=GangFaults.calm())
        sim.brng.random = lambda: 0.0  # type: ignore[method-assign]  # every drawn choice: doom the new gang
        stats = sim.run()
        hit += stats["rescale_task_deaths"]
        assert stats["rescale_task_deaths"] <= stats["query_restarts"]
    assert hit > 0, "no task died after a rescale"


def test_a_crash_while_paused_then_resume(tmp_path) -> None:
    """The driver dies while the runtime is paused at a boundary (every epoch before it recorded, none running):
    the restarted driver reruns the epoch that waited, the operator pauses again or not, resumes; the checks hold."""
    crashed = paused = 0
    for seed in range(10):
        sim = ResidentSimulation(seed, str(tmp_path / str(seed)), pauses=True,
                                 faults=Faults(1, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0), gang_faults=GangFaults.calm())
        stats = sim.run()
        crashed += stats["paused_crashes"]
        paused += stats["paused"]
        assert any("paused before epoch" in e for e in sim.events) == (stats["paused"] > 0)
    assert crashed > 0 and paused > crashed, (crashed, paused)


#: Seeds of the resident mode with boundaries that found a defect, fixed since: they must pass.
BOUNDARY_FIXED = {
    (52, "log_growth"): "a gang lost while flushing a deferred epoch at a held gate left the gate's running epoch "
                        "set: the rescale waiting for the boundary timed out (300 s in a real runtime)",
    (3184, "log_growth,pauses"): "a query restart (a task died) reran an epoch whose only delivered reply was a fired "
                                 "timer's (its request is in no log): the rerun judged anew and contradicted it",
}


@pytest.mark.parametrize("seed,flags", sorted(BOUNDARY_FIXED))
def test_fixed_boundary_seeds(seed: int, flags: str) -> None:
    kw = {f: True for f in flags.split(",")}
    o = run_seed(seed, exchange="resident", engine_rescale=True, **kw)
    assert o.ok, f"{BOUNDARY_FIXED[seed, flags]}\n{repro_line(o, exchange='resident', engine_rescale=True, **kw)}"
    assert o.stats["engine_rescales"] >= 1 and o.stats["query_restarts"] >= 1


@pytest.mark.parametrize("seed,exchange", [(471, "resident"), (22, "jobs"), (115, "jobs")])
def test_a_rerun_after_its_finalize_takes_no_new_verdict(tmp_path, seed: int, exchange: str) -> None:
    """The driver died after an epoch's finalize but before its replies were written; the rerun, which provably
    replied nothing, used to judge anew (an overrun's verdict) while the durable copy and the stream kept the first
    run's outcomes (a replayed delta or atom is never written again): the state differed from the serial run."""
    cls = ResidentSimulation if exchange == "resident" else Simulation
    sim = cls(seed, str(tmp_path))
    sim.reply_late = 1.0  # no reply is written before the epoch's record
    stats = sim.run()  # raised Violation ("state after the epoch differs from the serial execution") before the fix
    assert stats["crashes"] >= 1 and stats["epochs"] >= 1


@pytest.mark.parametrize("boundaries", [False, True], ids=["plain", "boundaries"])
def test_a_verdict_taken_in_the_fallback_is_final(boundaries: bool) -> None:
    """Seed 1598, in a first run of epoch 2 (no crash in it; with or without the boundaries' draws): a transaction's
    locked re-run in the fallback overran its budget (the verdict recorded) while a lower transaction, grown onto an
    entity it read, was still queued; it was queued again, its next run forgot the failure and committed: an ok
    reply despite the recorded verdict (a replay judges it late, so the two runs disagreed). The verdict is now
    final in the run that takes it."""
    kw = BOUNDARIES if boundaries else {}
    o = run_seed(1598, exchange="resident", **kw)
    assert o.ok, repro_line(o, exchange="resident", **kw)
    assert o.stats["verdicts"] >= 2 and o.stats["overruns"] >= 2
