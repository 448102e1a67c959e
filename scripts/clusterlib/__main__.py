import sys

from clusterlib.cli import main

sys.exit(main())
