"""``python -m kvconvert.cli``: the same as the ``kvconvert`` script."""

from kvconvert.cli import main

main()
