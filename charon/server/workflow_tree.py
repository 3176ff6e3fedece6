"""One workflow's progress as one tree (``GET /workflows/{name}/{id}/tree``, ``charon workflows show --tree``).

The root is the workflow (id, workflow, version, status, step, created, updated); below it its steps in order
(from the record's ``history``), each with its transaction's call graph from the inspector while it keeps it (found
by TID), and what the workflow awaits now: a promise's record (status, deadline), an effect's attempts and last
error (when an effect executor runs beside this gateway), a timer's due time. The record and the promises are read
as of one committed epoch (``Controls.inspect``; the cut is named in ``epoch``).

Bounded: the newest ``steps`` history entries (at most :data:`MAX_STEPS`; ``omitted`` counts the others and the
ones the record dropped) and at most :data:`MAX_NODES` call-graph nodes per step (``truncated``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from charon import serde
from charon.core.promises import PROMISE_OPERATOR
from charon.core.routing import split_store_key
from charon.errors import EpochNotRetained
from charon.runtime.contract import RequestLog
from charon.server.promises import StateReader

__all__ = ["MAX_NODES", "MAX_STEPS", "EffectLookup", "workflow_tree"]

MAX_STEPS = 200
MAX_NODES = 100
_HEAD = ("id", "workflow", "version", "status", "step", "seq", "created", "updated", "result", "error")
_STEP = ("step", "seq", "attempt", "tid", "time", "ok", "awaits", "finished", "migrated", "to_step")
_NO_GRAPH = "not kept by the inspector (dropped after its retention or a restart, or the inspector is off)"
_NO_INSPECTOR = "no inspector here (this gateway's engine runs elsewhere)"
#: an effect executor's lookup by id (:meth:`charon.server.admin.EffectsAdmin.get_effect`; it reads SQLite)
EffectLookup = Callable[[str], Mapping[str, object] | None]
Doc = dict[str, object]


async def _main_values(gw: StateReader, operator: str, keys: list[str], epoch: int | None
                       ) -> tuple[int | None, dict[str, Doc]]:
    """The main values of ``operator``'s entities ``keys`` as of ``epoch`` (None: the last committed one)."""
    controls = gw.engine.controls
    values: dict[str, Doc] = {}
    if controls is None:  # an engine without controls: its committed values, one by one
        for k in keys:
            v = await asyncio.to_thread(gw.engine.read_state, operator, k)
            if isinstance(v, dict):
                values[k] = v
        return None, values
    page = await controls.inspect(operator, keys, epoch)
    for skey, raw in page.rows.items():
        _, key, item = split_store_key(skey)
        v = serde.decode(raw)
        if item == "" and isinstance(v, dict):
            values[key] = v
    return page.epoch, values


async def _read(gw: StateReader, operator: str, wid: str) -> tuple[int | None, Doc, dict[str, Doc]] | None:
    """The record and the promises it awaits, as of one epoch (None: no such workflow)."""
    for attempt in range(3):  # the cut left the retention between the two reads: read both again
        epoch, recs = await _main_values(gw, operator, [wid], None)
        rec: Any = recs.get(wid)
        if rec is None:
            return None
        pids = [str(a["id"]) for a in rec.get("awaiting") or [] if a.get("kind") == "promise"]
        try:
            promises = (await _main_values(gw, PROMISE_OPERATOR, pids, epoch))[1] if pids else {}
        except EpochNotRetained:
            if attempt == 2:
                raise
            continue
        return epoch, rec, promises
    return None


def _docs(v: object) -> list[Doc]:
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _tid(entry: Mapping[str, object]) -> int | None:
    t = entry.get("tid")
    return t if isinstance(t, int) else None


def _graphs(log: RequestLog | None, tids: list[int]) -> dict[int, dict[str, object]]:
    """The inspector's details of the transactions ``tids`` it still keeps (run off the event loop)."""
    out: dict[int, dict[str, object]] = {}
    if log is None:
        return out
    for tid in tids:
        d = log.by_tid(tid)
        if d is not None:
            out[tid] = d
    return out


def _step(entry: Mapping[str, object], detail: Mapping[str, object] | None, log: RequestLog | None) -> Doc:
    node: Doc = {k: entry[k] for k in _STEP if k in entry}
    if detail is None:
        node.update(call_graph=None, note=_NO_INSPECTOR if log is None else _NO_GRAPH)
        return node
    graph = detail.get("call_graph")
    nodes = graph if isinstance(graph, list) else []
    node.update(request_id=detail.get("request_id"), epoch=detail.get("epoch"), call_graph=nodes[:MAX_NODES],
                truncated=bool(detail.get("truncated")) or len(nodes) > MAX_NODES)
    return node


def _awaited(a: Mapping[str, object], promises: Mapping[str, Doc],
             effects: Mapping[str, Mapping[str, object] | None] | None) -> Doc:
    node: Doc = {k: a[k] for k in ("kind", "id", "deadline", "index") if k in a}
    kind = a.get("kind")
    if kind == "promise":
        rec = promises.get(str(a["id"]))
        node["promise"] = None if rec is None else {k: rec.get(k) for k in ("status", "created", "deadline")}
        if rec is None:
            node["note"] = "no such promise record (settled and forgotten after its retention)"
    elif kind == "timer":
        node["due"] = a.get("deadline")
    elif kind == "effect":
        row = None if effects is None else effects.get(str(a["id"]))
        if effects is None:
            node["note"] = "no effect executor beside this gateway (charon effects list on its worker)"
        elif row is None:
            node["note"] = "not taken in by the effect executor yet"
        else:
            node["effect"] = {k: row.get(k) for k in ("status", "handler", "attempts", "max_attempts", "last_error",
                                                      "next_at", "outcome")}
    return node


async def workflow_tree(gw: StateReader, operator: str, wid: str, steps: int = 50,
                        effect: EffectLookup | None = None) -> Doc | None:
    """Workflow ``wid``'s tree (see the module docstring), its newest ``steps`` steps; None: no such workflow."""
    gw.check_ready()
    read = await _read(gw, operator, wid)
    if read is None:
        return None
    epoch, rec, promises = read
    history = _docs(rec.get("history"))
    shown = history[-steps:]
    log = gw.engine.requests
    tids = [t for t in map(_tid, shown) if t is not None]
    details = await asyncio.to_thread(_graphs, log, tids)
    awaiting = _docs(rec.get("awaiting"))
    effects: dict[str, Mapping[str, object] | None] | None = None
    if effect is not None:
        eids = [str(a["id"]) for a in awaiting if a.get("kind") == "effect"]
        effects = {eid: await asyncio.to_thread(effect, eid) for eid in eids}
    tree: Doc = {k: rec.get(k) for k in _HEAD}
    tree.update(epoch=epoch, omitted=len(history) - len(shown) + int(str(rec.get("dropped") or 0)),
                steps=[_step(e, details.get(_tid(e) or -1), log) for e in shown],
                awaiting=[_awaited(a, promises, effects) for a in awaiting])
    return tree
