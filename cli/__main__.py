"""``python -m normswap_cli``: the ``normswap`` command (also ``torchrun -m normswap_cli distill ...``)."""

from normswap_cli.app import main

main()
