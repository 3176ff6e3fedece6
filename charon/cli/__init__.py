"""The ``charon`` command line (Typer): :func:`main` is the ``charon`` console script, ``python -m charon.cli`` the
same. ``charon demo`` is the quickest tour (:mod:`charon.cli.demo`).

One module per command group: :mod:`~charon.cli.app` (the application, its global options, :func:`main`),
:mod:`~charon.cli.run` (``charon run``; its gateway processes: :mod:`~charon.cli.gatewayprocs`),
:mod:`~charon.cli.ops` (``invoke``, ``state``, ``read``, ``sql`` and the admin commands), :mod:`~charon.cli.demo`,
:mod:`~charon.cli.effects`, :mod:`~charon.cli.harness` (``test-app``), :mod:`~charon.cli.requests`,
:mod:`~charon.cli.limits`, :mod:`~charon.cli.promises` (promises and schedules); what they share is in
:mod:`~charon.cli.parts`, how a command fails in :mod:`~charon.cli.fail`, the exit codes in
:mod:`~charon.cli.exitcodes`. :mod:`~charon.cli.errordoc` renders the error reference page
(``python -m charon.cli.errordoc --write``).

``--url`` and ``--token`` default to the ``CHARON_URL`` and ``CHARON_TOKEN`` environment variables. Every command
exits with a code of :class:`charon.cli.exitcodes.ExitCode` (docs/reference/exit-codes.md); an error is one line on
stderr, its traceback only with ``charon --debug`` (or ``CHARON_DEBUG=1``).
"""

from charon.cli.app import app, main

__all__ = ["app", "main"]
