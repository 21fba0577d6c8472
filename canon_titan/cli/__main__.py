import sys

from canon_titan.cli import main

sys.exit(main())
