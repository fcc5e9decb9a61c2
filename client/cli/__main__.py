"""``python -m ptcfs.client.cli`` runs ``ptcctl``."""

import sys

from ptcfs.client.cli.app import main

sys.exit(main())
