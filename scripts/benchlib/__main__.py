import sys

from benchlib.cli import main

sys.exit(main())
