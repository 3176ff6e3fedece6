"""``python -m charon.cli``: the ``charon`` command (:func:`charon.cli.main`)."""

from charon.cli import main

main()
