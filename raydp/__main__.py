import sys

from raydp.cli import main

sys.exit(main())
