"""A torchrun entry for tests/test_dump_folder_lock.py: ``canon_titan.train`` with the lease
refreshed (and a takeover noticed) every 0.2 s instead of every 30 s."""

import sys

from canon_titan.launch import ownership

ownership.LEASE_REFRESH_S = 0.2

if __name__ == "__main__":
    from canon_titan.train import main

    sys.exit(main())
