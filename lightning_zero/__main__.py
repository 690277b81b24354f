import sys

from lightning_zero.cli import main

sys.exit(main())
