"""The drain of code versions (issue 34), one owner for every engine and every caller of ``update_code``.

* :func:`plan_update`: what a code update decides at its epoch boundary, before anything is recorded: it refuses
  (:class:`~charon.errors.VersionInUse`) to drop the code of a version with workflows in flight
  (:func:`dropped_versions`: its recorded ref is no longer installed), and names the drained versions whose
  applications it unloads (recorded with the update: ``unloaded_at`` in the code history, so a replay or a
  relaunched process loads what the record says, never what a clock or a scan would say then).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence

from charon.errors import VersionInUse
from charon.runtime.contract import Controls
from charon.runtime.control.codeversions import CodeVersion

__all__ = ["dropped_versions", "plan_update", "ref_installed"]


def ref_installed(ref: str) -> bool:
    """Whether ``ref``'s module can still be imported from what is installed: found on the path, and (when it was
    imported already) its source file still there."""
    try:
        spec = importlib.util.find_spec(ref.partition(":")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = spec.origin
    return origin is None or not os.path.isabs(origin) or os.path.exists(origin)


def dropped_versions(versions: Sequence[CodeVersion], new_ref: str,
                     installed: Callable[[str], bool] = ref_installed) -> list[str]:
    """The labels of the recorded ``versions`` (oldest first) whose code a deploy of ``new_ref`` would drop: their
    newest recorded ref is another than ``new_ref`` and no longer installed (``installed(ref)``; a version without a
    ref is the application the engine was built with: it stays loaded)."""
    refs = {v.version: v.ref for v in versions}
    return sorted(label for label, ref in refs.items() if ref is not None and ref != new_ref and not installed(ref))


async def plan_update(controls: Controls, versions: Sequence[CodeVersion], workflows: Iterable[str], ref: str,
                      version: str, keep: str | None = None,
                      installed: Callable[[str], bool] = ref_installed) -> list[str]:
    """What a code update to ``ref`` labelled ``version`` decides at its epoch boundary (call it holding the
    boundary, before recording anything): :class:`~charon.errors.VersionInUse` if it would drop the code of a
    version with workflows in flight (:func:`dropped_versions`); else the labels whose applications it unloads:
    recorded versions with a ref (the node's first, built-in application stays), still loaded, neither ``version``
    nor ``keep`` (a compatible update's previous version: a transaction deferred before the boundary may still
    start a workflow on it), with no workflow of ``workflows`` in flight. The records are read only when some
    version could be dropped or unloaded (:meth:`~charon.runtime.contract.Controls.workflows_in_flight`); a count
    stopped at its :data:`~charon.runtime.contract.MAX_WORKFLOW_SCAN` unloads nothing."""
    dropped = dropped_versions(versions, ref, installed)
    newest = {v.version: v for v in versions}
    candidates = sorted(label for label, v in newest.items()
                        if v.ref is not None and v.unloaded_at is None and label not in (version, keep))
    if not dropped and not candidates:
        return []
    names = sorted(set(workflows))
    if not names:
        return candidates
    drain = await controls.workflows_in_flight(names)  # (the drain's count)
    for label in dropped:
        n = drain.count(label)
        if n:
            raise VersionInUse(f"code version {label!r} has {n} workflow(s) in flight and its code is no longer "
                               f"installed: migrate or cancel them first (charon workflows migrate --from {label})")
    if drain.truncated:
        return []
    return [label for label in candidates if drain.count(label) == 0]
